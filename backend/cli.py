"""The serving core's ``cedar`` subcommands (the ``cedar`` command itself is ``cedar.cli``):

  init-model  write a random-init model (config.json, model.safetensors, tokenizer) to a folder
  memory      print the cache byte accounting of a geometry (JSON with --json)
  generate    greedy generation through the pure-torch reference path
  serve       serve a model with SGLang's own HTTP server (extra flags go to SGLang)
  serve-demo  serve the shipped model, send it raw requests (a repeated prefix among them), stop
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# `--weights` of cedar serve and the benchmarks that start servers (ServingFlags.weights, checked
# there against planner.WEIGHT_MODES; listed here so a CLI parses without importing torch)
WEIGHT_CHOICES = ("float32", "bf16", "bf16-matmul")

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
    from .serve_demo import run_demo

    return run_demo(Path(args.model), args.max_new_tokens)


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    import os

    from .serve_demo import ensure_model
    from .serving.launch import ServeConfig
    from .serving.planner import ServingFlags

    ensure_model(Path(args.model))
    flags = ServingFlags(replay=args.replay, narrow=not args.no_narrow,
                         replay_per_request=args.replay_per_request, snapshot_mb=args.snapshot_mb,
                         kernels=args.kernels, decode_threads=args.decode_threads,
                         weights=args.weights)
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


def register(sub) -> None:
    """Add the serving core's commands to the `cedar` command's subparsers."""
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
    s.add_argument("--decode-threads", type=int, default=1,
                   help="CPU threads of a decode step (0: the server's threads, as a prefill); one leaves "
                        "the other core to SGLang's tokenizer and detokenizer, which handle every streamed token")
    s.add_argument("--weights", choices=WEIGHT_CHOICES, default="float32",
                   help="bf16: each projection weight rounded to bf16 at load, a decode step reading bf16 "
                        "copies (half the bytes; the served tokens are those of the rounded model); "
                        "bf16-matmul: also a prefill's matmuls in bf16, their rows rounded (the CPU's bf16 "
                        "rate; the tokens move a little more: README)")
    s.add_argument("--replicas", type=int, default=1,
                   help="N > 1: N servers (ports PORT+1...) behind SGLang's router on PORT")
    s.add_argument("--router-policy", default="cache_aware",
                   choices=["cache_aware", "round_robin", "power_of_two", "random"])
    s.set_defaults(fn=_cmd_serve, passthrough=True)

    s = sub.add_parser("serve-demo", help="serve the shipped model and send it raw requests (cache counters)")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--max-new-tokens", type=int, default=8)
    s.set_defaults(fn=_cmd_serve_demo)
