"""The copy probes: a model that copies perfectly scores 1, a random one near 0; the value cases
state a value and copy it at the asked distance in the served markup; the indexer's recall finds
the entry holding the copied token; the figures land in the training curve and training.json."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cedar.backend.geometries import cedar_tiny
from cedar.backend.model_io import random_model
from cedar.training.probes import (ProbeBatch, ProbeConfig, ProbeOutput, ProbeSuite, ValueCases, layout,
                                           repeat_cases, served_plan)

AGENT = Path(__file__).resolve().parents[1] / "models" / "cedar-agent"
SMALL = ProbeConfig(gaps=(0, 64, 200), cases=3)


def copier(batch: ProbeBatch, vocab: int = 512) -> ProbeOutput:
    """A hand-built perfect copier: at each row, the token that followed the first earlier
    occurrence of the row's token in its document comes first (an induction head)."""
    B, T = batch.ids.shape
    logits = torch.zeros(B, T, vocab)
    for b in range(B):
        first: dict[int, int] = {}
        ids = batch.ids[b].tolist()
        for t in range(T):
            if batch.doc[b, t] < 0:
                continue
            if ids[t] in first and first[ids[t]] + 1 < t:
                logits[b, t, ids[first[ids[t]] + 1]] = 1.0
            first.setdefault(ids[t], t)
    return ProbeOutput(logits, None)


def test_a_perfect_copier_scores_one_and_a_random_model_near_zero():
    cfg = cedar_tiny()
    suite = ProbeSuite(cfg, SMALL)
    perfect = suite.run_forward(copier)
    assert perfect["repeat"] == {"0": 1.0, "64": 1.0, "200": 1.0}
    assert perfect["recall"] == {}  # a stub has no indexer
    torch.set_num_threads(2)
    rand = suite.run(random_model(cfg, 1))
    assert set(rand["repeat"]) == {"0", "64", "200"}
    assert all(v < 0.05 for v in rand["repeat"].values()), rand["repeat"]
    # a copier that looks one token too far back is scored as wrong: the scoring is aligned
    late = suite.run_forward(lambda b: ProbeOutput(copier(b).logits.roll(1, dims=1), None))
    assert all(v < 0.1 for v in late["repeat"].values()), late["repeat"]


def test_repeat_cases_state_a_distinct_string_and_repeat_it_after_the_gap():
    cfg = cedar_tiny()
    for gap in (0, 120):
        cases = repeat_cases(gap, SMALL, cfg.vocab_size)
        assert cases == repeat_cases(gap, SMALL, cfg.vocab_size)  # fixed seeds
        for c in cases:
            n = len(c.targets) + 1
            s = c.ids[:n]
            assert 16 <= n <= 32 and len(set(s)) == n and min(c.ids) >= 8 and max(c.ids) < 512
            assert c.ids[n + gap:] == s and len(c.ids) == 2 * n + gap
            assert not set(c.ids[n:n + gap]) & set(s)  # the filler never says a string token
            assert [c.ids[t] for t in c.targets] == [c.ids[t] for t in c.sources]
            assert c.prompt_end % 2 == 0 and n + gap <= c.prompt_end <= n + gap + 1


def test_cases_are_laid_out_as_a_served_prompt():
    cfg = cedar_tiny()
    cases = repeat_cases(500, SMALL, cfg.vocab_size)
    batch = layout(cases, 128, cfg.pad_token_id)
    P = batch.plan.narrow_end
    assert P % 128 == 0 and batch.plan.hit == P - 128 and batch.ids.shape[1] % 128 == 0
    for b, (o, c) in enumerate(zip(batch.offsets, cases)):
        assert o % 2 == 0 and o + c.prompt_end == P
        assert batch.ids[b, o:o + len(c.ids)].tolist() == list(c.ids)
        assert bool((batch.doc[b, :o] == -1).all()) and bool((batch.doc[b, o:o + len(c.ids)] == 0).all())
    assert served_plan(256, 128).hit == 0 and served_plan(384, 128).hit == 256


def test_value_cases_state_a_value_and_copy_it_in_a_call_at_the_asked_distance():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(AGENT / "tokenizer.json"))
    values = ValueCases(AGENT, ProbeConfig(cases=4))
    for d in (32, 256, 1000):
        for c in values.cases(d):
            text = tok.decode(list(c.ids), skip_special_tokens=False)
            value = tok.decode([c.ids[t] for t in c.targets])
            assert c.same_tokens and [c.ids[t] for t in c.sources] == [c.ids[t] for t in c.targets]
            assert text.startswith("<|bos|><|system|>") and text.count(value) >= 2
            last = max(i for i, t in enumerate(c.ids) if t == tok.token_to_id("<|assistant|>"))
            assert c.prompt_end in (last, last + 1)  # the model writes the call (an odd end moves back)
            call = tok.decode(list(c.ids[last:]), skip_special_tokens=False)
            assert call.startswith("<|assistant|><tool_call>{\"name\":\"") and value in call
            assert "<|user|>" in tok.decode(list(c.ids[:c.sources[0]]), skip_special_tokens=False)
            assert d <= c.distance <= 1.1 * d + 16, (d, c.distance)


