"""A short-context copy curriculum: does a model form a copy (induction) head, and when?

    cedar curriculum --init models/cedar-agent --out DIR \
        [--kind copy|recall] [--seq-len 256] [--batch 16] [--steps 2000] [--lr 1e-3] [--threads 1] \
        [--dense-steps N] [--export MODEL_DIR]

Trains on synthetic copying rows only (`trainer.copy_row`: random strings of 8-48 ids from the
non-special vocabulary said 2-4 times; the first statement input only, the repeats trained),
through the trainer's `DenseForward` (matmuls in bf16 where the CPU has bf16 instructions, else
float32: `--precision`), and every 25 steps scores greedy top-1
accuracy on the repeats of 4 fixed held-out rows (seed 12345). Writes DIR/curve.jsonl as it goes
and DIR/state.pt (model + optimizer) every 100 steps; a second run with the same DIR resumes.

`--kind recall` trains `trainer.recall_row` instead (strings repeated at every distance up to the
row's length: past the window only the global entries reach them), the first `--dense-steps`
steps attending every visible global entry with the indexer distilled toward that attention (its
warm-up); every 100 steps it also runs the copy probes (repeat accuracy and indexer recall by gap)
into DIR/probes.jsonl. `--export MODEL_DIR` writes the current state as a model folder (weights,
config and tokenizer of --init) and trains nothing.

Why: the agent corpus alone left the repeat probe at chance (`cedar train --probe-only`); short
rows (every repeat inside the 128-token window) are where the copy head is cheapest to form,
after which longer gaps and the agent data can follow (`../shared/notes/copying.md`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from cedar.backend.model_io import load_model, save_model
from cedar.backend.tokenizer import TOKENIZER_FILES
from cedar.training.dense import DenseForward, Plan
from cedar.training.probes import ProbeSuite
from cedar.training.trainer import TrainConfig, atomic_save, bf16_is_native, copy_row, loss_of, recall_row


def rows(tc: TrainConfig, first: int, n: int, seq_len: int, make=copy_row):
    made = [make(tc, first + i, seq_len) for i in range(n)]
    return tuple(torch.stack([r[k] for r in made]) for k in range(3))


@torch.no_grad()
def repeat_accuracy(model, fwd: DenseForward, tc: TrainConfig, seq_len: int, make=copy_row) -> float:
    """Greedy top-1 accuracy on the trained (repeat) tokens of 4 fixed held-out rows."""
    model.eval()
    ids, doc, w = rows(replace(tc, seed=12345), 0, 4, seq_len, make)
    logits, _ = fwd.run(ids, doc, Plan())
    model.train()
    hit = logits[:, :-1].argmax(-1) == ids[:, 1:]
    m = (w[:, 1:] == 1) & (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0)
    return float((hit & m).sum() / m.sum())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--init", required=True, help="model folder to start from")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kind", choices=("copy", "recall"), default="copy")
    ap.add_argument("--dense-steps", type=int, default=0, help="first steps attend every global entry")
    ap.add_argument("--aux-weight", type=float, default=TrainConfig.aux_weight, help="indexer distillation weight")
    ap.add_argument("--aux-stride", type=int, default=8, help="indexer loss on every n-th query row")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="auto: bf16 autocast only where the CPU multiplies bf16 natively (AVX512-BF16/AMX)")
    ap.add_argument("--export", type=Path, help="write the saved state as a model folder here; no training")


def run(a: argparse.Namespace) -> int:
    make = recall_row if a.kind == "recall" else copy_row
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    model = load_model(Path(a.init), quantize=False)
    model.train()
    bf16 = a.precision == "bf16" or (a.precision == "auto" and bf16_is_native())
    tc = TrainConfig(seed=0, bf16=bf16, steps=a.steps, batch=a.batch, seq_len=a.seq_len, aux_weight=a.aux_weight)
    fwd = DenseForward(model, aux_stride=a.aux_stride)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    start, state = 0, a.out / "state.pt"
    if state.is_file():
        s = torch.load(state, weights_only=False)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        start = s["step"]
        # NOTE: a run stopped between checkpoints logged steps it now redoes: keep the log's past only
        for name, last in (("curve.jsonl", start - 1), ("probes.jsonl", start)):
            log = a.out / name
            if log.is_file():
                recs = [line for line in log.read_text().splitlines() if line and json.loads(line)["step"] <= last]
                log.write_text("".join(r + "\n" for r in recs))
    if a.export:
        import shutil

        a.export.mkdir(parents=True, exist_ok=True)
        save_model(model, a.export)
        for name in TOKENIZER_FILES + ("generation_config.json",):
            if (Path(a.init) / name).exists():
                shutil.copy(Path(a.init) / name, a.export / name)
        print(f"exported step {start} to {a.export}")
        return 0
    probes = ProbeSuite(model.cfg)
    t0 = time.time()
    with open(a.out / "curve.jsonl", "a") as log:
        for step in range(start, a.steps):
            for g in opt.param_groups:
                g["lr"] = a.lr * min(1.0, (step + 1) / 20)
            ids, doc, w = rows(tc, step * a.batch, a.batch, a.seq_len, make)
            loss, _ = loss_of(fwd, ids, doc, w, Plan(dense_global=step < a.dense_steps), tc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 25 == 0 or step == a.steps - 1:
                rec = {"step": step, "loss": round(float(loss.detach()), 4),
                       "repeat_acc": round(repeat_accuracy(model, fwd, tc, a.seq_len, make), 4),
                       "seconds": round(time.time() - t0, 1)}
                print(rec, flush=True)
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if (step + 1) % 100 == 0 or step + 1 == a.steps:
                with open(a.out / "probes.jsonl", "a") as pl:
                    pl.write(json.dumps({"step": step + 1, **probes.run(model)}) + "\n")
                atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, state)
    return 0
