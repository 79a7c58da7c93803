"""The generated corpus: Cedar's own agent programs driven by a scripted policy, with real tools."""

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from cedar.backend.chat_template import tool_call_text
from cedar.training.corpus.bugs import BUG_KINDS, make_bug
from cedar.training.corpus.build import (HELDOUT, TRAIN_MIX, CorpusError, build_corpus, encode_session, make_tasks,
                                       prompt_key, run_scripted, split_at_gens, tokenize_corpus, train_tasks,
                                       value_at)
from cedar.training.corpus.common import side
from cedar.training.corpus.copying import CopyStats, copy_stats
from cedar.training.corpus.schemas import FRAMES, catalogue, loop_text, sample_value
from cedar.training.corpus.scripted import ScriptedBackend, ScriptError
from cedar.training.corpus.tasks import GENERATORS, QUESTIONS, recall_task
from cedar.backend.chat_template import CALL_HEAD, tool_call_text
from cedar.backend.tokenizer import build_tokenizer


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_every_generator_runs_its_agent_to_the_expected_outcome(kind):
    for task in make_tasks(11, "train", {kind: 3}) + make_tasks(11, "heldout", {kind: 2}):
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


# ---------------------------------------------------------------------------------------------
# Held-out templates, copying-friendly text, values, loss weights, loops that end
# ---------------------------------------------------------------------------------------------

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "cedar-agent"


def _frame_regex(frame: str) -> re.Pattern:
    """A phrasing with its fields as wildcards."""
    parts = re.split(r"\{\w+\}", frame)
    return re.compile("(.+)".join(re.escape(p) for p in parts))


@pytest.fixture(scope="module")
def splits():
    counts = {"function-calling": 300, "coding": 200, "react": 200, "recall": 40, "parallel": 40, "subagents": 40}
    return {split: make_tasks(4, split, counts) for split in ("train", "in-template", "heldout")}


def test_no_heldout_template_appears_in_the_training_split(splits):
    train = splits["train"] + splits["in-template"]
    held = splits["heldout"]
    assert not {t.template for t in train} & {t.template for t in held}
    assert all(t.template.startswith(t.kind + "/") for t in train + held)
    # bug kinds: the training split shows none of the held-out kinds, the held-out split only those
    held_kinds = set(side(list(BUG_KINDS), True))
    assert {t.expect["bug_kind"] for t in held if t.kind == "coding"} == held_kinds
    assert {t.expect["bug_kind"] for t in train if t.kind == "coding"} == set(BUG_KINDS) - held_kinds
    # tool schemas: no held-out tool name, parameter-name set, parameter name or enum value in training
    def schema_facts(tasks):
        names, sets, params, enums = set(), set(), set(), set()
        for t in tasks:
            for tool in t.inputs.get("tools", []) if t.kind == "function-calling" else []:
                f = tool["function"]
                names.add(f["name"])
                props = f["parameters"]["properties"]
                sets.add(frozenset(props))
                params.update(props)
                enums.update(v for p in props.values() for v in p.get("enum", p.get("items", {}).get("enum", [])))
        return names, sets, params, enums
    for a, b in zip(schema_facts(train), schema_facts(held)):
        assert a and b and not a & b
    assert len(schema_facts(train)[0]) >= 200 and len(schema_facts(held)[0]) >= 60  # hundreds of schemas
    # phrasings: no training request or question matches a held-out phrasing
    held_frames = [_frame_regex(f) for f in side(FRAMES, True)]
    train_frames = [_frame_regex(f) for f in side(FRAMES, False)]
    single = lambda tasks: [turn["user"] for t in tasks if t.kind == "function-calling"  # noqa: E731
                            for turn in t.inputs["turns"] if len(turn["expected"]) == 1]
    assert not [u for u in single(train) if any(r.fullmatch(u) for r in held_frames)]
    assert all(any(r.fullmatch(u) for r in held_frames) for u in single(held))
    assert all(any(r.fullmatch(u) for r in train_frames) for u in single(train))
    for form, questions in QUESTIONS.items():
        held_q = [_frame_regex(q) for q in (questions if form == "compare" else side(questions, True))]
        assert not [t for t in train if t.kind == "react" and any(r.fullmatch(t.inputs["question"]) for r in held_q)]
    assert {t.template for t in held if t.kind == "react"} >= {"react/compare"}
    # fact bases: no held-out entity in training
    entities = lambda tasks: {v for t in tasks if t.kind in ("react", "parallel", "subagents")  # noqa: E731
                              for v in t.values if v.isalpha()}
    assert len(entities(held)) >= 100
    assert not entities(train) & entities(held)
    # the in-template split: new tasks of the training templates
    trained = {t.template for t in splits["train"]} | {f"coding/{k}" for k in set(BUG_KINDS) - held_kinds} | \
        {f"function-calling/schema:{s.name}" for s in catalogue(False)}
    assert {t.template for t in splits["in-template"]} <= trained
    assert not {prompt_key(t) for t in splits["in-template"]} & {prompt_key(t) for t in splits["train"]}
    with pytest.raises(ValueError, match="unknown split"):
        make_tasks(0, "test", {"react": 1})


