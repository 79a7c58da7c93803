"""The ``cedar`` command: ``cedar <subcommand> --help`` documents each.

  init-model  write a random-init model (config.json, model.safetensors, tokenizer) to a folder
  memory      print the cache byte accounting of a geometry (JSON with --json)
  generate    greedy generation through the pure-torch reference path
  demo        build the shipped tiny model if missing, generate, print the memory figures
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path("models/cedar-tiny")


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
    from transformers import AutoTokenizer

    from .cache import new_cache
    from .model_io import load_model
    from .replay import greedy, prefill, replay_span

    tok = AutoTokenizer.from_pretrained(str(model_dir))
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from .config import CEDConfig
    from .geometries import geometry
    from .memory import memory_report
    from .model_io import init_model_dir

    model_dir = Path(args.model)
    if not (model_dir / "model.safetensors").is_file():
        print(f"[demo] building the random-init cedar-tiny model in {model_dir}")
        init_model_dir("cedar-tiny", model_dir)
    for name, cfg in (("v41-flash", geometry("v41-flash")), ("served", CEDConfig.load(model_dir))):
        print(f"[demo] memory ({name}): {json.dumps(memory_report(cfg).to_json_dict())}")
    for prompt in ("List the files in the repo.", "What is 2 + 2?"):
        text, ids, secs = _generate(model_dir, prompt, args.max_new_tokens, quantize=True)
        print(f"[demo] reference generate {prompt!r} -> {ids} {text!r} ({secs:.2f} s)")
    return 0


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

    s = sub.add_parser("demo", help="the main job at this stage (what `make demo` runs)")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--max-new-tokens", type=int, default=8)
    s.set_defaults(fn=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # bad geometry, bad model folder, bad weights: a clear message
        print(f"cedar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
