"""`cedar train --out DIR [...]`: corpus (built once into DIR/corpus), tokenizer, training,
and the trained model in HF format in DIR/model.

    DIR/corpus/train.jsonl, heldout.json, tokens.npz, heldout_tokens.npz
    DIR/checkpoint.pt, loss_curve.json, loss_curve.png   (resumable: run the same command again)
    DIR/model/  config.json, model.safetensors, tokenizer files, chat template, training.json

Every eval also runs the copy probes (``cedar.training.probes``): their figures per eval
step go to loss_curve.json / training.json (``probes``) and the plot's probe panels.
``cedar train --probe-only MODEL_DIR --json OUT`` runs the probes on a model folder, no training.
"""

from __future__ import annotations

import argparse
import sys
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from cedar.backend.geometries import cedar_agent
from cedar.backend.model_io import save_model
from cedar.backend.tokenizer import END, ROLE_MARKERS, TOKENIZER_FILES, build_tokenizer, generation_eos_token_ids, special_token_ids
from cedar.training import curriculum, stages
from cedar.training.probes import QUICK, ProbeConfig, ProbeSuite
from cedar.training.trainer import TrainConfig, bf16_is_native, train

from cedar.training.corpus.build import build_corpus, load_sessions, run_scripted, save_corpus, tokenize_corpus

VOCAB = 2048
CONTEXT = 16384
TOKENIZER_SAMPLE = 4000  # sessions the BPE is trained on


