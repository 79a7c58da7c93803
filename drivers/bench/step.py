"""``cedar bench step``: the served step in process, where a decode step's and a hit's time goes.

The runtime's own step (``CedarRuntime.step``, what SGLang's model class calls) driven by
:class:`~cedar.backend.serving.driver.Driver` (SGLang's tables and allocator stood in for): no
HTTP, scheduler or sampling, so the figures are the model side of a served step alone, and far
less noisy than a server's. Cases:

- ``decode`` at batch B and context C: B requests prefilled to C tokens, then one decode step each
  (one new row per request);
- ``hit``: one request prefilled to C tokens, then a new request whose prompt holds those C and
  ``new`` more, admitted on the first request's slots (a prefix hit of C): its forward replays
  min(W, C) rows, then runs the new ones (the row count is in the report);
- ``cold``: a new request of C fresh tokens, prefilled in one forward (the model's share of a
  short request's fixed cost; the server's share is ``cedar bench scheduler --ttft``'s).

Per case: the step's wall time (median and best of ``repeats``), the ATen ops a step issues and
the ops that take the most self time (``torch.profiler`` over 3 more steps). The figures for the
whole server (HTTP to tokens) are ``cedar bench engine``'s.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cedar.backend.model_io import load_model
from cedar.backend.serving.driver import Driver, Req
from cedar.kernels.dispatch import KernelSet


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "hit" | "cold"
    batch: int
    context: int
    new: int = 1

    @property
    def name(self) -> str:
        return {"decode": f"decode b{self.batch} ctx{self.context}", "cold": f"cold {self.context}",
                "hit": f"hit {self.context} + {self.new}"}[self.kind]


DEFAULT_CASES = (Case("decode", 1, 512), Case("decode", 8, 512), Case("decode", 1, 4096), Case("hit", 1, 4096, 16),
                 Case("hit", 1, 4096, 128), Case("cold", 1, 16), Case("cold", 1, 512))
QUICK_CASES = (Case("decode", 1, 256), Case("decode", 4, 256), Case("hit", 1, 512, 16), Case("cold", 1, 64))


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, vocab) for _ in range(n)]


def _prefill(d: Driver, req: Req, n: int, chunk: int = 2048) -> None:
    for at in range(0, n, chunk):
        d.run([(req, min(chunk, n - at))])


def measure_case(model, case: Case, repeats: int, profile_top: int = 8) -> dict:
    """One case on a fresh driver: {"case", "rows", "ms_median", "ms_best", "aten_ops", "top_ops"}."""
    vocab = model.cfg.vocab_size
    n_reqs = case.batch if case.kind == "decode" else 2 + repeats + 3 + 3
    fresh = case.context * n_reqs if case.kind == "cold" else 0  # NOTE: every cold request its own slots
    d = Driver(model, num_slots=(case.context + case.new) * (case.batch + 1) + case.new * n_reqs + 4096 + fresh,
               num_reqs=n_reqs, max_len=case.context + case.new + repeats + 16)
    if case.kind == "decode":
        reqs = [Req(f"r{b}", b, _ids(b, case.context, vocab)) for b in range(case.batch)]
        for r in reqs:
            _prefill(d, r, case.context)

        def step():
            for r in reqs:
                r.ids.append(5)
            return d.run([(r, 1) for r in reqs])
    elif case.kind == "cold":
        count = iter(range(n_reqs))

        def step():
            i = next(count)  # a new request of fresh tokens each time: no prefix to hit
            return d.run([(Req(f"cold{i}", i, _ids(10_000 + i, case.context, vocab)), case.context)])
    else:
        ids = _ids(0, case.context + case.new, vocab)
        donor = Req("donor", 0, ids[:case.context])
        _prefill(d, donor, case.context)
        count = iter(range(1, n_reqs))

        def step():
            i = next(count)  # a new request on its own slot each time, hitting the donor's prefix
            return d.run([(Req(f"hit{i}", i, list(ids), token_slots=donor.token_slots[:case.context]), case.new)])
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    events = prof.key_averages()
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / 3
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:profile_top]
    return {"case": case.name, "kind": case.kind, "batch": case.batch, "context": case.context, "new": case.new,
            "rows": out.plan.batch.num_rows, "ms_median": round(1000 * statistics.median(times), 3),
            "ms_best": round(1000 * min(times), 3), "aten_ops": round(ops),
            "top_ops": [{"op": e.key, "calls": round(e.count / 3, 1), "self_ms": round(e.self_cpu_time_total / 3000, 3)}
                        for e in top]}


def run_step_bench(model_dir: Path, cases=DEFAULT_CASES, repeats: int = 20, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    model = load_model(Path(model_dir), kernels=KernelSet.for_device("cpu"))  # as `cedar serve` on CPU
    return {"model": str(model_dir), "kernels": model.kernels.backend, "threads": threads, "repeats": repeats,
            "cases": [measure_case(model, c, repeats) for c in cases]}
