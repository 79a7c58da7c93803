"""A decode step's matmuls alone: MKL's ``at::linear`` against ``cedar_cpu::linear`` (the few-row
kernel the fast CPU backend runs) over the weight as it is and packed as every matmul of a few
rows reads it (``modules.pack_rows``: 8 outputs at a time, the same bits), on 1 and 2 threads,
with weights read cold from memory (each call takes the next of 64 copies, 16-128 MB in all),
beside this machine's streaming read speed:

    cedar bench linear --json docs/bench/bench_linear.json

Shapes: the shipped model's projections (hidden 256, FFN 512, vocab 2,048) at 1, 4 and 8 rows
(batch 1, 4 and 8). Per case the best of 5 rounds of 200 calls, in microseconds and GB/s of weight
read. Run it with the cores quiet (no training beside it)."""

from __future__ import annotations

import platform
import time

import torch

from cedar.backend.modules import pack_rows
from cedar.kernels import cpu_ext

SHAPES = ((256, 256), (512, 256), (256, 512), (2048, 256))  # (out, in): wq/wo, gate/up, down, lm_head
COPIES = 64


def best_us(f, calls: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        f()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t) / calls)
    return 1e6 * best


def read_gb_s(threads: int) -> float:
    """Streaming read of 256 MB (sums of 16 MB buffers), best of 5."""
    torch.set_num_threads(threads)
    bufs = [torch.randn(4 << 20) for _ in range(16)]
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for b in bufs:
            b.sum()
        best = min(best, time.perf_counter() - t)
    return 16 * (16 << 20) / best / 1e9


def run_linear_bench() -> dict:
    """-> {"machine", "read_gb_s": {"1", "2"}, "cases": [{threads, rows, out, in, mkl_us, cedar_us, packed_us,
    ...}]}."""
    if not cpu_ext.available():
        raise RuntimeError("the C++ CPU kernels are not built here")
    cases = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (1, 4, 8):
            for out_f, in_f in SHAPES:
                ws = [torch.randn(out_f, in_f) for _ in range(COPIES)]
                packed = [pack_rows(w) for w in ws]
                x = torch.randn(rows, in_f)
                row = {"threads": threads, "rows": rows, "out": out_f, "in": in_f}
                for name, op, weights in (("mkl", torch.nn.functional.linear, ws),
                                          ("cedar", torch.ops.cedar_cpu.linear, ws),
                                          ("packed", torch.ops.cedar_cpu.linear, packed)):
                    it = iter(range(1 << 62))
                    us = best_us(lambda: op(x, weights[next(it) % COPIES]))
                    row[f"{name}_us"] = round(us, 1)
                    row[f"{name}_gb_s"] = round(out_f * in_f * 4 / us / 1e3, 1)
                cases.append(row)
                print(row, flush=True)
    report = {"machine": {"platform": platform.platform(), "cpu": torch.backends.cpu.get_cpu_capability()},
              "read_gb_s": {"1": round(read_gb_s(1), 1), "2": round(read_gb_s(2), 1)}, "cases": cases}
    print("streaming read:", report["read_gb_s"], "GB/s (1 / 2 threads)")
    return report
