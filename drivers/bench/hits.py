"""``cedar bench hits``: time to first token (TTFT) of prefix-cache hits on the real SGLang server.

For each cell (prefix length L, new tokens N, concurrency C), three modes, interleaved repeat by
repeat so that load from other processes on a shared CPU falls on all three alike:

- ``cold``: C concurrent prompts of L + N fresh tokens (nothing cached);
- ``hit_in_forward``: C concurrent prompts P + N fresh tokens, where the L-token prefix P was served
  once before the cell (untimed); Cedar folds each hit's min(W, L) replay rows into the batched
  forward;
- ``hit_per_request``: the same, with the ``cedar_replay_per_request`` switch on, so the model runs
  one separate replay forward per hit request before the batch (upstream SGLang's first design);
- ``hit_restored``: the same hits, but P's finished state was kept as a snapshot (exact
  continuation): each request restores it and replays nothing.

TTFT is the time from sending a streamed /generate to reading its first ``data:`` line. Every
response's meta_info is checked (cold: cached 0, replayed 0; hit: cached L, replayed min(W, L));
mismatches are recorded in the row, never dropped. The number of prefill forwards SGLang's
scheduler used for each group is read off the server log's ``Prefill batch`` lines.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from cedar.backend.serving.runtime import REPLAY_SWITCH
from .common import OUTPUT_LEN, Sample, fresh_ids, machine_info, save_report, set_switch, stream_body, stream_generate

if TYPE_CHECKING:
    from cedar.backend.serving.process import ServerProcess

MODES = ("cold", "hit_in_forward", "hit_per_request", "hit_restored")
# NOTE: P is first served as P + a private suffix, as a shared system prompt is in an agent
# session: the finished request's window snapshot (exact continuation) is then keyed at its own
# last few pages, beyond L, so later hits at L take bounded replay, the path under test.
WARM_SUFFIX_LEN = 32
PREFILL_LINE = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


@dataclass(frozen=True)
class HitsGrid:
    prefix_lens: tuple[int, ...] = (256, 1024, 4096)
    new_token_lens: tuple[int, ...] = (16, 128)
    concurrencies: tuple[int, ...] = (1, 8)
    repeats: int = 5

    def __post_init__(self) -> None:
        if self.repeats < 1 or min(self.concurrencies) < 1:
            raise ValueError("repeats and concurrencies must be positive")
        if any(n < 2 for n in self.new_token_lens):
            raise ValueError("new token counts must be >= 2 (one page, so suffixes never hit)")
        if any(L <= 0 or L % 2 for L in self.prefix_lens):
            raise ValueError("prefix lengths must be positive and page-aligned (even)")

    @property
    def batch_rows(self) -> int:
        """Prefill rows of the largest group: C cold prompts of L + N tokens."""
        return max(self.concurrencies) * (max(self.prefix_lens) + max(self.new_token_lens))

    @property
    def cell_tokens(self) -> int:
        """Token slots one cell fills (the cache is flushed between cells): P, then per repeat
        C cold prompts and 2 x C hit suffixes, each with its generated tokens."""
        L, N, C = max(self.prefix_lens), max(self.new_token_lens), max(self.concurrencies)
        return L + self.repeats * C * (L + 3 * (N + OUTPUT_LEN))

    def server_flags(self) -> tuple[str, ...]:
        pool = max(65536, -(-2 * self.cell_tokens // 4096) * 4096)
        return ("--max-total-tokens", str(pool), "--max-running-requests", str(max(16, *self.concurrencies)),
                "--chunked-prefill-size", str(self.batch_rows), "--max-prefill-tokens", str(self.batch_rows),
                "--stream-interval", "1")


class HitsRun:
    """One server: fresh seeds, the replay switch, concurrent groups and their prefill forwards."""

    def __init__(self, srv: ServerProcess, vocab_size: int) -> None:
        self.srv, self.vocab_size, self.next_seed = srv, vocab_size, 1

    def ids(self, n: int) -> list[int]:
        self.next_seed += 1
        return fresh_ids(self.next_seed, n, self.vocab_size)

    def flush(self) -> None:
        """Empty the radix cache (waits up to 60 s for the server to go idle)."""
        self.srv.flush_cache()

    def set_per_request(self, on: bool) -> None:
        set_switch(self.srv, REPLAY_SWITCH, on)

    def set_snapshots(self, on: bool) -> None:
        set_switch(self.srv, "cedar_snapshots", on)

    def group(self, prompts: list[list[int]]) -> tuple[list[Sample], list[int]]:
        """Send the prompts at once; return their samples and #new-seq of each prefill forward."""
        bodies, gate = [stream_body(p) for p in prompts], threading.Barrier(len(prompts))
        start = self.srv.log_path.stat().st_size

        def one(body: bytes) -> Sample:
            gate.wait()
            return stream_generate(self.srv.cfg.host, self.srv.cfg.port, body)

        with ThreadPoolExecutor(len(bodies)) as pool:
            samples = list(pool.map(one, bodies))
        with open(self.srv.log_path, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
        return samples, [int(m.group(1)) for m in PREFILL_LINE.finditer(text)]


def measure_cell(run: HitsRun, L: int, N: int, C: int, repeats: int, window: int) -> dict:
    load_before = os.getloadavg()[0]
    run.flush()
    run.set_per_request(False)
    prefix = run.ids(L)
    run.set_snapshots(True)
    # NOTE: P alone first: its finished state is a snapshot continuing exactly at L over P's own
    # token slots (the tree keeps the first copy of a prefix, so a later P would not match them).
    run.group([prefix])
    run.group([prefix + run.ids(WARM_SUFFIX_LEN)])  # then P as a shared system prompt, untimed
    # (cached, replayed, restored) each response must report
    expect = {"cold": (0, 0, 0), "hit_in_forward": (L, min(window, L), 0),
              "hit_per_request": (L, min(window, L), 0), "hit_restored": (L, 0, L)}
    ttft = {m: [] for m in MODES}
    forwards = {m: [] for m in MODES}
    mismatches = []
    for rep in range(repeats):
        for mode in MODES:
            run.set_per_request(mode == "hit_per_request")
            run.set_snapshots(mode == "hit_restored")
            prompts = [run.ids(L + N) if mode == "cold" else prefix + run.ids(N) for _ in range(C)]
            samples, seqs = run.group(prompts)
            forwards[mode].append(seqs)
            for s in samples:
                ttft[mode].append(s.ttft_ms)
                if (s.cached_tokens, s.replayed_tokens, s.restored_tokens) != expect[mode]:
                    mismatches.append({"mode": mode, "repeat": rep, "cached_tokens": s.cached_tokens,
                                       "replayed_tokens": s.replayed_tokens, "restored_tokens": s.restored_tokens,
                                       "expected": list(expect[mode])})
    run.set_per_request(False)
    run.set_snapshots(True)
    row = _row(L, N, C, ttft, forwards, mismatches)
    row["load_avg_1m_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return row


def warm_up(run: HitsRun, L: int, window: int) -> None:
    """One untimed cell of one repeat: the server's first forwards of each kind are slow."""
    measure_cell(run, L, 16, 1, 1, window)


def _row(L: int, N: int, C: int, ttft: dict, forwards: dict, mismatches: list) -> dict:
    modes = {m: {"median_ms": round(float(np.median(v)), 2), "p90_ms": round(float(np.percentile(v, 90)), 2),
                 "min_ms": round(min(v), 2), "num_requests": len(v), "ttft_ms": [round(t, 2) for t in v],
                 "prefill_seqs_per_forward": forwards[m]} for m, v in ttft.items()}
    med = {m: modes[m]["median_ms"] for m in MODES}
    return {"prefix_len": L, "new_len": N, "concurrency": C, "modes": modes,
            "ratio_hit_in_forward_vs_cold": round(med["hit_in_forward"] / med["cold"], 3),
            "ratio_hit_per_request_vs_hit_in_forward": round(med["hit_per_request"] / med["hit_in_forward"], 3),
            "ratio_hit_restored_vs_hit_in_forward": round(med["hit_restored"] / med["hit_in_forward"], 3),
            "mismatches": mismatches}


def plot_hits(table: list[dict], png: Path) -> None:
    """Grouped bars of median TTFT per cell, one bar per mode (log scale)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.2 * len(table) + 2), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x, width = np.arange(len(table)), 0.27
    for i, mode in enumerate(MODES):
        bars = ax.bar(x + (i - 1) * width, [r["modes"][mode]["median_ms"] for r in table], width, label=mode)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, rotation=90, padding=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"L={r['prefix_len']}\nN={r['new_len']}\nC={r['concurrency']}" for r in table])
    ax.set_ylabel("median TTFT (ms, log scale)")
    ax.set_title("Cedar prefix-cache hits: TTFT by replay mode (SGLang server, CPU)")
    ax.margins(y=0.25)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _notes(grid: HitsGrid) -> list[str]:
    return [
        f"TTFT = time from sending a streamed /generate (stream: true) to its first data: line; "
        f"max_new_tokens {OUTPUT_LEN} (ignore_eos) so the first chunk carries the first token only, "
        "and --stream-interval 1 so that token is streamed at once.",
        f"--chunked-prefill-size and --max-prefill-tokens = {grid.batch_rows} = max C x (max L + max N): "
        "SGLang charges every group's prefill rows (hit replay rows included) against both budgets, "
        "so with both at least this size a group of C requests fits one forward if they arrive together. "
        "The prefill forwards actually used are in prefill_seqs_per_forward (#new-seq of each "
        "'Prefill batch' log line, one list per repeat).",
        f"--max-total-tokens >= 2 x {grid.cell_tokens} token slots one cell fills; the radix cache is "
        "flushed (/flush_cache) before each cell, so nothing is evicted inside a cell.",
        f"Each cell: flush, serve P + {WARM_SUFFIX_LEN} private tokens once untimed (so a hit at L is "
        "not an exact continuation of a finished request and takes bounded replay), then per repeat "
        "one group of C concurrent requests per mode, modes interleaved (cold, hit_in_forward, "
        "hit_per_request).",
        "Every prompt and suffix starts with a page spelling a fresh seed, so cold prompts never hit and "
        "hit suffixes never extend the hit beyond L.",
        "SGLang's overlap scheduler is on (its default). On CPU a forward's first tokens are streamed only "
        "after the next forward has run, so when a group is split (e.g. [1, 7]) the lone first request "
        "also waits for the 7-request forward (--disable-overlap-schedule gives it its own TTFT; the "
        "medians barely move).",
        "hit_restored: P is first served alone once (untimed) so that its finished state is kept as a "
        "snapshot continuing exactly at L; the group then restores it and replays nothing (the multi-turn "
        "case). The cedar_snapshots switch is on only for this mode.",
        "ratio_* are ratios of medians.",
    ]


def format_table(table: list[dict]) -> str:
    head = f"{'L':>5} {'N':>4} {'C':>2} | " + " | ".join(f"{m + ' med/p90 ms':>30}" for m in MODES) \
        + " | in_fwd/cold  per_req/in_fwd  forwards(cold,in_fwd,per_req, last repeat)  mismatches"
    lines = [head]
    for r in table:
        cells = " | ".join(f"{r['modes'][m]['median_ms']:>14.1f} / {r['modes'][m]['p90_ms']:>13.1f}" for m in MODES)
        seqs = ",".join(str(r["modes"][m]["prefill_seqs_per_forward"][-1]) for m in MODES)
        lines.append(f"{r['prefix_len']:>5} {r['new_len']:>4} {r['concurrency']:>2} | {cells} | "
                     f"{r['ratio_hit_in_forward_vs_cold']:>11.3f}  {r['ratio_hit_per_request_vs_hit_in_forward']:>14.3f}"
                     f"  {seqs}  {len(r['mismatches'])}")
    return "\n".join(lines)


def run_hits_benchmark(model_dir: str | Path, out_json: str | Path, plot_png: str | Path | None = None,
                       prefixes: Sequence[int] = (256, 1024, 4096), new_tokens: Sequence[int] = (16, 128),
                       concurrency: Sequence[int] = (1, 8), repeats: int = 5) -> dict:
    """Start one server, measure every cell, write the JSON (and the PNG); return the report."""
    import sglang

    from cedar.backend.config import CEDConfig
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    grid = HitsGrid(tuple(prefixes), tuple(new_tokens), tuple(concurrency), repeats)
    cfg = CEDConfig.load(Path(model_dir))
    serve = ServeConfig(model=str(model_dir), port=free_port(), extra=grid.server_flags())
    report = {"machine": machine_info(), "sglang_version": sglang.__version__,
              "model": {"dir": str(model_dir), "name": cfg.name, "layers": cfg.num_hidden_layers,
                        "window": cfg.sliding_window, "vocab_size": cfg.vocab_size, "page_size": cfg.page_size},
              "grid": {"prefix_lens": grid.prefix_lens, "new_token_lens": grid.new_token_lens,
                       "concurrencies": grid.concurrencies, "repeats": grid.repeats},
              "server_flags": serve.argv()[3:], "notes": _notes(grid), "table": []}
    t0 = time.perf_counter()
    with ServerProcess(serve, log_path=Path(f"/tmp/cedar-bench-hits-{serve.port}.log")) as srv:
        report["server_start_s"] = round(time.perf_counter() - t0, 1)
        report["server_log"] = str(srv.log_path)
        run = HitsRun(srv, cfg.vocab_size)
        warm_up(run, min(grid.prefix_lens), cfg.sliding_window)
        for L in grid.prefix_lens:
            for N in grid.new_token_lens:
                for C in grid.concurrencies:
                    row = measure_cell(run, L, N, C, grid.repeats, cfg.sliding_window)
                    report["table"].append(row)
                    print(f"[bench hits] {format_table([row]).splitlines()[1]}", flush=True)
        report["cedar_state_at_end"] = srv.cedar_state()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["machine"]["load_avg_1_5_15_at_end"] = list(os.getloadavg())
    report["num_mismatches"] = sum(len(r["mismatches"]) for r in report["table"])
    save_report(report, out_json, plot_png, plot_hits)
    return report
