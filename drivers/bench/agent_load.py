"""The mode x concurrency matrix of ``cedar bench agents``: every workload (a request graph,
:mod:`session_graph`) replayed closed-loop at each concurrency in each mode, and the scale-out
runs through SGLang's router.

Modes: five are runtime switches on one server (``/set_internal_state``), the baseline has its own
server (``--replay off``: SGLang's radix cache disabled, every prompt computed in full). Modes are
interleaved inside each concurrency, so slow phases of this shared CPU fall on all of them alike.
Before every run the cache is flushed and the run draws fresh unit markers, so no run hits what an
earlier one left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from .load_metrics import run_metrics, throughput_at_floor
from .session_graph import GraphRequest, markers, prompt_lengths, replay_graph

BASELINE = "prefix_cache_off"
DEFAULT_SWITCHES = {"cedar_narrow": 1, "cedar_replay_exact": 0, "cedar_replay_per_request": 0, "cedar_snapshots": 1}
MODES: dict[str, dict[str, int] | None] = {
    "shipped": {},
    "narrowing_off": {"cedar_narrow": 0},
    "replay_exact": {"cedar_replay_exact": 1},
    "replay_per_request": {"cedar_replay_per_request": 1},
    "snapshots_off": {"cedar_snapshots": 0},
    BASELINE: None,  # its own server
}


@dataclass(frozen=True)
class Workload:
    name: str
    graph: list[GraphRequest]
    marked: bool  # per-unit markers (sessions); False for independent trace requests
    about: dict = field(default_factory=dict)

    def summary(self) -> dict:
        plen = prompt_lengths(self.graph)
        return {"name": self.name, "units": len({r.unit for r in self.graph}), "requests": len(self.graph),
                "recorded_prompt_tokens": sum(plen), "output_tokens": sum(r.output_len for r in self.graph),
                "longest_prompt": max(plen), "marked": self.marked, **self.about}


@dataclass(frozen=True)
class Matrix:
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = tuple(MODES)
    think_cap_s: float = 0.25

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown or min(self.concurrencies) < 1:
            raise ValueError(f"unknown modes {sorted(unknown)} or a concurrency < 1")


def set_mode(srv, mode: str) -> None:
    """Every Cedar switch to its shipped value, then the mode's own."""
    from .common import set_switch

    for key, on in {**DEFAULT_SWITCHES, **(MODES[mode] or {})}.items():
        set_switch(srv, key, bool(on))


def one_run(url: str, workload: Workload, concurrency: int, page_size: int, vocab_size: int, seed: int,
            think_cap_s: float, on_answer: Callable | None = None) -> dict:
    unit_markers = markers(workload.graph, page_size, vocab_size, seed) if workload.marked else None
    answered, wall = replay_graph(url, workload.graph, concurrency, unit_markers, think_cap_s, on_answer=on_answer)
    return {"workload": workload.name, "concurrency": concurrency, **run_metrics(answered, wall, page_size)}


def run_matrix(servers: dict[str, object], workloads: list[Workload], matrix: Matrix, page_size: int,
               vocab_size: int, progress: Callable | None = None,
               on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """``servers``: "cedar" (switchable) and BASELINE, each a ServerClient. One row per
    (workload, concurrency, mode); ``on_row`` gets the rows so far after each run (a checkpoint)."""
    rows, seeds = [], itertools.count(1)  # fresh marker seeds, one per run
    for w in workloads:
        for c in matrix.concurrencies:
            for mode in matrix.modes:
                srv = servers[BASELINE if MODES[mode] is None else "cedar"]
                srv.flush_cache()
                if MODES[mode] is not None:
                    set_mode(srv, mode)
                row = one_run(srv.url, w, c, page_size, vocab_size, next(seeds), matrix.think_cap_s, progress)
                rows.append({"mode": mode, **row})
                if on_row is not None:
                    on_row(rows)
    set_mode(servers["cedar"], "shipped")
    return rows


def run_scale_out(single, replicas, round_robin_url: str, workload: Workload, concurrencies: tuple[int, ...],
                  page_size: int, vocab_size: int, think_cap_s: float, progress: Callable | None = None) -> list[dict]:
    """The shipped mode on one server, then through the router over the replicas (cache-aware,
    then round-robin), on the same sessions (the same marker seed for all three)."""
    from cedar.backend.serving.process import ServerClient

    workers = [ServerClient(u) for u in replicas.worker_urls]
    rows = []
    for c in concurrencies:
        for setup, url, flushed in (("one server", single.url, [single]), ("cache_aware", replicas.url, workers),
                                    ("round_robin", round_robin_url, workers)):
            for server in flushed:
                server.flush_cache()
            row = one_run(url, workload, c, page_size, vocab_size, 1000 + c, think_cap_s, progress)
            rows.append({"setup": setup, "replicas": 1 if setup == "one server" else len(workers), **row})
    return rows


def headline(rows: list[dict], floor: float) -> dict:
    """Per workload: each mode's output tok/s at the floor, and its ratio to the baseline's."""
    out: dict[str, dict] = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        at = {m: throughput_at_floor([(r["interactivity_p90"], r["output_tok_s"]) for r in rows
                                      if r["workload"] == w and r["mode"] == m], floor)
              for m in dict.fromkeys(r["mode"] for r in rows if r["workload"] == w)}
        base = at.get(BASELINE)
        out[w] = {m: {"output_tok_s_at_floor": t, "x_baseline": round(t / base, 2) if base else None}
                  for m, t in at.items()}
    return out


def markdown_table(rows: list[dict], key: str = "mode") -> str:
    """The rows as a Markdown table (docs/bench/agents.md, the README)."""
    head = (f"| workload | {key} | C | TTFT p50 / p90 (ms) | output tok/s | total tok/s | P90 interactivity "
            "(tok/s/user) | hit rate measured / theoretical | replayed / restored / uncached tokens |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['workload']} | {r[key]} | {r['concurrency']} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f} "
                     f"| {r['output_tok_s']:.1f} | {r['total_tok_s']:,.0f} | {r['interactivity_p90']:.1f} "
                     f"| {r['measured_hit_rate']:.1%} / {r['theoretical_hit_rate']:.1%} "
                     f"| {r['replayed_tokens']:,} / {r['restored_tokens']:,} / {r['uncached_tokens']:,} |")
    return "\n".join(lines)
