"""The ``cedar`` command: ``cedar <subcommand> --help`` documents each.

  init-model  write a random-init model (config.json, model.safetensors, tokenizer) to a folder
  memory      print the cache byte accounting of a geometry (JSON with --json)
  generate    greedy generation through the pure-torch reference path
  serve       serve a model with SGLang's own HTTP server (extra flags go to SGLang)
  serve-demo  serve the shipped model, send it raw requests (a repeated prefix among them), stop
  soak        a long run of agent load with chaos and bad input, every phase checked (JSON report)
  bench       benchmarks against the real server (``cedar bench hits``: TTFT of prefix-cache hits;
              ``prefill``: decoder narrowing; ``engine``: Cedar vs stock SGLang, same-dims Llama;
              ``trace``: trace replay, measured vs theoretical hit rate)

Commands of the layers above (``cedar agent run``, ``cedar demo``) come in through the
``cedar.commands`` entry point group: each entry is a function that adds its subparsers;
``cedar bench agents`` (the agent-load matrix) through ``cedar.bench`` likewise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# the trained, shipped model (committed); `models/cedar-tiny` is the random-init test geometry
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "cedar-agent"


def _cmd_init_model(args: argparse.Namespace) -> int:
    from .model_io import init_model_dir

    cfg = init_model_dir(args.geometry, Path(args.out), seed=args.seed)
    print(f"wrote {args.geometry} ({cfg.num_hidden_layers} layers) to {args.out}")
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    from .config import CEDConfig
    from .geometries import geometry
    from .memory import memory_report

    cfg = CEDConfig.load(Path(args.model)) if args.model else geometry(args.geometry)
    report = memory_report(cfg).to_json_dict()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:36s} {v}")
    return 0


def _generate(model_dir: Path, prompt: str, max_new_tokens: int, quantize: bool) -> tuple[str, list[int], float]:
    import torch

    from .cache import new_cache
    from .model_io import load_model
    from .replay import greedy, prefill, replay_span
    from .serving.hf_config import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, quantize=quantize)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    t0 = time.perf_counter()
    cache = new_cache(model.cfg, quantize)
    res = prefill(model, cache, torch.tensor(ids), replay_span(0, model.cfg.sliding_window))
    out = greedy(model, cache, res.logits[-1], max_new_tokens)
    return tok.decode(out), out, time.perf_counter() - t0


def _cmd_generate(args: argparse.Namespace) -> int:
    text, ids, secs = _generate(Path(args.model), args.prompt, args.max_new_tokens, not args.no_quant)
    print(json.dumps({"text": text, "token_ids": ids, "seconds": round(secs, 3)}))
    return 0


def _cmd_serve_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.model), args.max_new_tokens)


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    import os

    from .demo import ensure_model
    from .serving.launch import ServeConfig
    from .serving.planner import ServingFlags

    ensure_model(Path(args.model))
    flags = ServingFlags(replay=args.replay, narrow=not args.no_narrow,
                         replay_per_request=args.replay_per_request, snapshot_mb=args.snapshot_mb,
                         kernels=args.kernels)
    cfg = ServeConfig(model=args.model, host=args.host, port=args.port, flags=flags, extra=tuple(extra))
    if args.replicas > 1:
        return _serve_replicas(cfg, args)
    argv = cfg.argv()
    scope = "loopback only: other machines cannot reach it (--host 0.0.0.0 to serve them)" \
        if args.host in ("127.0.0.1", "localhost", "::1") else "reachable from other machines"
    key = "" if "--api-key" in extra else "; no --api-key: every client is trusted"
    print(f"cedar serve: listening on {args.host}:{args.port}, {scope}{key}", flush=True)
    print("cedar serve:", " ".join(argv), flush=True)
    os.execve(argv[0], argv, cfg.env())
    return 0  # not reached


def _serve_replicas(cfg, args: argparse.Namespace) -> int:
    from .serving.replicas import Replicas, RouterConfig

    router = RouterConfig(host=args.host, port=args.port, policy=args.router_policy, api_key=cfg.api_key)
    replicas = Replicas(cfg, args.replicas, router)
    print(f"cedar serve: {args.replicas} replicas on ports {args.port + 1}-{args.port + args.replicas} (logs "
          f"/tmp/cedar-replica-PORT.log) behind SGLang's router ({args.router_policy}) on {args.host}:{args.port}",
          flush=True)
    replicas.start()
    print(f"cedar serve: ready at {replicas.url}", flush=True)
    return replicas.supervise()


def _cmd_bench_hits(args: argparse.Namespace) -> int:
    from .bench.hits import format_table, run_hits_benchmark
    from .demo import ensure_model

    ensure_model(Path(args.model))
    grid = dict(prefixes=(256, 1024), new_tokens=(16,), concurrency=(1, 8), repeats=2) if args.quick else {}
    report = run_hits_benchmark(Path(args.model), Path(args.json), args.plot, **grid)
    print(format_table(report["table"]))
    print(f"[bench hits] {report['num_mismatches']} cached/replayed mismatches; {report['wall_s']} s; "
          f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_bench_prefill(args: argparse.Namespace) -> int:
    from .bench.prefill import run_prefill_benchmark
    from .demo import ensure_model

    ensure_model(Path(args.model))
    grid = dict(prompt_lens=(512, 2048), repeats=2) if args.quick else {}
    report = run_prefill_benchmark(Path(args.model), Path(args.json), args.plot, **grid)
    print(f"[bench prefill] {report['wall_s']} s; wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from .bench.engine import QUICK, EngineGrid, format_table, run_engine_benchmark
    from .demo import ensure_model

    ensure_model(Path(args.model))
    report = run_engine_benchmark(Path(args.model), Path(args.json), args.plot, QUICK if args.quick else EngineGrid())
    print(format_table(report["table"]))
    print(f"[bench engine] {report['wall_s']} s; wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_soak(args: argparse.Namespace) -> int:
    from .demo import ensure_model
    from .soak.load import LoadConfig
    from .soak.run import SoakConfig, run_soak

    ensure_model(Path(args.model))
    cfg = SoakConfig(minutes=args.minutes, phase_s=args.phase_s, seed=args.seed,
                     load=LoadConfig(sessions=args.sessions, hang_s=args.hang_s))
    report = run_soak(cfg, Path(args.model), Path(args.json), args.server, args.api_key)
    c = report["counts"]
    print(f"[soak] {report['wall_s']} s: sent {c['sent']}, finished {c['finished']}, aborted {c['aborted']}, "
          f"cut {c['disconnected']}, rejected {c['rejected']}, hung {c['hung']}, lost {c['lost']}; "
          f"{len(c['bad_input_failures'])} bad inputs without a 4xx; sentinels {report['sentinels_checked']} checked, "
          f"{len(report['sentinel_mismatches'])} wrong; RSS growth {report['rss_growth_after_warmup_pct']}%")
    print(f"[soak] goals: {report['goals_met']}; wrote {args.json}")
    return 0 if report["passed"] else 1


def _add_soak(sub) -> None:
    s = sub.add_parser("soak", help="agent load with disconnects, aborts and bad input; integrity, RSS and "
                       "reference-checked sentinels after every phase")
    s.add_argument("--minutes", type=float, default=30.0)
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--server", default=None, help="soak this server (URL) instead of starting one")
    s.add_argument("--api-key", default=None, help="the server's --api-key (a started server gets it too)")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="the served model (sentinels' reference)")
    s.add_argument("--sessions", type=int, default=16, help="concurrent multi-turn sessions")
    s.add_argument("--phase-s", type=float, default=120.0, help="seconds of load between two checks")
    s.add_argument("--hang-s", type=float, default=180.0, help="a request with no answer within this is hung")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_soak)


def _cmd_bench_trace(args: argparse.Namespace) -> int:
    from .bench.trace_replay import run_trace_benchmark
    from .demo import ensure_model

    ensure_model(Path(args.model))
    r = run_trace_benchmark(Path(args.model), Path(args.trace), Path(args.json), args.limit, args.concurrency,
                            args.server, args.tokens_per_block)
    print(f"[bench trace] {r['requests']} requests at concurrency {r['concurrency']}: hit rate measured "
          f"{r['measured_hit_rate']:.4f}, theoretical {r['theoretical_hit_rate']:.4f} ({r['requests_off_theory']} "
          f"requests off); TTFT p50 {r['ttft_ms_p50']} ms; wrote {args.json}")
    return 0


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks against the real SGLang server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, fn, help_, quick in (
            ("hits", _cmd_bench_hits, "TTFT of cold requests vs prefix-cache hits (replay in-forward, per "
             "request, restored snapshot)", "prefixes 256,1024; 16 new tokens; C 1,8; 2 repeats"),
            ("prefill", _cmd_bench_prefill, "TTFT of cold prefills with decoder narrowing on vs off (+ analytic bound)",
             "prompts 512, 2048; 2 repeats"),
            ("engine", _cmd_bench_engine, "Cedar vs stock SGLang serving a random Llama of the same dims: decode "
             "tok/s, cold TTFT, hits", "decode b1/b4 at 256, cold 256/1024, a 1024 hit; Cedar then stock once")):
        s = kinds.add_parser(name, help=help_)
        s.add_argument("--json", required=True, help="write the report here")
        s.add_argument("--plot", default=None, help="also write a PNG bar chart here")
        s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
        s.add_argument("--quick", action="store_true", help=quick)
        s.set_defaults(fn=fn)
    s = kinds.add_parser("trace", help="replay a Mooncake or Cedar-session trace closed-loop: measured vs "
                         "theoretical prefix-hit rate, TTFT, output tok/s")
    s.add_argument("--trace", required=True, help="JSONL trace (docs/bench/traces.md)")
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--server", default=None, help="replay against this server (URL) instead of starting one")
    s.add_argument("--limit", type=int, default=None, help="the first N requests only")
    s.add_argument("--concurrency", type=int, default=1)
    s.add_argument("--tokens-per-block", type=int, default=4, help="token ids per trace block")
    s.set_defaults(fn=_cmd_bench_trace)
    _add_plugins(kinds, "cedar.bench")  # `cedar bench agents` (cedar.agents)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cedar", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-model", help="write a random-init model in HF format")
    s.add_argument("--geometry", default="cedar-tiny", help="named geometry (cedar-tiny, v41-flash)")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_init_model)

    s = sub.add_parser("memory", help="cache byte accounting of a geometry")
    s.add_argument("--geometry", default="cedar-tiny")
    s.add_argument("--model", default=None, help="read the geometry from a model folder instead")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(fn=_cmd_memory)

    s = sub.add_parser("generate", help="greedy generation through the reference path")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-new-tokens", type=int, default=16)
    s.add_argument("--no-quant", action="store_true", help="float32 caches instead of FP4/FP8")
    s.set_defaults(fn=_cmd_generate)

    s = sub.add_parser("serve", help="serve a CED model with SGLang's HTTP server (unknown flags go to SGLang)")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model folder (default: the shipped model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--replay", choices=["bounded", "exact", "off"], default="bounded",
                   help="bounded: replay min(W, H) rows on a hit; exact: replay the whole prefix; off: no prefix cache")
    s.add_argument("--no-narrow", action="store_true", help="run the decoder on every prefill row")
    s.add_argument("--replay-per-request", action="store_true",
                   help="replay in one separate forward per request (upstream's first design; for benchmarks)")
    s.add_argument("--snapshot-mb", type=float, default=64.0,
                   help="memory for exact-continuation snapshots of finished requests' window state (0: off)")
    s.add_argument("--kernels", choices=["torch", "triton", "fast"], default=None,
                   help="kernel backend (default: triton on CUDA, the fast C++ kernels on CPU; triton on CPU "
                        "runs interpreted: slow, for checks)")
    s.add_argument("--replicas", type=int, default=1,
                   help="N > 1: N servers (ports PORT+1...) behind SGLang's router on PORT")
    s.add_argument("--router-policy", default="cache_aware",
                   choices=["cache_aware", "round_robin", "power_of_two", "random"])
    s.set_defaults(fn=_cmd_serve, passthrough=True)

    s = sub.add_parser("serve-demo", help="serve the shipped model and send it raw requests (cache counters)")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--max-new-tokens", type=int, default=8)
    s.set_defaults(fn=_cmd_serve_demo)

    _add_bench(sub)
    _add_soak(sub)
    _add_plugins(sub)
    return p


def _add_plugins(sub, group: str = "cedar.commands") -> None:
    """Subcommands registered by installed packages (``cedar.commands`` entry points; benchmarks:
    ``cedar.bench``)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=group):
        ep.load()(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args, extra) if getattr(args, "passthrough", False) else args.fn(args)
    except ValueError as e:  # bad geometry, bad model folder, bad weights: a clear message
        print(f"cedar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