def test_every_bug_kind_fails_its_test_until_the_fix():
    from cedar.agents.outcome import run_test

    rng = random.Random(0)
    assert len(BUG_KINDS) >= 16 and len(side(list(BUG_KINDS), True)) >= 4
    for kind in BUG_KINDS:
        bug = make_bug(rng, kind)
        call_text = f"{bug.func}({', '.join(map(repr, bug.args))})"
        test = f"from m import {bug.func}\nassert {call_text} == {bug.want!r}\n"
        src = bug.source() + ("\n" + bug.extra if bug.extra else "")
        assert src.count(bug.bad) == 1 and len(bug.bad) <= 40 and len(bug.good) <= 40
        assert not run_test({"m.py": src, "t.py": test}, "t.py").passed, kind
        assert run_test({"m.py": src.replace(bug.bad, bug.good), "t.py": test}, "t.py").passed, kind


def test_function_calling_turns_end_with_a_text_answer_and_some_need_no_tool():
    tasks = make_tasks(2, "train", {"function-calling": 60})
    no_tool = parallel_calls = multi_turn = 0
    for task in tasks:
        text = run_scripted(task)[0]
        assert text == loop_text(task.inputs)
        turns = task.inputs["turns"]
        multi_turn += len(turns) > 1
        for turn in turns:
            assert isinstance(turn["answer"], str) and turn["answer"]
            parallel_calls += len(turn["expected"]) > 1
            if not turn["expected"]:
                no_tool += 1
                assert f"<|user|>{turn['user']}<|end|><|assistant|>{turn['answer']}<|end|>" in text
            elif "loop" not in turn:  # the results, then the answer that ends the turn
                assert "".join(f"<|tool|>{r}<|end|>" for r in turn["results"]) + \
                    f"<|assistant|>{turn['answer']}<|end|>" in text
    assert no_tool >= 3 and parallel_calls >= 5 and multi_turn >= 20


def _turn_messages(text: str, turn: dict) -> list[tuple[str, str]]:
    """(role, body) of the messages after ``turn``'s user message, up to and with its answer."""
    start = text.index(f"<|user|>{turn['user']}<|end|>") + len(f"<|user|>{turn['user']}<|end|>")
    end = text.index(f"<|assistant|>{turn['answer']}<|end|>", start) + len(f"<|assistant|>{turn['answer']}<|end|>")
    return re.findall(r"<\|(assistant|tool)\|>(.*?)<\|end\|>", text[start:end], re.S)


