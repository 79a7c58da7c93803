"""GPU check of the attention / cache-write kernels: native tests, then timings vs the twins.

    python -m cedar.kernels.gpu_check --json OUT [--skip-tests] [--quick]

(a) runs ``pytest -m kernels tests/`` natively and records the pass/fail counts;
(b) times each Triton launcher against its pure-torch twin (same device, ``torch.cuda.Event``,
    warm-up first) on decode- and prefill-sized shapes of two geometries, and divides the bytes
    each op must move by the device's peak bandwidth: a lower bound on its time.
Writes the results as JSON to OUT and prints a table. Without CUDA it exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

# device-name substring -> peak HBM bandwidth in GB/s (vendor figures; first match wins)
PEAK_BANDWIDTH_GBPS = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("GH200", 4000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
)


@dataclass(frozen=True)
class Geometry:
    name: str
    heads: int
    head_dim: int  # latent D (K = V)
    index_heads: int
    index_dim: int
    topk: int
    window: int


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int  # requests
    q_len: int  # query rows per request
    context: int  # global entries per request (ratio-1 source: one per token)


GEOMETRIES = (Geometry("v4.1-flash", 64, 512, 32, 128, 512, 128),
              Geometry("cedar-tiny", 4, 64, 2, 32, 16, 128))
SHAPES = (Shape("decode-8k", 32, 1, 8192), Shape("decode-64k", 32, 1, 65536),
          Shape("prefill-8k", 1, 2048, 8192), Shape("prefill-64k", 1, 2048, 65536))


@dataclass
class Timing:
    geometry: str
    shape: str
    op: str
    kernel_ms: float | None = None
    twin_ms: float | None = None
    speedup: float | None = None  # twin_ms / kernel_ms
    bytes_moved: int = 0  # what the op must read and write at least
    bound_ms: float | None = None  # bytes_moved / peak bandwidth
    bandwidth_fraction: float | None = None  # bound_ms / kernel_ms
    error: str | None = None


def peak_bandwidth_gbps(device: torch.device) -> tuple[float, str]:
    """(GB/s, "table" or "measured"): the table entry for this device, else a timed big copy."""
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_BANDWIDTH_GBPS:
        if key in name:
            return gbps, "table"
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9, "measured"  # NOTE: a copy reads and writes


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Mean milliseconds per call over ``iters`` calls between CUDA events, after one untimed
    call (JIT compile, allocator) and ``warmup`` more; a call slower than 100 ms cuts both to 2."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    if start.elapsed_time(end) > 100:  # NOTE: the twins on 64k contexts take seconds
        warmup, iters = 0, 2
    for _ in range(warmup):
        fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# ---------------------------------------------------------------- inputs and byte counts


def make_inputs(geo: Geometry, shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    """Float32 inputs of every op for ``shape``: queries at the end of their context, a window of
    the last ``W + q_len`` keys per request, ``context`` global entries per request (all of
    them complete before the first query), and random top-k selections."""
    B, Tq, C = shape.batch, shape.q_len, shape.context
    T, N = B * Tq, B * (geo.window + Tq)
    H, D, Hi, Di = geo.heads, geo.head_dim, geo.index_heads, geo.index_dim
    i64 = dict(dtype=torch.int64, device=device)
    q_pos = (torch.arange(Tq, **i64) + C - Tq).repeat(B)
    k_pos = (torch.arange(geo.window + Tq, **i64) + C - Tq - geo.window).repeat(B)
    topk = min(geo.topk, C)
    return dict(
        q=torch.randn(T, H, D, device=device), k=torch.randn(N, D, device=device),
        cu_q=torch.arange(B + 1, **i64) * Tq, cu_k=torch.arange(B + 1, **i64) * (geo.window + Tq),
        cu_c=torch.arange(B + 1, **i64) * C, q_pos=q_pos, k_pos=k_pos,
        floor=torch.zeros(B, **i64), sink=torch.randn(H, device=device),
        q_idx=torch.randn(T, Hi, Di, device=device), w_idx=torch.randn(T, Hi, device=device),
        k_idx=torch.randn(B * C, Di, device=device), c_pos=(torch.arange(C, **i64) - C).repeat(B),
        entries=torch.randn(B * C, D, device=device), rows=torch.randn(T, D, device=device),
        scores=torch.randn(T, C, device=device),
        indices=torch.randint(0, C, (T, topk), dtype=torch.int32, device=device),
        out_b=torch.randn(T, H, D, device=device), lse_a=torch.randn(T, H, device=device),
        lse_b=torch.randn(T, H, device=device),
        slots=torch.randperm(max(N, T), **i64)[:T],
        codes8=torch.zeros(max(N, T), D, dtype=torch.uint8, device=device),
        scales8=torch.zeros(max(N, T), D // 32, dtype=torch.uint8, device=device),
        codes4=torch.zeros(max(N, T), D // 2, dtype=torch.uint8, device=device),
        scales4=torch.zeros(max(N, T), D // 16, dtype=torch.uint8, device=device),
    )


def op_calls(geo: Geometry, x: dict[str, torch.Tensor], backend: str) -> dict[str, Callable[[], object]]:
    """op name -> a no-argument call of ``backend``'s implementation on the inputs ``x``."""
    from cedar.kernels.dispatch import resolve

    f = {op: resolve(op, backend) for op in ("window_attention", "indexer_scores", "topk_select",
                                             "sparse_attention", "merge_states",
                                             "quantize_scatter_window", "quantize_scatter_global")}
    scale = geo.head_dim ** -0.5
    return {
        "window_attention": lambda: f["window_attention"](
            x["q"], x["k"], x["cu_q"], x["cu_k"], x["q_pos"], x["k_pos"], geo.window, x["floor"],
            x["sink"], scale),
        "indexer_scores": lambda: f["indexer_scores"](
            x["q_idx"], x["w_idx"], x["k_idx"], x["cu_q"], x["cu_c"], x["q_pos"], x["c_pos"]),
        "topk_select": lambda: f["topk_select"](x["scores"], geo.topk),
        "sparse_attention": lambda: f["sparse_attention"](
            x["q"], x["entries"], x["cu_q"], x["cu_c"], x["indices"], scale),
        "merge_states": lambda: f["merge_states"](x["q"], x["lse_a"], x["out_b"], x["lse_b"]),
        "quantize_scatter_window": lambda: f["quantize_scatter_window"](
            x["rows"], x["slots"], x["codes8"], x["scales8"], x["q_pos"], 0),
        "quantize_scatter_global": lambda: f["quantize_scatter_global"](
            x["rows"], x["slots"], x["codes4"], x["scales4"], x["q_pos"], 0),
    }


