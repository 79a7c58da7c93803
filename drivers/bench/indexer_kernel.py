"""The indexer top-k kernel alone (``torch.ops.cedar_cpu.indexer_topk``), best of N, 1 thread:

    cedar bench indexer-kernel [--json OUT]

- a hit's rows: 144 query rows of one request over 2,048 entries (a 4k hit + 16 at a ratio-2
  source), FP4 keys read from the pool, then the same keys given dequantized (what a prefill
  passes);
- a decode step: 8 requests, one row each, 2,048 entries each, keys from the pool.

Random FP4 keys, top-32. Prints each case's time and a checksum of the selections (equal across
builds of the kernel that select the same entries), so two builds can be compared A/B."""

from __future__ import annotations

import time

import torch

from cedar.kernels import cpu_ext


def best_ms(f, repeats: int = 20) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return 1000 * best


def run_indexer_bench() -> dict:
    """-> {"cases": [{"case", "ms", "checksum"}]} (also printed, one line a case)."""
    if not cpu_ext.available():
        raise RuntimeError("the C++ kernels are not built (python -m cedar.kernels.cpu_ext)")
    cases = []

    def report(name: str, f) -> None:
        cases.append({"case": name, "ms": round(best_ms(f), 3), "checksum": int(f().sum())})
        print(f"{name}: {cases[-1]['ms']} ms, checksum {cases[-1]['checksum']}", flush=True)

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    op, Hi, Di, C, k = torch.ops.cedar_cpu.indexer_topk, 2, 32, 2048, 32
    # a hit: 144 rows of one request at positions 3968..4111, entries visible from 1, 3, 5, ...
    T = 144
    iq, iw = torch.randn(T, Hi, Di, generator=g), torch.randn(T, Hi, generator=g)
    codes = torch.randint(0, 256, (C, Di // 2), dtype=torch.uint8, generator=g)
    scales = torch.full((C, 1), 127, dtype=torch.uint8)
    keys = torch.randn(C, Di, generator=g)
    rows, cu, req = torch.arange(C), torch.tensor([0, C]), torch.zeros(T, dtype=torch.long)
    qpos, cpos = torch.arange(4096 - 128, 4096 + 16), torch.arange(C) * 2 + 1
    for name, given in (("hit rows, keys from the pool", None), ("hit rows, keys given", keys)):
        report(f"{name}: 144 x 2,048", lambda: op(iq, iw, given, codes, scales, rows, cu, req, qpos, cpos, k))
    # a decode step: 8 requests, one row each
    B = 8
    iq, iw = torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g)
    codes = torch.randint(0, 256, (B * C, Di // 2), dtype=torch.uint8, generator=g)
    scales = torch.full((B * C, 1), 127, dtype=torch.uint8)
    rows, cu, req = torch.arange(B * C), torch.arange(B + 1) * C, torch.arange(B)
    qpos, cpos = torch.full((B,), 4200), (torch.arange(C) * 2 + 1).repeat(B)
    report("decode step: 8 requests x 2,048", lambda: op(iq, iw, None, codes, scales, rows, cu, req, qpos, cpos, k))
    return {"threads": 1, "top_k": k, "cases": cases}