def test_training_loops_make_calls_one_at_a_time_and_stop_after_a_failed_call():
    """Training turns (never held-out ones) vary their loop: several calls one a request, each
    result before the next call; a call whose first result is an error is made once more after a
    transient error (then its result, or a second error) and not after a permanent one; a call
    that stays failed ends the turn: no call after it, and the answer says it failed."""
    tasks = make_tasks(2, "train", {"function-calling": 120})
    seen = {"sequential": 0, "retried": 0, "stays": 0}
    for task in tasks:
        text = run_scripted(task)[0]
        for turn in task.inputs["turns"]:
            loop = turn.get("loop")
            if not loop:
                continue
            msgs = _turn_messages(text, turn)
            roles = [r for r, _ in msgs]
            assert roles[-1] == "assistant" and msgs[-1][1] == turn["answer"]
            calls = [body for r, body in msgs[:-1] if r == "assistant"]
            tools = [body for r, body in msgs if r == "tool"]
            if loop.get("sequential"):
                seen["sequential"] += 1
                assert roles[:-1] == ["assistant", "tool"] * (len(roles) // 2)  # one call, its result, ...
                assert all(c.count("<tool_call>") == 1 for c in calls)
            fail = loop.get("failure")
            if fail is None:
                continue
            name = turn["expected"][fail["call"]]["name"]
            assert tools.count(fail["errors"][0]) >= 1 and fail["errors"][0].startswith("error: ")
            at = msgs.index(("tool", fail["errors"][0]))
            if fail["retry"]:  # the very call again, alone
                seen["retried"] += 1
                exp = turn["expected"][fail["call"]]
                after = next(m for m in msgs[at + 1:] if m[0] == "assistant")  # past the other calls' results
                assert after == ("assistant", tool_call_text(name, json.dumps(exp["arguments"])))
            else:
                assert name not in "".join(b for _, b in msgs[at + 1:-1])  # no retry after a permanent error
            stays = len(fail["errors"]) == 1 + fail["retry"]
            if stays:
                seen["stays"] += 1
                assert f"The call to {name} failed ({fail['errors'][-1][7:]})." in turn["answer"]
                last = len(msgs) - 1 - msgs[::-1].index(("tool", fail["errors"][-1]))
                assert all(r == "tool" for r, _ in msgs[last:-1])  # no call after the failure stands
            else:
                assert "failed" not in turn["answer"]
    assert seen["sequential"] >= 10 and seen["retried"] >= 5 and seen["stays"] >= 5, seen
    for task in make_tasks(2, "heldout", {"function-calling": 40}):
        assert all("loop" not in turn for turn in task.inputs["turns"])


def test_a_call_that_breaks_its_schema_is_a_corpus_error():
    task = make_tasks(5, "train", {"function-calling": 1})[0]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in task.inputs["tools"]}
    call_ = task.inputs["turns"][0]["expected"][0]
    key = next(iter(call_["arguments"]))
    call_["arguments"][key] = {"not": "allowed"}  # no schema here admits an object of that key
    key0 = next(iter(task.script))
    task.script[key0][1] = json.dumps(call_["arguments"])  # the script writes the broken call
    assert key in tools[call_["name"]]["properties"]
    with pytest.raises(CorpusError, match="invalid arguments"):
        run_scripted(task)


def test_values_are_drawn_uniformly_from_their_schema():
    rng = random.Random(1)
    positions, enum_hits = [], {}
    for schema in catalogue(False)[:200]:
        for p in schema.params:
            for _ in range(5):
                v = sample_value(rng, p)
                if p.kind in ("integer", "number"):
                    lo, hi = p.schema["minimum"], p.schema["maximum"]
                    assert lo <= v <= hi
                    positions.append((v - lo) / (hi - lo))
                elif p.kind == "enum":
                    enum_hits.setdefault(p.name + schema.name, []).append(p.schema["enum"].index(v))
    bins = np.histogram(positions, bins=4, range=(0, 1))[0] / len(positions)
    assert len(positions) > 500 and bins.min() > 0.18 and bins.max() < 0.32, bins
    firsts = [hits.count(0) / len(hits) for hits in enum_hits.values()]
    assert 0.15 < np.mean(firsts) < 0.5  # the first enum member is no favourite