def test_every_visible_entry_selected_gives_full_recall_and_a_small_topk_does_not():
    cfg = cedar_tiny()
    wide = replace(cfg, index_topk=4096)
    torch.set_num_threads(2)
    pc = ProbeConfig(gaps=(0, 200), cases=2)
    full = ProbeSuite(wide, pc).run(random_model(wide, 2))
    assert set(full["recall"]) == {"L1", "L4", "L6"}
    assert all(v == 1.0 for layer in full["recall"].values() for v in layer.values()), full["recall"]
    assert all(v == 1.0 for layer in full["recall_chance"].values() for v in layer.values())
    small = ProbeSuite(cfg, pc).run(random_model(cfg, 2))
    assert small["recall_chance"]["L1"]["200"] < 0.5 and small["recall_chance"]["L4"]["200"] < 0.2
    assert small["recall"]["L4"]["200"] < 1.0


def test_a_lagged_decoder_source_scores_no_recall_and_no_chance_inside_the_window():
    """decoder_global_beyond_window: at gap 0 the decoder's entry is not selectable (recall and
    chance 0); at 200 it is, and a top-k over everything finds it; the encoder is unaffected."""
    wide = replace(cedar_tiny(), index_topk=4096, decoder_global_beyond_window=True)
    torch.set_num_threads(2)
    out = ProbeSuite(wide, ProbeConfig(gaps=(0, 200), cases=2)).run(random_model(wide, 2))
    for layer in ("L4", "L6"):
        assert out["recall"][layer] == {"0": 0.0, "200": 1.0} == out["recall_chance"][layer], out
    assert out["recall"]["L1"] == {"0": 1.0, "200": 1.0}


def test_bad_probe_settings_and_a_foreign_tokenizer_are_refused():
    with pytest.raises(ValueError, match="distinct ids"):
        ProbeConfig(token_range=(8, 20))
    with pytest.raises(ValueError, match="string_len"):
        ProbeConfig(string_len=(1, 4))
    with pytest.raises(ValueError, match="beyond the model's vocabulary of 512"):
        ProbeSuite(cedar_tiny(), ProbeConfig(cases=1, distances=(32,)), tokenizer_dir=AGENT)


def test_the_value_probe_scores_the_first_value_token_apart():
    """An oracle (the true next token everywhere) starts and finishes every value; an induction
    copier continues a value once started but cannot choose it (its first token follows the
    call's markup, whose earlier occurrences precede other text): ``value_first`` tells them apart."""
    from cedar.backend.geometries import cedar_agent

    cfg = cedar_agent()
    suite = ProbeSuite(cfg, ProbeConfig(gaps=(0,), cases=4, distances=(32, 256)), tokenizer_dir=AGENT)

    def oracle(batch: ProbeBatch) -> ProbeOutput:
        nxt = torch.roll(batch.ids, -1, dims=1)
        return ProbeOutput(torch.nn.functional.one_hot(nxt, cfg.vocab_size).float(), None)

    right = suite.run_forward(oracle)
    assert right["value"] == right["value_exact"] == right["value_first"] == {"32": 1.0, "256": 1.0}
    induction = suite.run_forward(lambda b: copier(b, cfg.vocab_size))
    assert all(induction["value_first"][d] < 1.0 for d in ("32", "256")), induction
    assert all(induction["value_first"][d] <= induction["value"][d] for d in ("32", "256")), induction


def test_probe_cases_sets_how_many_cases_each_gap_and_distance_gets():
    from cedar.cli import build_parser
    from cedar.training.cli import _probe_config

    parse = build_parser("train").parse_args
    assert _probe_config(parse(["train", "--probe-only", "m"])).cases == ProbeConfig().cases
    assert _probe_config(parse(["train", "--probe-only", "m", "--probe-cases", "24"])).cases == 24
    quick = _probe_config(parse(["train", "--probe-only", "m", "--probe-quick", "--probe-cases", "3"]))
    assert quick.cases == 3 and quick.gaps != ProbeConfig().gaps  # the quick grid, with 3 cases
