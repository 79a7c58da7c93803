"""``cedar bench agents``: Cedar under closed-loop agent load, every mode side by side, and the
scale-out through SGLang's router (registered into ``cedar bench`` by ``cedar.drivers.cli``).

Workloads, both request graphs (``cedar.drivers.bench.session_graph``):

- ``agents``: Cedar's own agent programs (coding with its parallel reads and a subagent, ReAct,
  fork, subagents, function calling), each run once on the Cedar server and recorded as token ids,
  then replayed ``--copies`` times per run, each copy a session with its own marker;
- ``trace``: by default an AgentX-shaped session trace generated from the seed
  (``cedar.drivers.bench.agentx_like``: long system prompt, ~727 new and ~250 output tokens a
  turn, subagents); ``--trace FILE`` takes a Mooncake or Cedar-session trace instead (its first
  ``--trace-limit`` requests). Blocks map to ``--tokens-per-block`` ids (``docs/bench/traces.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from cedar.drivers.bench.agent_load import (BASELINE, MODES, Matrix, Workload, headline, markdown_table, run_matrix,
                                            run_scale_out)

AGENTX_LIKE = "agentx-like"
# NOTE: why this floor: see FLOOR_WHY; it is a flag, and the report names it
FLOOR_TOK_S = 10.0
FLOOR_WHY = ("10 output tokens/s per user at P90: the speed a person reads along (about 3.5 words/s, 210 words a "
             "minute; the shipped tokenizer spends 2.8 tokens a word on English prose), an eighth of the shipped "
             "model's single-user decode on this 2-core CPU (~80 tok/s), so the floor binds under load and not at "
             "the first request; other floors are reported beside it")
SENSITIVITY_FLOORS = (5.0, 10.0, 20.0)


def _workloads(args, url: str, cfg) -> list[Workload]:
    """The workloads ``--workloads`` names, in that order."""
    build = {"agents": _agents_workload, "trace": _trace_workload}
    return [build[name](args, url, cfg) for name in args.workloads]


def _agents_workload(args, url: str, cfg) -> Workload:
    from cedar.drivers.bench.session_graph import load_graph, replicate, save_graph

    from .record import record_agents

    if args.sessions and Path(args.sessions).exists():
        recorded, names = load_graph(Path(args.sessions)), f"recorded earlier: {args.sessions}"
    else:
        recorded, names = record_agents(url, args.agents)
        if args.sessions:
            save_graph(recorded, Path(args.sessions))
    return Workload("agents", replicate(recorded, args.copies, seed=args.seed), marked=True,
                    about={"agents": names, "copies": args.copies, "recorded_units": len({r.unit for r in recorded})})


def _trace_workload(args, url: str, cfg) -> Workload:
    from cedar.drivers.bench.agentx_like import AgentShape, write_agentx_like
    from cedar.drivers.bench.trace_replay import graph_from_trace
    from cedar.drivers.bench.traces import TokenMap, load_trace

    if args.trace == AGENTX_LIKE:
        shape = AgentShape(sessions=3, turns_median=4, turns_max=6) if args.quick else AgentShape()
        path = write_agentx_like(Path(tempfile.mkdtemp(prefix="cedar-agentx-")) / "trace.jsonl", shape, args.seed)
        about = {"trace": f"{AGENTX_LIKE} (cedar.drivers.bench.agentx_like, seed {args.seed})", "shape": asdict(shape)}
    else:
        path, about = Path(args.trace), {"trace": str(args.trace)}
    trace = load_trace(path, args.trace_limit)
    tokens = TokenMap(cfg.vocab_size, args.tokens_per_block)
    return Workload("trace", graph_from_trace(trace, tokens), marked=False,
                    about={**about, "limit": args.trace_limit, "tokens_per_block": args.tokens_per_block})


def run_agents_benchmark(args) -> dict:
    import sglang
    from tqdm import tqdm

    from cedar.drivers.bench.common import machine_info
    from cedar.drivers.bench.load_metrics import plot_pareto
    from cedar.backend.config import CEDConfig
    from cedar.backend.serve_demo import ensure_model
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.planner import ServingFlags
    from cedar.backend.serving.process import ServerProcess, free_port

    model = Path(args.model)
    ensure_model(model)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    cfg = CEDConfig.load(model)
    matrix = Matrix(tuple(args.concurrency), tuple(args.modes), args.think_cap_s)
    t0 = time.perf_counter()
    extra = ("--sleep-on-idle",)
    wanted = {"cedar": ServingFlags()}
    if BASELINE in matrix.modes and not args.scale_out_only:
        wanted[BASELINE] = ServingFlags(replay="off")
    servers = {}
    try:
        for name, flags in wanted.items():  # NOTE: one at a time: two model loads at once on 2 cores time out
            # NOTE: each port is chosen just before its server starts: one chosen earlier can be taken
            # meanwhile by the first server's own processes (SGLang's internal ports); CI saw it once
            serve = ServeConfig(model=str(model), port=free_port(), flags=flags, extra=extra)
            servers[name] = ServerProcess(serve, log_path=Path(f"/tmp/cedar-bench-agents-{serve.port}.log"))
            servers[name].start()
        cedar_cfg = servers["cedar"].cfg
        workloads = [w for w in _workloads(args, servers["cedar"].url, cfg) if w.name in args.workloads]
        total = 0 if args.scale_out_only else \
            sum(len(w.graph) for w in workloads) * len(matrix.concurrencies) * len(matrix.modes)
        scale_c = tuple(c for c in matrix.concurrencies if c > 1)[-2:] or matrix.concurrencies
        if args.replicas > 1:
            total += len(workloads[0].graph) * 3 * len(scale_c)
        with tqdm(total=total, desc="bench agents", unit="req", file=sys.stderr, mininterval=2) as bar:
            partial = Path(args.json).with_suffix(".partial.json")
            rows = [] if args.scale_out_only else run_matrix(
                servers, workloads, matrix, cfg.page_size, cfg.vocab_size, lambda a: bar.update(),
                lambda so_far: partial.write_text(json.dumps(so_far, indent=1)))
            scale = _scale_out(args, servers["cedar"], cedar_cfg, workloads[0], scale_c, cfg, bar) \
                if args.replicas > 1 else None
    finally:
        for s in servers.values():
            s.stop()
    report = {
        "what": "closed-loop agent load: every mode x concurrency, output throughput against P90 E2E interactivity",
        "command": "cedar " + " ".join(sys.argv[1:]), "machine": machine_info(), "sglang_version": sglang.__version__,
        "model": str(model), "server_argv": {k: s.cfg.argv() for k, s in servers.items()},
        "modes": {m: MODES[m] for m in matrix.modes}, "concurrencies": list(matrix.concurrencies),
        "think_cap_s": matrix.think_cap_s, "workloads": [w.summary() for w in workloads],
        "floor_tok_s_per_user": args.floor, "floor_why": FLOOR_WHY,
        "headline": headline(rows, args.floor),
        "headline_other_floors": {str(f): headline(rows, f) for f in SENSITIVITY_FLOORS if f != args.floor},
        "table": rows, "scale_out": scale,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.json)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    if args.plot and rows:
        panels = {w.name: {m: [r for r in rows if r["workload"] == w.name and r["mode"] == m] for m in matrix.modes}
                  for w in workloads}
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_pareto(panels, args.floor, Path(args.plot))
    return report


def _scale_out(args, single, base_cfg, workload, concurrencies, cfg, bar) -> dict:
    from dataclasses import replace

    from cedar.backend.serving.process import free_port
    from cedar.backend.serving.replicas import Replicas, RouterConfig

    port = free_port()
    with Replicas(replace(base_cfg, port=port), args.replicas, RouterConfig(port=port)) as reps:
        rr_url = reps.add_router("round_robin")
        rows = run_scale_out(single, reps, rr_url, workload, concurrencies, cfg.page_size, cfg.vocab_size,
                             args.think_cap_s, lambda a: bar.update())
    return {"replicas": args.replicas, "router": "sglang-router (cache_aware vs round_robin)",
            "concurrencies": list(concurrencies), "table": rows}


def _cmd_bench_agents(args: argparse.Namespace) -> int:
    if args.scale_out_only and args.replicas < 2:
        raise SystemExit("cedar bench agents: --scale-out-only needs --replicas 2 or more")
    if args.quick:
        args.agents, args.copies = args.agents or ["react", "parallel"], 2
        args.concurrency = [1, 2]
        args.modes = [m for m in args.modes if m in ("shipped", BASELINE)]
    report = run_agents_benchmark(args)
    if report["table"]:
        print(markdown_table(report["table"]))
    if report["scale_out"]:
        print(markdown_table(report["scale_out"]["table"], "setup"))
    for w, modes in report["headline"].items():
        print(f"[bench agents] {w}: output tok/s at {args.floor} tok/s/user: " + ", ".join(
            f"{m} {v['output_tok_s_at_floor']} ({v['x_baseline']}x)" for m, v in modes.items()))
    print(f"[bench agents] {report['wall_s']} s; wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def register(kinds) -> None:
    """Add ``agents`` to ``cedar bench``'s subparsers."""
    from cedar.frontend.server import DEFAULT_MODEL_DIR

    from cedar.agents.runs import AGENTS

    s = kinds.add_parser("agents", help="closed-loop agent sessions and a trace, every mode x concurrency: TTFT, "
                                        "output tok/s, P90 interactivity, hit rate vs theoretical; Pareto plot")
    s.add_argument("--json", required=True)
    s.add_argument("--plot", default=None)
    s.add_argument("--quick", action="store_true", help="CI slice: two agents, a 3-session AgentX-like trace, "
                                                        "C 1 and 2, shipped vs baseline")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    s.add_argument("--agents", nargs="+", default=None, choices=sorted(AGENTS), help="agents recorded (default: all)")
    s.add_argument("--copies", type=int, default=2, help="replays of each recorded session per run")
    s.add_argument("--sessions", default=None, help="recorded sessions (JSONL graph): read if present, else "
                                                     "recorded and written there")
    s.add_argument("--trace", default=AGENTX_LIKE, help=f"{AGENTX_LIKE} (generated) or a JSONL trace file")
    s.add_argument("--trace-limit", type=int, default=None, help="the trace's first N requests only")
    s.add_argument("--tokens-per-block", type=int, default=8, help="token ids per trace block (AgentX-like: 64 "
                                                                   "tokens a block)")
    s.add_argument("--think-cap-s", type=float, default=0.25)
    s.add_argument("--floor", type=float, default=FLOOR_TOK_S, help="P90 interactivity floor, tok/s/user")
    s.add_argument("--replicas", type=int, default=1, help="also compare cache-aware vs round-robin routing over "
                                                          "this many replicas (>= 2)")
    s.add_argument("--workloads", nargs="+", default=["agents", "trace"], choices=["agents", "trace"])
    s.add_argument("--scale-out-only", action="store_true", help="only the --replicas comparison (no mode matrix)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_bench_agents)