@pytest.mark.skipif(not (SHIPPED_TOKENIZER / "tokenizer.json").is_file(), reason="no shipped tokenizer")
def test_copied_values_tokenize_as_where_they_are_stated():
    """With the shipped tokenizer, most values copied into a call have the same tokens where the
    user or a tool stated them; a value stated without its quotes would not (the check can fail)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER / "tokenizer.json"))
    for kind, floor in (("function-calling", 0.85), ("react", 0.75), ("recall", 0.95), ("parallel", 0.95),
                        ("subagents", 0.9)):
        stats = CopyStats()
        for split in ("train", "heldout"):
            for task in make_tasks(6, split, {kind: 12}):
                copy_stats([{"kind": kind, "text": x, "values": task.values} for x in run_scripted(task)], tok, stats)
        assert stats.copies >= 12 and stats.share >= floor, (kind, stats.to_json())
    schema = catalogue(False)[0]
    call_text = tool_call_text(schema.name, {"city": "Oslo"})
    quoted = copy_stats([{"kind": "x", "text": f'<|user|>Go to "Oslo".<|end|><|assistant|>{call_text}<|end|>'}], tok)
    bare = copy_stats([{"kind": "x", "text": f"<|user|>Go to Oslo.<|end|><|assistant|>{call_text}<|end|>"}], tok)
    assert (quoted.copies, quoted.same, bare.copies, bare.same) == (1, 1, 1, 0)


def test_a_random_values_first_statement_carries_no_loss(tmp_path):
    from cedar.training.trainer import DECISION, UNTRAINED, VALUE_START
    from tokenizers import Tokenizer

    task = next(t for t in make_tasks(8, "train", {"function-calling": 10})
                if any(isinstance(v, int) and v > 99 for turn in t.inputs["turns"] for c in turn["expected"]
                       for v in c["arguments"].values()))
    session = {"kind": task.kind, "text": run_scripted(task)[0], "values": task.values}
    build_tokenizer(tmp_path, 600, corpus=[session["text"]], markup_tokens=True)
    arrays = tokenize_corpus([session], tmp_path)
    plain = tokenize_corpus([{k: v for k, v in session.items() if k != "values"}], tmp_path)
    assert (arrays["ids"] == plain["ids"]).all()
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids, offsets = encode_session(tok, session)
    w = arrays["weight"]
    checked = 0
    for turn in task.inputs["turns"]:
        for c in turn["expected"]:
            for v in c["arguments"].values():
                if not isinstance(v, int) or isinstance(v, bool):
                    continue
                first = value_at(session["text"], json.dumps(v))
                toks = [j for j, (a, b) in enumerate(offsets) if a < first + len(json.dumps(v)) and b > first]
                assert toks and all(w[j] == UNTRAINED for j in toks)  # stated in the user message: no loss
                copy = value_at(session["text"], json.dumps(v), session["text"].index(CALL_HEAD + c["name"]))
                toks = [j for j, (a, b) in enumerate(offsets) if a < copy + len(json.dumps(v)) and b > copy]
                assert toks and w[toks[0]] == VALUE_START  # the copy's first token: weighed up
                assert all(w[j] == 1 for j in toks[1:])  # the rest of the copy: full loss
                checked += 1
    assert checked
    assert set(np.unique(plain["weight"])) <= {0, 1, DECISION}  # without values nothing is UNTRAINED
    assert (w == UNTRAINED).sum() > 0 and ((w == UNTRAINED) & (plain["weight"] > 0)).sum() == 0
    assert ((w == VALUE_START) & (plain["weight"] != 1)).sum() == 0  # only assistant tokens start copies


def test_the_demo_runs_heldout_templates_and_a_right_run_passes_their_checks():
    """`make demo`'s task file is current, holds only held-out templates (no training task uses
    them), and each task's own check passes on its scripted (right) run and fails on a wrong one."""
    from cedar.agents.demo import demo_tasks as shipped
    from cedar.agents.outcome import outcome_ok
    from cedar.agents.runs import AGENTS
    from cedar.training.corpus.build import demo_tasks

    tasks = demo_tasks()
    assert [t.to_json() for t in tasks] == [vars(t) for t in shipped()], "run scripts/write_demo_tasks.py"
    assert {t.agent for t in tasks} == {"coding", "function-calling"}
    counts = {t.kind: 40 for t in tasks}
    trained = {t.template for split in ("train", "in-template") for t in make_tasks(4, split, counts)}
    assert not {t.template for t in tasks} & trained
    for task in tasks:
        backend = ScriptedBackend(task.script)
        right = AGENTS[task.agent](backend, task.inputs)
        assert outcome_ok(task, right), task.template
        if task.agent == "coding":  # the files as they were: the test still fails
            assert not outcome_ok(task, {**right, "files_after": task.inputs["files"]})
        else:  # the same calls judged against other values: wrong
            inputs = json.loads(json.dumps(task.inputs))
            for turn in inputs["turns"]:
                for call in turn["expected"]:
                    call["arguments"] = {k: [v] for k, v in call["arguments"].items()}
            wrong = AGENTS[task.agent](ScriptedBackend(task.script), inputs)
            assert wrong["scores"]["task_errors"] == 0 and wrong["scores"]["names_ok"] > 0  # scored, not refused
            assert not outcome_ok(task, wrong)


