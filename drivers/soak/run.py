"""``cedar soak``: a long run of agent-like load with chaos and bad input against a server it
starts (pool at about 20% of the sessions' working set, a snapshot budget of a few snapshots,
small chunks, so eviction, retraction and snapshot LRU run all the time) or one given by URL.

The run is cut into phases. After each, the load pauses until nothing is in flight, and the
run checks: the pools' integrity and Cedar's slot / snapshot invariants (``/get_server_info``),
that every request slot and token is released, the server's RSS, and every sentinel against
the reference model (greedy tokens, cold or bounded replay after the hit it got). The report
counts requests sent / finished / aborted / disconnected / rejected / hung / lost, every bad
input that did not get a 4xx with a message, integrity failures and RSS growth after the first
phase (the warm-up), and says which goals were met.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..bench.common import machine_info
from .bad_input import catalogue
from .load import Load, LoadConfig

GOALS = "0 lost or hung; every bad input a 4xx with a message; integrity after every phase; " \
        "RSS growth < 5% after the first phase; every sentinel identical to the reference"


@dataclass
class SoakConfig:
    minutes: float = 30.0
    phase_s: float = 120.0
    seed: int = 0
    context: int = 4096  # --context-length of a started server
    pool_share: float = 0.2  # pool size / the sessions' working set
    snapshots: int = 4  # snapshot budget, in snapshots of one request slot
    chunk: int = 512  # --chunked-prefill-size
    load: LoadConfig = field(default_factory=LoadConfig)


def _server_args(cfg: SoakConfig, model_dir: Path) -> tuple[tuple[str, ...], float]:
    """SGLang flags and the snapshot budget (MB) of a started server."""
    from cedar.backend.config import CEDConfig
    from cedar.backend.serving.pools import RequestSlots

    ced = CEDConfig.load(model_dir)
    working_set = cfg.load.sessions * cfg.load.max_context
    pool = max(int(working_set * cfg.pool_share), cfg.context + 1024)
    per_slot = RequestSlots(ced, 1).bytes_per_slot
    extra = ("--max-total-tokens", str(pool), "--context-length", str(cfg.context),
             "--chunked-prefill-size", str(cfg.chunk), "--max-running-requests", str(cfg.load.sessions))
    return extra, cfg.snapshots * per_slot / 2**20


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    proc = psutil.Process(pid)
    return round(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20, 1)


class SentinelCheck(NamedTuple):
    checked: int  # compared with the reference
    mismatches: list[dict]  # a wrong token or an unexpected hit
    retracted: int  # not compared (see ``_verify_sentinels``)


def _verify_sentinels(records, ref) -> SentinelCheck:
    """The sentinels against the reference's greedy answer.

    A sentinel SGLang retracted (pool pressure) is not compared: it is re-admitted with its prompt
    still in the radix tree (a retraction frees the request's slots but not the tree's copy), so
    its second prefill may hit its own prompt and replay, and SGLang stops counting cached tokens
    once a request is retracted (``retracted_stain``): the hit it got is not known, so neither is
    its reference. Those are counted apart."""
    from cedar.backend.replay import reference_greedy

    checked, bad, retracted = 0, [], 0
    for r in records:
        if r.retractions:
            retracted += 1
            continue
        if r.restored_tokens or (r.cached_tokens and r.donor_ids is None):
            bad.append({"why": "an unexpected hit", "cached": r.cached_tokens, "restored": r.restored_tokens})
            continue
        want, _ = reference_greedy(ref, r.ids, len(r.output_ids), r.cached_tokens, r.donor_ids)
        checked += 1
        if want != r.output_ids:
            first = next(i for i, (a, b) in enumerate(zip(want, r.output_ids)) if a != b)
            bad.append({"prompt_len": len(r.ids), "hit": r.cached_tokens, "first_wrong": first,
                        "served": r.output_ids, "reference": want})
    return SentinelCheck(checked, bad, retracted)


def _phase_report(i, t0, load, state, sentinels, rss, drained) -> dict:
    integ = state["integrity"]
    tokens = integ["tokens"]
    ok = bool(integ["tokens_ok"] and integ.get("slots_ok", True) and drained
              and integ["request_slots"]["free"] == integ["request_slots"]["total"]
              and tokens["in_use"] == 0 and tokens["protected"] == 0)
    return {"phase": i, "t_s": round(time.time() - t0, 1), "counts": {k: v for k, v in load.counts.snapshot().items()
                                                                      if not isinstance(v, list)},
            "integrity_ok": ok, "drained": drained, "integrity": integ, "rss_mb": rss,
            "sentinels_checked": sentinels.checked, "sentinel_mismatches": sentinels.mismatches,
            "sentinels_retracted": sentinels.retracted,
            "snapshots": state.get("snapshots"), "replayed_tokens_total": state.get("replayed_tokens_total")}


def run_soak(cfg: SoakConfig, model_dir: Path, out_json: Path, server_url: str | None = None,
             api_key: str | None = None, log=print) -> dict:
    import sglang

    from cedar.backend.config import CEDConfig
    from cedar.backend.model_io import load_model
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.planner import ServingFlags
    from cedar.backend.serving.process import ServerClient, ServerProcess, free_port
    from cedar.kernels.dispatch import KernelSet

    ced = CEDConfig.load(model_dir)
    ref = load_model(model_dir).use_kernels(KernelSet.for_device("cpu"))  # the kernels the server runs
    srv, argv, pid = None, None, None
    try:  # NOTE: the started server is stopped whatever fails, from its start on
        if server_url is None:
            extra, snapshot_mb = _server_args(cfg, model_dir)
            serve = ServeConfig(model=str(model_dir), port=free_port(), flags=ServingFlags(snapshot_mb=snapshot_mb),
                                extra=extra + (("--api-key", api_key) if api_key else ()))
            srv = ServerProcess(serve, log_path=Path(f"/tmp/cedar-soak-{serve.port}.log")).start()
            server_url, argv, pid = srv.url, serve.argv(), srv.proc.pid
            log(f"[soak] server {server_url} (log {srv.log_path}): {' '.join(extra)} --snapshot-mb {snapshot_mb:.2f}")
        client = srv or ServerClient(server_url, api_key)
        load = Load(client, ced.vocab_size, catalogue(ced.vocab_size, cfg.context), cfg.load, cfg.seed)
        phases, t0 = [], time.time()
        n_phases = max(1, round(cfg.minutes * 60 / cfg.phase_s))
        try:
            load.start()
            for i in range(n_phases):
                time.sleep(cfg.phase_s)
                drained = load.pause(cfg.load.hang_s + 30)
                state = client.wait_idle(120)
                records, load.sentinels = load.sentinels, []
                sentinels = _verify_sentinels(records, ref)
                phase = _phase_report(i, t0, load, state, sentinels, _rss_mb(pid), drained)
                phases.append(phase)
                c = phase["counts"]
                log(f"[soak] phase {i + 1}/{n_phases} at {phase['t_s']:.0f} s: sent {c['sent']} finished "
                    f"{c['finished']} aborted {c['aborted']} cut {c['disconnected']} rejected {c['rejected']} hung "
                    f"{c['hung']} lost {c['lost']}; integrity {'ok' if phase['integrity_ok'] else 'BROKEN'}; "
                    f"sentinels {sentinels.checked} checked, {len(sentinels.mismatches)} wrong, {sentinels.retracted} retracted "
                    f"(not compared); RSS {phase['rss_mb']} MB")
                load.resume()
        finally:
            load.close()
    finally:
        if srv is not None:
            srv.stop()
    report = _report(cfg, model_dir, server_url, argv, load, phases, t0, sglang.__version__)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    return report


def judge_goals(counts: dict, phases: list[dict], rss_growth_pct: float | None) -> dict[str, bool | None]:
    """Each goal: True (measured and met), False (measured and missed) or None (not measured:
    RSS needs a server this run started and two phases; the sentinels need one checked)."""
    mismatches = [m for p in phases for m in p["sentinel_mismatches"]]
    checked = sum(p["sentinels_checked"] for p in phases)
    return {
        "no_lost_or_hung": counts["lost"] == 0 and counts["hung"] == 0,
        "bad_input_all_4xx_with_message": not counts["bad_input_failures"],
        "integrity_every_phase": all(p["integrity_ok"] for p in phases) if phases else None,
        "rss_growth_under_5pct": None if rss_growth_pct is None else rss_growth_pct < 5.0,
        "sentinels_identical": None if checked == 0 and not mismatches else not mismatches,
    }


UNMEASURED_WHY = {
    "integrity_every_phase": "no phase ran",
    "rss_growth_under_5pct": "needs the server's pid (a server this run started) and RSS from two phases",
    "sentinels_identical": "no sentinel was checked",
}


def goal_status(goals: dict[str, bool | None]) -> dict[str, str]:
    """'met', 'missed' or 'unmeasured: why' per goal; an unmeasured goal is never counted as met."""
    return {name: "met" if ok else "missed" if ok is False else f"unmeasured: {UNMEASURED_WHY.get(name, 'no data')}"
            for name, ok in goals.items()}


def soak_passed(goals: dict[str, bool | None]) -> bool:
    """The run passed: every goal was measured and met."""
    return all(ok is True for ok in goals.values())


def _report(cfg, model_dir, url, argv, load, phases, t0, sglang_version) -> dict:
    counts = load.counts.snapshot()
    rss = [p["rss_mb"] for p in phases if p["rss_mb"] is not None]
    growth = round(100 * (rss[-1] - rss[0]) / rss[0], 2) if len(rss) >= 2 else None
    mismatches = [m for p in phases for m in p["sentinel_mismatches"]]
    goals = judge_goals(counts, phases, growth)
    return {
        "what": "cedar soak: multi-turn sessions with disconnects, aborts, bad input and reference-checked sentinels",
        "goals": GOALS, "goals_met": goals,  # None: unmeasured, never counted as met
        "goal_status": goal_status(goals), "passed": soak_passed(goals),
        "machine": machine_info(), "sglang_version": sglang_version, "model": str(model_dir), "server": url,
        "server_argv": argv, "config": asdict(cfg), "wall_s": round(time.time() - t0, 1),
        "counts": counts, "integrity_failures": sum(not p["integrity_ok"] for p in phases), "rss_mb": rss, "rss_growth_after_warmup_pct": growth,
        "sentinels_checked": sum(p["sentinels_checked"] for p in phases), "sentinel_mismatches": mismatches,
        "sentinels_retracted": sum(p["sentinels_retracted"] for p in phases),
        "phases": phases,
    }
