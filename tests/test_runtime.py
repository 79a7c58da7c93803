"""The runtime owns Cedar's side of every seam (``backend/serving/runtime.py``): how hooks find it,
the per-request facts it keeps, its switches, and that the forward step is written once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cedar.backend.geometries import cedar_tiny
from cedar.backend.model_io import random_model
from cedar.backend.serving.driver import Driver, Req
from cedar.backend.serving.planner import RequestInfo, ServingFlags
from cedar.backend.serving.runtime import SWITCHES, CedarRuntime, runtime_for, switch_problem

CFG = cedar_tiny()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=3).eval()


class FakePool:  # stands in for SGLang's ReqToTokenPool: only its identity matters here
    pass


def table(requests: int = 4, max_len: int = 256) -> torch.Tensor:
    """SGLang's request-to-token table, (request slots, max len) int32."""
    return torch.zeros(requests, max_len, dtype=torch.int32)


def test_hooks_find_the_runtime_allocated_against_their_pool_and_no_other(model):
    a, b = FakePool(), FakePool()
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    assert runtime_for(a) is None
    rt.allocate(512, table(), CFG.page_size, sglang_pool=a)
    assert runtime_for(a) is rt and runtime_for(b) is None and runtime_for(None) is None
    assert not hasattr(a, "cedar_model") and vars(a) == {}  # nothing hung on SGLang's object
    del rt
    import gc

    gc.collect()
    assert runtime_for(a) is None  # a dropped runtime is not found


def test_page_size_that_is_not_a_multiple_is_refused(model):
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    with pytest.raises(ValueError, match="--page-size"):
        rt.allocate(512, table(), CFG.page_size + 1)


def test_step_before_allocation_fails_loudly(model):
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not allocated"):
        rt.write_ids(torch.tensor([2]), torch.tensor([5]))


def test_a_chunk_too_small_for_the_replay_rows_is_refused_at_allocation(model):
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    need = CFG.sliding_window + CFG.page_size
    with pytest.raises(ValueError, match=f"serve with at least {need}"):
        rt.allocate(512, table(), CFG.page_size, chunked_prefill_size=need - 1)
    rt.allocate(512, table(), CFG.page_size, chunked_prefill_size=need)
    assert rt.pools is not None and rt.slots.num_slots == 4


def test_request_facts_are_consumed_once_per_chunk_and_a_new_request_drops_stale_ones(model):
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    rt.allocate(512, table(), CFG.page_size)
    rt.note_request(1, 0, "a", RequestInfo(final_chunk=False))
    rt.note_request(1, 64, "a", RequestInfo(final_chunk=True, prompt_logprobs=True))  # its next chunk, noted early
    assert rt._take_facts(1, 0, "a") == RequestInfo(final_chunk=False)
    assert rt._take_facts(1, 0, "a") == RequestInfo()  # consumed: the default (a final chunk)
    rt.note_request(2, 0, "b", RequestInfo(final_chunk=False))
    rt.note_request(2, 128, "b", RequestInfo(final_chunk=False))
    rt.note_request(2, 0, "c", RequestInfo(prompt_logprobs=True))  # b aborted, c took slot 2
    assert set(rt._facts) == {(1, 64), (2, 0)}
    assert rt._take_facts(1, 64, "a").prompt_logprobs and rt._take_facts(2, 0, "c").prompt_logprobs
    # an aborted request's facts go even when the next request of its slot starts at a cache hit
    rt.note_request(3, 0, "d", RequestInfo(final_chunk=False))
    rt.note_request(3, 64, "d", RequestInfo(final_chunk=False))
    rt.note_request(3, 128, "e", RequestInfo(prompt_logprobs=True))  # d aborted, e admitted at a hit
    assert set(rt._facts) == {(3, 128)}
    rt.note_request(0, 64, "f", RequestInfo(final_chunk=False))
    assert rt._take_facts(0, 64, "g") == RequestInfo()  # another request's facts are never taken
    assert set(rt._facts) == {(3, 128)}
    # a retracted request admitted again under its rid: its first life's entries are stale
    rt.note_request(2, 0, "h", RequestInfo(final_chunk=False))
    rt.note_request(2, 256, "h", RequestInfo(final_chunk=False))  # noted early, then h is retracted
    rt.note_request(2, 0, "h", RequestInfo(final_chunk=True))  # h again, cold, in one chunk
    assert rt._take_facts(2, 256, "h") == RequestInfo() and rt._take_facts(2, 0, "h").final_chunk
    rt.note_request(1, 0, "i", RequestInfo(final_chunk=False))
    rt.note_request(1, 256, "i", RequestInfo(final_chunk=False))
    rt.note_request(1, 128, "i", RequestInfo(final_chunk=True))  # i again, at a hit of 128
    assert set(k for k in rt._facts if k[0] == 1) == {(1, 0), (1, 128)}


def test_admission_charges_replay_rows_and_clamps_a_lone_request_to_the_budget(model):
    """A hit charges min(W, hit) replay rows; a request over the rows left runs alone, charged
    what is left (an exact replay of a long prefix), never refused for ever."""
    W, P = CFG.sliding_window, CFG.page_size
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    assert rt.admission_replay_rows(4 * W, None) == 0  # not allocated: nothing to charge
    rt.allocate(4096, table(), P)
    assert rt.admission_replay_rows(0, None) == 0
    assert rt.admission_replay_rows(4 * W, None) == W
    assert rt.admission_replay_rows(4 * W, None, budget=10 * W, page_size=P, alone=True) == W
    exact = CedarRuntime(model, ServingFlags(replay="exact"), torch.device("cpu"))
    exact.allocate(4096, table(), P)
    assert exact.admission_replay_rows(4 * W, None) == 4 * W
    assert exact.admission_replay_rows(4 * W, None, budget=2 * W, page_size=P, alone=True) == 2 * W - P
    assert exact.admission_replay_rows(4 * W, None, budget=2 * W, page_size=P, alone=False) == 4 * W