def test_a_scripted_run_that_fails_once_is_run_again_and_one_that_fails_twice_stops_the_build(monkeypatch):
    from cedar.training.corpus import build

    task = make_tasks(0, "train", {"react": 1})[0]
    fails = {"left": 1}

    def flaky(t):  # the sandbox's clock: a test run past its limit once
        if fails["left"]:
            fails["left"] -= 1
            raise CorpusError("coding: the scripted run did not reach ...")
        return ["text"]

    monkeypatch.setattr(build, "run_scripted", flaky)
    assert build._run_scripted_twice(task) == ["text"]
    fails["left"] = 2
    with pytest.raises(CorpusError):
        build._run_scripted_twice(task)


def _schema_words(tools: list[dict]) -> set[str]:
    """Every tool name, parameter name (nested ones too) and enum value of `tools`."""
    out = set()

    def walk(props: dict):
        for pname, p in props.items():
            out.add(pname)
            out.update(p.get("enum", p.get("items", {}).get("enum", [])))
            walk(p.get("properties", {}))
    for tool in tools:
        out.add(tool["function"]["name"])
        walk(tool["function"]["parameters"]["properties"])
    return out


def test_fresh_schemas_are_new_to_every_catalogue_and_leave_the_other_tasks_as_they_were():
    held = set().union(*(_schema_words([s.tool()]) for s in catalogue(True)))
    trained = set().union(*(_schema_words([s.tool()]) for s in catalogue(False)))
    fresh = make_tasks(6, "train", {"function-calling": 40}, fresh_share=1.0)
    plain = make_tasks(6, "train", {"function-calling": 40})
    words = set()
    for task in fresh:
        made = [t for t in task.inputs["tools"] if t["function"]["name"] not in {s.name for s in catalogue(False)}]
        assert made  # at least one tool of every task is made up for it
        words |= _schema_words(made)
        run_scripted(task)  # its calls validate and its loop renders as the program writes it
    assert len(words) > 200
    assert not words & held and not words & trained  # no held-out name or value; nothing learnt by heart
    # a share: the tasks not drawn fresh are the tasks drawn without fresh schemas, input for input
    half = make_tasks(6, "train", {"function-calling": 40}, fresh_share=0.5)
    same = [a.inputs == b.inputs for a, b in zip(half, plain)]
    assert 10 < sum(same) < 30
    assert all(a.inputs == b.inputs for a, b, s in zip(half, fresh, same) if not s)
    with pytest.raises(ValueError, match="train split only"):
        make_tasks(6, "heldout", {"function-calling": 1}, fresh_share=0.5)


