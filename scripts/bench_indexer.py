"""The indexer top-k kernel alone (``torch.ops.cedar_cpu.indexer_topk``), best of N, 1 thread:

    .venv/bin/python scripts/bench_indexer.py

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


def main() -> None:
    if not cpu_ext.available():
        raise SystemExit("the C++ kernels are not built (python -m cedar.kernels.cpu_ext)")
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
        f = lambda: op(iq, iw, given, codes, scales, rows, cu, req, qpos, cpos, k)  # noqa: E731
        print(f"{name}: 144 x 2,048: {best_ms(f):.2f} ms, checksum {int(f().sum())}")
    # a decode step: 8 requests, one row each
    B = 8
    iq, iw = torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g)
    codes = torch.randint(0, 256, (B * C, Di // 2), dtype=torch.uint8, generator=g)
    scales = torch.full((B * C, 1), 127, dtype=torch.uint8)
    rows, cu, req = torch.arange(B * C), torch.arange(B + 1) * C, torch.arange(B)
    qpos, cpos = torch.full((B,), 4200), (torch.arange(C) * 2 + 1).repeat(B)
    f = lambda: op(iq, iw, None, codes, scales, rows, cu, req, qpos, cpos, k)  # noqa: E731
    print(f"decode step: 8 requests x 2,048: {best_ms(f):.3f} ms, checksum {int(f().sum())}")


if __name__ == "__main__":
    main()
