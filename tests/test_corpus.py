"""The generated corpus: Cedar's own agent programs driven by a scripted policy, with real tools."""

import random

import pytest

from cedar.agents.corpus.build import (HELDOUT, TRAIN_MIX, CorpusError, build_corpus, make_tasks, prompt_key,
                                       run_scripted, split_at_gens, tokenize_corpus, train_tasks)
from cedar.agents.corpus.scripted import ScriptedBackend, ScriptError
from cedar.agents.corpus.tasks import GENERATORS, recall_task
from cedar.backend.chat_template import CALL_HEAD
from cedar.backend.tokenizer import build_tokenizer


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_every_generator_runs_its_agent_to_the_expected_outcome(kind):
    for task in make_tasks(11, "train", {kind: 3}):
        texts = run_scripted(task)  # raises CorpusError unless the run ends as expected
        assert texts and all(t.startswith("<|bos|><|system|>") for t in texts)
        main = max(texts, key=len)
        assert CALL_HEAD in main and main.count("<|assistant|>") >= 1


def test_the_coding_sessions_really_ran_the_tests_in_a_sandbox():
    task = make_tasks(3, "train", {"coding": 1})[0]
    main = max(run_scripted(task), key=len)
    assert "<|tool|>exit 0\nok\n<|end|>" in main  # the fixed module's test passed in the subprocess
    assert "edited " in main


def test_a_script_that_does_not_fit_the_program_is_an_error():
    task = make_tasks(0, "train", {"react": 1})[0]
    key = next(iter(task.script))
    task.script[key] = task.script[key][:-2]  # no final call
    with pytest.raises((CorpusError, ScriptError)):
        run_scripted(task)
    bad = make_tasks(0, "train", {"react": 1})[0]
    bad.script[key] = ["x" * 200] + bad.script[key][1:]  # a thought the gen's regex refuses
    with pytest.raises((CorpusError, ScriptError)):
        run_scripted(bad)


def test_generation_is_deterministic_and_the_heldout_split_is_disjoint():
    a = [run_scripted(t) for t in make_tasks(0, "train", {"react": 4, "coding": 2})]
    b = [run_scripted(t) for t in make_tasks(0, "train", {"react": 4, "coding": 2})]
    assert a == b
    heldout = make_tasks(0, "heldout", HELDOUT)
    train = train_tasks(0, 0.05, heldout)
    assert not {prompt_key(t) for t in heldout} & {prompt_key(t) for t in train}
    kinds = {t.kind for t in train}
    assert kinds == set(GENERATORS)  # nothing lost to the filter: a shared question is not a shared task
    assert len(train) >= 0.95 * sum(max(1, round(n * 0.05)) for n in TRAIN_MIX.values())
    corpus = build_corpus(seed=0, scale=0.01, log=None)
    assert {s["kind"] for s in corpus.sessions} == set(GENERATORS) | {"plain"}


def test_recall_tasks_need_a_value_from_far_outside_the_window(tmp_path):
    texts = [max(run_scripted(recall_task(random.Random(i), notes=8)), key=len) for i in range(6)]
    build_tokenizer(tmp_path, 1024, corpus=texts, markup_tokens=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for i, text in enumerate(texts):
        value = recall_task(random.Random(i), notes=8).expect["answer"]
        first, last = text.find(value), text.rfind(value)
        assert first < last
        assert len(tok.encode(text[first:last]).ids) > 4 * 128


def test_sessions_are_cut_at_gen_boundaries_and_assistant_tokens_are_marked(tmp_path):
    task = make_tasks(1, "train", {"react": 1})[0]
    text = run_scripted(task)[0]
    parts = split_at_gens(text)
    assert "".join(parts) == text
    answers = task.script[next(iter(task.script))]
    for ans in answers:  # every scripted gen output is one piece of its own
        assert ans in parts
    build_tokenizer(tmp_path, 512, corpus=[text], markup_tokens=True)
    arrays = tokenize_corpus([{"kind": "react", "text": text}], tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    marked = tok.decode([int(i) for i, w in zip(arrays["ids"], arrays["weight"]) if w], skip_special_tokens=False)
    assert "Thought: " in marked and "<|tool|>" not in marked and "<|user|>" not in marked


def test_scripted_backend_keeps_fork_branch_texts():
    task = make_tasks(2, "train", {"parallel": 1})[0]
    backend = ScriptedBackend(task.script)
    from cedar.agents.runs import AGENTS

    AGENTS["parallel"](backend, task.inputs)
    texts = backend.texts()
    assert sum("\n[0] " in t for t in texts) >= 1 and sum("\n[1] " in t for t in texts) >= 1