def test_the_first_token_after_a_result_is_a_decision(tmp_path):
    """In a function-calling session, the first token of every assistant message that follows a
    tool message (another call, or the answer that ends the loop) is DECISION, and no other token
    is; the rest of the message is a plain assistant token."""
    from cedar.training.trainer import DECISION
    from tokenizers import Tokenizer

    tasks = make_tasks(9, "train", {"function-calling": 12})
    sessions = [{"kind": t.kind, "text": run_scripted(t)[0]} for t in tasks]
    build_tokenizer(tmp_path, 600, corpus=[s["text"] for s in sessions], markup_tokens=True)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    arrays = tokenize_corpus(sessions, tmp_path)
    ids, w = arrays["ids"].tolist(), arrays["weight"]
    tool, asst, end = (tok.token_to_id(x) for x in ("<|tool|>", "<|assistant|>", "<|end|>"))
    markers = {tok.token_to_id(x) for x in ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")}
    expected = set()
    for a, b in zip(arrays["doc_start"][:-1].tolist(), arrays["doc_start"][1:].tolist()):
        roles = [(j, t) for j, t in enumerate(ids[a:b], a) if t in markers]
        for (_, prev), (j, t) in zip(roles, roles[1:]):
            if t == asst and prev == tool and ids[j + 1] != end:
                expected.add(j + 1)
    found = set(np.flatnonzero(w == DECISION).tolist())
    assert found == expected and len(found) >= 12
    # both outcomes of the choice are trained: another call and a text answer
    heads = {tok.decode([ids[j]], skip_special_tokens=False) for j in found}
    assert any(h.startswith("<tool_call>") for h in heads) and any(not h.startswith("<") for h in heads)
    assert all(w[j + 1] in (1, 3) for j in found)  # the rest of the message: assistant tokens


def test_a_served_share_of_function_calling_sessions_is_tokenized_whole_as_the_server_does(tmp_path):
    """`served_share` tokenizes that share of the function-calling sessions in one piece (as the
    server tokenizes an OpenAI-API chat: merges cross a call's edges), the rest and every other
    kind cut at their gens; the same sessions on every build; assistant tokens marked either way."""
    from tokenizers import Tokenizer

    from cedar.training.corpus.build import encode_session, served_whole

    tasks = make_tasks(9, "train", {"function-calling": 24, "react": 2})
    sessions = [{"kind": t.kind, "text": x} for t in tasks for x in run_scripted(t)[:1]]
    build_tokenizer(tmp_path, 600, corpus=[s["text"] for s in sessions], markup_tokens=True)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    cut = [encode_session(tok, s)[0] for s in sessions]
    whole = [tok.encode(s["text"], add_special_tokens=False).ids for s in sessions]
    assert sum(c != w for c, w in zip(cut, whole)) >= 12  # the two tokenizations differ

    def docs(arrays):
        starts = arrays["doc_start"].tolist()
        return [arrays["ids"][a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]

    assert docs(tokenize_corpus(sessions, tmp_path)) == cut
    served = tokenize_corpus(sessions, tmp_path, served_share=1.0)
    assert docs(served) == [w if s["kind"] == "function-calling" else c for s, c, w in zip(sessions, cut, whole)]
    marked = tok.decode([int(i) for i, w in zip(served["ids"], served["weight"]) if w], skip_special_tokens=False)
    assert "<tool_call>" in marked and "<|tool|>" not in marked and "<|user|>" not in marked
    half = [served_whole(s, 0.5) for s in sessions]
    assert 4 <= sum(half) <= 20 and half == [served_whole(s, 0.5) for s in sessions]
    assert docs(tokenize_corpus(sessions, tmp_path, served_share=0.5)) == [
        w if h else c for h, c, w in zip(half, cut, whole)]


def test_an_answer_that_reports_a_result_copies_it_as_a_call_copies_a_value(tmp_path):
    """A tool result's values (an id, a number, a reference; not its status) are among the task's
    random values: their statement in the tool message carries no loss and the answer's copy
    starts with a VALUE_START token, as a call's copy of a requested value does."""
    from cedar.agents.api_loop import reported_values, whole_value
    from cedar.training.trainer import UNTRAINED, VALUE_START
    from tokenizers import Tokenizer

    tasks = make_tasks(10, "train", {"function-calling": 12})
    sessions = [{"kind": t.kind, "text": run_scripted(t)[0], "values": t.values} for t in tasks]
    build_tokenizer(tmp_path, 600, corpus=[s["text"] for s in sessions], markup_tokens=True)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    checked = 0
    for task, session in zip(tasks, sessions):
        text = session["text"]
        w = tokenize_corpus([session], tmp_path)["weight"]
        _, offsets = encode_session(tok, session)
        for turn in task.inputs["turns"]:
            for result in turn["results"]:
                values = reported_values(result)
                assert all(v in task.values for v in values)
                assert "ok" not in values and all(v not in ("queued", "done", "accepted") for v in values)
                if f"<|tool|>{result}" not in text:
                    continue  # the call failed: its result never came
                for v in values:
                    said = text.index(f"<|tool|>{result}") + len("<|tool|>") + whole_value(v).search(result).start()
                    if said != value_at(text, v):
                        continue  # the value was stated before (a request's value, by chance)
                    toks = [j for j, (a, b) in enumerate(offsets) if a < said + len(v) and b > said]
                    assert toks and all(w[j] == UNTRAINED for j in toks)
                    copy = value_at(text, v, text.index(turn["answer"]))
                    if copy < 0:
                        continue  # the turn's answer reports a failure instead
                    j = next(j for j, (a, b) in enumerate(offsets) if b > copy)
                    assert w[j] == VALUE_START
                    checked += 1
    assert checked >= 6


def test_a_loop_turn_that_makes_a_wrong_call_gives_up_and_the_wrong_call_carries_no_loss(tmp_path):
    """With a ``mistakes`` share, some training turns make a wrong call of their own (one value
    drawn anew), get an error and end with an answer saying the call failed (no right call after
    it); the wrong call's tokens carry no loss, the answer's do. Without the share the tasks are
    what they were, and a held-out split refuses it."""
    from cedar.training.corpus.build import task_sessions
    from cedar.training.corpus.schemas import loop_render
    from cedar.training.trainer import DECISION, UNTRAINED, VALUE_START

    tasks = make_tasks(6, "train", {"function-calling": 30}, mistakes=1.0)
    assert [t.inputs for t in make_tasks(6, "train", {"function-calling": 30}, mistakes=0.0)] == \
        [t.inputs for t in make_tasks(6, "train", {"function-calling": 30})]
    with pytest.raises(ValueError, match="train split only"):
        make_tasks(6, "heldout", {"function-calling": 1}, mistakes=0.5)
    sessions = [s for t in tasks for s in task_sessions(t)]
    build_tokenizer(tmp_path, 600, corpus=[s["text"] for s in sessions], markup_tokens=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    checked = 0
    for task, session in zip(tasks, sessions):
        mistakes = [t for t in task.inputs["turns"] if "mistake" in t.get("loop", {})]
        text, spans = loop_render(task.inputs)
        assert session["text"] == text and len(spans) == len(mistakes) == len(session.get("untrained", []))
        w = tokenize_corpus([session], tmp_path)["weight"]
        _, offsets = encode_session(tok, session)
        for turn, (a, b) in zip(mistakes, spans):
            m = turn["loop"]["mistake"]
            right = turn["expected"][m["call"]]
            assert m["wrong"]["name"] == right["name"] and m["wrong"]["arguments"] != right["arguments"]
            wrong_call = tool_call_text(m["wrong"]["name"], json.dumps(m["wrong"]["arguments"]))
            assert text[a:b] == f"<|assistant|>{wrong_call}<|end|>"
            after = text[b:]
            error_msg = f"<|tool|>{m['error']}<|end|>"
            answer = f"<|assistant|>{turn['answer']}<|end|>"
            assert after.startswith(error_msg + answer)  # the error, then the answer: no call again
            assert f"The call to {right['name']} failed ({m['error'][7:]})." in turn["answer"]
            toks = [j for j, (lo, hi) in enumerate(offsets) if lo < b and hi > a]
            assert toks and all(w[j] == UNTRAINED for j in toks)
            said = b + len(error_msg) + len("<|assistant|>")
            first = next(j for j, (lo, hi) in enumerate(offsets) if hi > said)
            assert w[first] == DECISION and all(w[j] in (1, DECISION, VALUE_START) for j, (lo, hi) in
                                                 enumerate(offsets) if said <= lo and hi <= said + len(turn["answer"]))
            checked += 1
    assert checked >= 8


def test_asked_for_the_last_result_after_a_failed_call_the_answer_is_the_error_the_loop_showed():
    """A turn asking what came back answers with the last tool message the conversation shows: after
    a turn whose last call failed (or made a wrong call), the error, never a result that did not
    appear."""
    from cedar.training.corpus.schemas import LAST

    checked = errors = 0
    for task in make_tasks(3, "train", {"function-calling": 300}, mistakes=0.5):
        text = loop_text(task.inputs)
        turns = task.inputs["turns"]
        for before, turn in zip(turns, turns[1:]):
            if turn["expected"] or turn["user"] not in LAST or not before["expected"]:
                continue
            asked = text.index(f"<|user|>{turn['user']}<|end|>")
            shown = text[:asked].rsplit("<|tool|>", 1)[1].split("<|end|>")[0]
            assert turn["answer"] == f"It returned {shown}."
            checked += 1
            errors += shown.startswith("error:")
    assert checked >= 10 and errors >= 2, (checked, errors)