def bytes_moved(geo: Geometry, x: dict[str, torch.Tensor]) -> dict[str, int]:
    """The bytes each op must at least read and write (fp32 = 4 B, indices as stored)."""
    T, H, D = x["q"].shape
    N, Nc = x["k"].shape[0], x["entries"].shape[0]
    Hi, Di = geo.index_heads, geo.index_dim
    C, k = x["scores"].shape[1], x["indices"].shape[1]
    q_io = 2 * T * H * D * 4 + T * H * 4  # q in, out and lse out
    return {
        "window_attention": q_io + N * D * 4 + N * 8 + T * 8,
        "indexer_scores": T * Hi * (Di + 1) * 4 + Nc * (Di * 4 + 8) + T * C * 4,
        "topk_select": T * C * 4 + T * geo.topk * 4,
        "sparse_attention": q_io + T * k * 4 + min(T * k, Nc) * D * 4,
        "merge_states": 3 * (T * H * D * 4 + T * H * 4),
        "quantize_scatter_window": T * D * 4 + T * 16 + T * (D + D // 32),
        "quantize_scatter_global": T * D * 4 + T * 16 + T * (D // 2 + D // 16),
    }


# ---------------------------------------------------------------- the two checks


def run_tests(tests_dir: Path) -> dict[str, object]:
    """pytest -m kernels on ``tests_dir`` in a subprocess; counts from its JUnit XML."""
    if not tests_dir.is_dir():
        return {"error": f"no tests directory at {tests_dir}"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "kernels", str(tests_dir),
               "-p", "no:cacheprovider", f"--junitxml={xml}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        counts: dict[str, object] = {"returncode": proc.returncode,
                                     "summary": (proc.stdout.strip().splitlines() or [""])[-1]}
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            total, failed, errors, skipped = (int(suite.get(a, 0))
                                              for a in ("tests", "failures", "errors", "skipped"))
            counts.update(total=total, passed=total - failed - errors - skipped, failed=failed,
                          errors=errors, skipped_or_xfailed=skipped)
        if proc.returncode not in (0, 5):
            counts["output_tail"] = proc.stdout[-4000:] + proc.stderr[-2000:]
    return counts


def _try_time(fn: Callable[[], object]) -> tuple[float | None, str | None]:
    """(ms, None) or (None, the error): one failing op (OOM, compile error) must not hide the rest."""
    try:
        return time_ms(fn), None
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {e}"[:400]


def time_ops(geo: Geometry, shape: Shape, device: torch.device, peak_gbps: float) -> list[Timing]:
    x = make_inputs(geo, shape, device)
    kernels, twins = op_calls(geo, x, "triton"), op_calls(geo, x, "torch")
    rows = []
    for op, nbytes in bytes_moved(geo, x).items():
        t = Timing(geo.name, shape.name, op, bytes_moved=nbytes, bound_ms=nbytes / (peak_gbps * 1e9) * 1e3)
        t.kernel_ms, kernel_error = _try_time(kernels[op])
        t.twin_ms, twin_error = _try_time(twins[op])
        errors = (("kernel", kernel_error), ("twin", twin_error))
        t.error = "; ".join(f"{who}: {e}" for who, e in errors if e) or None
        if t.kernel_ms and t.twin_ms:
            t.speedup = t.twin_ms / t.kernel_ms
        if t.kernel_ms:
            t.bandwidth_fraction = t.bound_ms / t.kernel_ms
        rows.append(t)
    del x, kernels, twins
    torch.cuda.empty_cache()
    return rows


def _cell(value: float | None, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def format_table(rows: list[Timing]) -> str:
    head = (f"{'geometry':<11} {'shape':<12} {'op':<24} {'kernel ms':>10} {'twin ms':>10} "
            f"{'speedup':>8} {'bound ms':>9} {'of peak':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.geometry:<11} {r.shape:<12} {r.op:<24} {_cell(r.kernel_ms, '10.3f')} "
                     f"{_cell(r.twin_ms, '10.3f')} {_cell(r.speedup, '8.1f')} {_cell(r.bound_ms, '9.4f')} "
                     f"{_cell(r.bandwidth_fraction, '8.1%')}" + (f"  ERROR {r.error}" if r.error else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, type=Path, help="where to write the results")
    parser.add_argument("--skip-tests", action="store_true", help="only time the kernels")
    parser.add_argument("--quick", action="store_true", help="only the 8k shapes")
    parser.add_argument("--tests", type=Path, default=Path(__file__).resolve().parent.parent / "tests")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: a CUDA GPU is required (torch.cuda.is_available() is False); "
              "on CPU run `pytest -m kernels tests/` instead, which uses the Triton interpreter.",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")
    peak, source = peak_bandwidth_gbps(device)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "peak_bandwidth_gbps": peak,
                                 "bandwidth_source": source, "torch": torch.__version__}
    if not args.skip_tests:
        report["tests"] = run_tests(args.tests)
        print("tests:", json.dumps(report["tests"], indent=1))
    shapes = [s for s in SHAPES if not args.quick or s.context <= 8192]
    rows = [r for geo in GEOMETRIES for s in shapes for r in time_ops(geo, s, device, peak)]
    report["timings"] = [asdict(r) for r in rows]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"device: {report['device']}, peak {peak:.0f} GB/s ({source})")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