def prepare(out: Path, seed: int, scale: float, log=print, fresh_share: float = 0.0,
            mistakes: float = 0.0, served_share: float = 0.0) -> tuple[dict, dict]:
    """Corpus, tokenizer and token arrays under ``out`` (each step skipped when already there)."""
    corpus_dir, model_dir = out / "corpus", out / "model"
    if not (corpus_dir / "train.jsonl").is_file():
        t = time.time()
        corpus = build_corpus(seed, scale, log=log, fresh_share=fresh_share, mistakes=mistakes)
        save_corpus(corpus, corpus_dir)
        held_texts = [{"kind": task.kind, "text": x} for task in corpus.heldout for x in run_scripted(task)]
        (corpus_dir / "heldout_sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in held_texts))
        log(f"[train] corpus: {len(corpus.sessions)} sessions in {time.time() - t:.0f} s")
    sessions = load_sessions(corpus_dir)
    if not (model_dir / "tokenizer.json").is_file():
        sample = [s["text"] for s in sessions[:TOKENIZER_SAMPLE]]
        build_tokenizer(model_dir, VOCAB, corpus=sample, markup_tokens=True, model_max_length=CONTEXT)
    if not (corpus_dir / "tokens.npz").is_file():
        np.savez(corpus_dir / "tokens.npz", **tokenize_corpus(sessions, model_dir, served_share))
        held = [json.loads(line) for line in (corpus_dir / "heldout_sessions.jsonl").open()]
        np.savez(corpus_dir / "heldout_tokens.npz", **tokenize_corpus(held, model_dir))
    arrays = dict(np.load(corpus_dir / "tokens.npz"))
    held = dict(np.load(corpus_dir / "heldout_tokens.npz"))
    chars = sum(len(s["text"].encode()) for s in sessions)
    log(f"[train] {len(arrays['ids'])} training tokens ({chars / len(arrays['ids']):.2f} bytes/token), "
        f"{len(held['ids'])} held-out tokens")
    return arrays, held


def _probe_config(args: argparse.Namespace) -> ProbeConfig:
    pc = QUICK if args.probe_quick else ProbeConfig()
    return replace(pc, cases=args.probe_cases) if args.probe_cases else pc


def _cmd_probe(args: argparse.Namespace) -> int:
    from cedar.backend.model_io import load_model

    model_dir = Path(args.probe_only)
    try:
        model = load_model(model_dir, quantize=False)
    except (ValueError, OSError) as e:
        print(f"[probe] cannot load {model_dir}: {e}", file=sys.stderr)
        return 2
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    if not has_tokenizer:
        print(f"[probe] no tokenizer.json in {model_dir}: the value probe is skipped", file=sys.stderr)
    try:
        suite = ProbeSuite(model.cfg, _probe_config(args), tokenizer_dir=model_dir if has_tokenizer else None)
    except ValueError as e:
        print(f"[probe] {e}", file=sys.stderr)
        return 2
    figures = suite.run(model)
    report = {"command": "cedar " + " ".join(sys.argv[1:]), "model": str(model_dir), **figures}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(figures))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.probe_only:
        return _cmd_probe(args)
    if not args.out:
        print("cedar train: --out DIR is required (or --probe-only MODEL_DIR)", file=sys.stderr)
        return 2
    if args.bf16 and not bf16_is_native():
        print("cedar train: --bf16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX) emulates them, "
              f"about 15x slower than float32 ({torch.backends.cpu.get_cpu_capability()} here); leave it off",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.init:  # a warm start keeps the tokenizer its weights were trained with
        import shutil

        (out / "model").mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if not (out / "model" / name).exists():
                shutil.copy(Path(args.init) / name, out / "model" / name)
    arrays, held = prepare(out, args.seed, args.scale, fresh_share=args.fresh_schemas, mistakes=args.mistakes,
                          served_share=args.served_share)
    model_dir = out / "model"
    ids = special_token_ids(model_dir)
    cfg = cedar_agent(VOCAB, bos=ids["<|bos|>"], eos=tuple(generation_eos_token_ids(model_dir)), pad=ids["<|pad|>"])
    cfg = replace(cfg, decoder_global_beyond_window=args.decoder_global_beyond_window)
    warmup = args.warmup if args.warmup is not None else min(50, max(1, args.steps // 10))
    tc = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                     warmup=warmup, checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                     bf16=args.bf16, init=args.init or "", copy_share=args.copy_share,
                     recall_share=args.recall_share, context_weight=args.context_weight,
                     dense_share=args.dense_share, keyed_share=args.keyed_share, exchange_share=args.exchange_share,
                     value_start_weight=args.value_start_weight, decision_weight=args.decision_weight)
    if args.export:  # the latest checkpoint as a model folder, no training
        from cedar.training.trainer import CHECKPOINT, init_model

        state = torch.load(out / CHECKPOINT, weights_only=False)
        model = init_model(cfg, 0)
        model.load_state_dict(state["model"])
        save_model(model, model_dir)
        print(f"[train] exported step {state['step']} to {model_dir}")
        return 0
    t = time.time()
    probes = None if args.no_probes else ProbeSuite(cfg, _probe_config(args), tokenizer_dir=model_dir)
    markers = (ids[ROLE_MARKERS["user"]], ids[END])
    model, curve = train(cfg, arrays, held, tc, out, progress=not args.no_progress, probes=probes, markers=markers)
    save_model(model, model_dir)
    summary = {"command": "cedar " + " ".join(sys.argv[1:]), "geometry": cfg.name,
               "parameters": sum(p.numel() for p in model.parameters()), "steps": tc.steps,
               "tokens_seen": tc.steps * tc.batch * tc.seq_len, "train_seconds": round(curve["seconds"], 1),
               "final_train_loss": float(np.mean([p["loss"] for p in curve["train"][-20:]])),
               "heldout": curve["heldout"][-1] if curve["heldout"] else None,
               "fresh_schemas": args.fresh_schemas, "mistakes": args.mistakes, "served_share": args.served_share,
               "corpus_tokens": int(len(arrays["ids"])), "heldout_tokens": int(len(held["ids"])),
               "probes": curve.get("probes", [])}
    if args.init:  # the run this one continued, with its own summary (and so on down the chain)
        earlier = Path(args.init) / "training.json"
        summary["warm_start"] = {"from": args.init, **(json.loads(earlier.read_text()) if earlier.is_file() else {})}
    (model_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[train] done in {time.time() - t:.0f} s: {json.dumps(summary)}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="build the agent corpus and train a CED model on CPU (resumable)")
    p.add_argument("--out", help="run folder (corpus, checkpoints, curve, model/); required unless --probe-only")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=3, help="packed rows per step")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row (a multiple of 128)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="corpus size relative to the default mix")
    p.add_argument("--fresh-schemas", type=float, default=0.0, metavar="SHARE",
                   help="share of function-calling tasks over tools made up for the task (new tool, parameter "
                        "and enum names; see schemas.fresh_schema)")
    p.add_argument("--mistakes", type=float, default=0.0, metavar="SHARE",
                   help="share of function-calling loop turns that make a wrong call of their own (one value "
                        "drawn anew; no loss on it), get an error and end with an answer that says the call "
                        "failed (see schemas.vary_loops); the corpus is built with it, so use a new --out")
    p.add_argument("--served-share", type=float, default=0.0, metavar="SHARE",
                   help="share of function-calling sessions tokenized whole, as the server tokenizes an "
                        "OpenAI-API chat (the rest are cut at their gens, as a frontend program sends them; "
                        "see build.served_whole); applied when the token arrays are made, so use a new --out")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--bf16", action="store_true",
                   help="matmuls in bfloat16 under CPU autocast (about 2x on AVX512-BF16/AMX; on a CPU "
                        "without them it emulates, about 15x slower than float32: refused there)")
    p.add_argument("--init", help="warm start from this model folder (its weights and tokenizer)")
    p.add_argument("--copy-share", type=float, default=0.0,
                   help="chance that a step's last row is synthetic copying (repeated random strings)")
    p.add_argument("--recall-share", type=float, default=0.0,
                   help="of the copy rows, the share that repeat strings at every distance (trainer.recall_row)")
    p.add_argument("--keyed-share", type=float, default=0.0,
                   help="of the copy rows that are not recall rows, the share of key-value lookups (trainer.keyed_row)")
    p.add_argument("--exchange-share", type=float, default=0.0,
                   help="chance that a step's first row packs the corpus's value-copying exchanges, cut out of "
                        "their sessions (a short-context copy curriculum in the agent format)")
    p.add_argument("--value-start-weight", type=float, default=TrainConfig.value_start_weight,
                   help="loss weight of the first token of a copied value (the token that picks the span)")
    p.add_argument("--decision-weight", type=float, default=TrainConfig.decision_weight,
                   help="loss weight of an assistant message's first token after a tool message (the choice "
                        "between another call and the text answer that ends the loop)")
    p.add_argument("--context-weight", type=float, default=TrainConfig.context_weight,
                   help="loss weight of tokens outside the assistant's turns (assistant tokens: 1)")
    p.add_argument("--dense-share", type=float, default=0.0,
                   help="a first share of steps attends every visible global entry (indexer warm-up)")
    p.add_argument("--decoder-global-beyond-window", action="store_true",
                   help="the decoder's indexers select only global entries outside the window (config.json's "
                        "decoder_global_beyond_window; a warm start's weights carry over)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: min(50, steps / 10))")
    p.add_argument("--export", action="store_true", help="only write the latest checkpoint to DIR/model")
    p.add_argument("--no-probes", action="store_true", help="skip the copy probes at each eval")
    p.add_argument("--probe-only", metavar="MODEL_DIR",
                   help="run the copy probes on a model folder and exit (no training; see --json)")
    p.add_argument("--json", help="with --probe-only: write the probe figures here")
    p.add_argument("--probe-cases", type=int, default=None,
                   help="cases per gap and per value distance (default 4: seconds per eval; 24 for figures to quote)")
    p.add_argument("--probe-quick", action="store_true", help="fewer probe cases, gaps and distances (a smoke run)")
    p.set_defaults(fn=_cmd_train)
    p = sub.add_parser("curriculum", help=curriculum.__doc__.split("\n")[0])
    curriculum.add_arguments(p)
    p.set_defaults(fn=curriculum.run)
    p = sub.add_parser("stage", help=stages.__doc__.split("\n")[0])
    stages.add_arguments(p)
    p.set_defaults(fn=stages.run)