def test_scheduler_facts_reach_the_planner_through_the_step(model):
    """A non-final chunk's decoder is skipped, a final one's runs: the facts noted for the slot
    and prefix are the ones the step plans with."""
    d = Driver(model, num_slots=2048, num_reqs=2)
    W = CFG.sliding_window
    req = Req("a", 1, [10 + i % 50 for i in range(4 * W)])
    out = d.run([(req, 2 * W)], [RequestInfo(final_chunk=False)])
    assert out.plan.requests[0].decoder == "skip" and not bool(out.decoded.any())
    out = d.run([(req, 2 * W)], [RequestInfo(final_chunk=True)])
    assert out.plan.requests[0].decoder == "tail"
    assert out.decoded.tolist() == [False] * W + [True] * W  # the last W rows only
    assert d.rt._facts == {}



def test_a_decode_step_runs_on_the_decode_threads_and_a_prefill_on_the_servers(model):
    """``decode_threads`` = 1: a decode step (and SGLang's sampling after it) runs on one CPU
    thread, a prefill on the server's; 0: every step on the server's. The hidden states are the
    same bits either way (every kernel splits work by rows, never a reduction)."""
    torch.set_num_threads(2)  # NOTE: the conftest puts the process's threads back after each test
    drivers = {n: Driver(model, ServingFlags(decode_threads=n), num_slots=2048, num_reqs=2) for n in (1, 0)}
    seen, hidden = {}, {}
    for n, d in drivers.items():
        reqs = [Req(f"r{i}", i, [10 + (7 * i + j) % 90 for j in range(80)]) for i in range(2)]
        outs, threads = [], []
        for batch in ([(reqs[0], 40), (reqs[1], 40)], [(r, 1) for r in reqs], [(r, 1) for r in reqs],
                      [(reqs[0], 30)], [(r, 1) for r in reqs]):
            outs.append(d.run(batch).hidden)
            threads.append(torch.get_num_threads())
        seen[n], hidden[n] = threads, outs
    assert seen[1] == [2, 1, 1, 2, 1] and seen[0] == [2] * 5
    assert all(torch.equal(a, b) for a, b in zip(hidden[1], hidden[0]))
    with pytest.raises(ValueError, match="decode_threads"):
        ServingFlags(decode_threads=-1)

def test_switches_flip_the_flags_and_bad_ones_are_refused(model):
    rt = CedarRuntime(model, ServingFlags(), torch.device("cpu"))
    rt.set_switch("cedar_narrow", False)
    rt.set_switch("cedar_replay_exact", True)
    assert rt.flags.narrow is False and rt.flags.replay == "exact"
    assert rt.internal_state({})["flags"]["replay"] == "exact"
    assert switch_problem({"cedar_narrow": 2}) and switch_problem({"cedar_nope": 1})
    assert switch_problem({"cedar_snapshots": 0, "other": "x"}) is None
    assert set(SWITCHES) >= {"cedar_replay_per_request", "cedar_narrow", "cedar_replay_exact", "cedar_snapshots"}


def _calls(path: Path, names: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in names:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return out


def test_the_forward_step_is_written_once():
    """Only ``step.py`` builds the pool keys and runs the layers for the served path: the
    runtime, the prepass and the tests' harness call it (the GPU check's graph stage splits it
    on purpose and checks the split against it)."""
    files = sorted((ROOT / "backend" / "serving").glob("*.py")) + [ROOT / "tests" / "serving_harness.py"]
    found = [c for f in files for c in _calls(f, {"run_layers", "PoolKeys"})]
    assert found and all(c.startswith("backend/serving/step.py") for c in found), found
    uses = [c for f in files for c in _calls(f, {"served_step"})]
    assert {u.split(":")[0] for u in uses} == {"backend/serving/runtime.py", "backend/serving/prepass.py"}


def test_hooks_hang_nothing_on_sglang_objects():
    """The hook modules, the model class and the frontend write no attribute of an SGLang object
    except SGLang's own sampling seed fields (seed_hooks), a structure's schema (tool_call_hooks)
    and the logits output's ``customized_info``: no side channel. (The LM head's ``quant_method``
    is set on Cedar's own head, ``modules.LMHead``: the attribute SGLang's LogitsProcessor reads.)"""
    allowed = {"info.sampling_seed", "self.sampling_seed", "other.sampling_seed", "structure.schema_",
               "out.customized_info",  # NOTE: SGLang's field for a model's per-request meta info
               "self.lm_head.quant_method"}
    written = []
    hooks = [ROOT / "backend" / "serving" / f"{name}.py" for name in ("sglang_hooks", "tool_call_hooks", "seed_hooks")]
    # NOTE: in the model class and the frontend, ``self`` is Cedar's own object (a subclass at most)
    others = [ROOT / "backend" / "serving" / "served_model.py"] + sorted((ROOT / "frontend").glob("*.py"))
    for path in hooks + others:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            written += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute)
                        and (path in hooks or ast.unparse(t.value) != "self")]
    assert set(written) <= allowed, set(written) - allowed
