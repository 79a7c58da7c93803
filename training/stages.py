"""Keep a finished training stage across sessions: its weights in the repo, in float16.

    cedar stage save MODEL_DIR training/checkpoints/NAME.safetensors \
        [--note TEXT]
    cedar stage restore training/checkpoints/NAME.safetensors MODEL_DIR \
        [--like models/cedar-agent]
    cedar stage average STAGE_DIR EARLIER_DIR OUT_DIR [--weight W] [--note TEXT]

Why: issue 21's training chain takes longer than one session, and a session's `runs/` (git-ignored,
beside the checkpoints with their optimizer state) does not outlive its machine. A stage's *model*
is what the next stage starts from, so that is what is kept: every weight in float16 (half the
bytes of the float32 model folder; a weight above 6e-5 in magnitude within 2^-11 relative of the
trained one, a smaller one within 6e-8: the next stage's first steps absorb that), with the stage's provenance in the file's metadata. `restore`
writes a float32 model folder (the config the stage was saved with; tokenizer of `--like`, the
shipped model by default) that `--init` of the next stage reads. Each stage is written once; the shipped
model in `models/` is the chain's end, not one of these.

`average` writes the mean of two model folders' weights, tensor by tensor (a stage and the model it
started from: a point between them, which keeps some of what the stage gained and some of what it
cost); ``--weight W`` gives the stage the share W and the earlier model 1 - W (default 0.5: the
mean). Its ``training.json`` is a stage of its own, 0 steps, warm-started from ``STAGE_DIR``'s.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from cedar.backend.config import CEDConfig
from cedar.backend.model import CEDModel
from cedar.backend.model_io import load_model, save_model
from cedar.backend.tokenizer import TOKENIZER_FILES


def save(model_dir: Path, out: Path, note: str) -> None:
    model = load_model(model_dir, quantize=False)
    half = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    for k, v in model.state_dict().items():
        if v.is_floating_point() and not torch.isfinite(half[k]).all():
            raise ValueError(f"{k}: does not fit float16 (max |w| {float(v.abs().max()):.3g})")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"from": str(model_dir), "note": note, "config": json.dumps(model.cfg.__dict__, default=str)}
    training = model_dir / "training.json"
    if training.is_file():
        meta["training"] = training.read_text()
    save_file(half, str(out), metadata=meta)
    print(f"saved {len(half)} tensors ({out.stat().st_size / 2**20:.1f} MiB) to {out}")


def stage_config(ckpt: Path, like: Path) -> CEDConfig:
    """The config the stage was trained with (its metadata), else ``like``'s (a stage saved without one).

    A stage may differ from ``like`` in a flag that changes no tensor (``decoder_global_beyond_window``):
    restoring its weights under ``like``'s config would run them as a model they were not trained as.
    """
    with safe_open(str(ckpt), "pt") as f:
        meta = f.metadata() or {}
    return CEDConfig.from_hf_dict(json.loads(meta["config"])) if "config" in meta else CEDConfig.load(like)


def restore(ckpt: Path, model_dir: Path, like: Path) -> None:
    model = CEDModel(stage_config(ckpt, like), quantize=False)
    state = model.state_dict()
    half = load_file(str(ckpt))
    if set(half) != set(state):
        raise ValueError(f"{ckpt}: tensors differ from its config's model: {sorted(set(half) ^ set(state))[:5]}")
    model.load_state_dict({k: half[k].to(state[k].dtype) for k in state}, strict=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, model_dir)
    for name in TOKENIZER_FILES:
        if (like / name).exists():
            shutil.copy(like / name, model_dir / name)
    with safe_open(str(ckpt), "pt") as f:
        meta = f.metadata() or {}
    (model_dir / "stage.json").write_text(json.dumps({"checkpoint": str(ckpt), **meta}, indent=1) + "\n")
    print(f"restored {ckpt} to {model_dir}")


def average(stage_dir: Path, earlier_dir: Path, out: Path, note: str = "", weight: float = 0.5) -> None:
    """``out`` = ``weight`` x the stage's weights + (1 - ``weight``) x the earlier folder's, tensor
    by tensor (float32; 0.5: the mean), with ``stage_dir``'s config and tokenizer; ValueError when
    their configs or tensors differ or the weight is outside (0, 1)."""
    if not 0.0 < weight < 1.0:
        raise ValueError(f"--weight {weight}: the stage's share must lie strictly between 0 and 1")
    a, b = load_model(stage_dir, quantize=False), load_model(earlier_dir, quantize=False)
    if a.cfg != b.cfg:
        raise ValueError(f"{stage_dir} and {earlier_dir}: the configs differ; only one geometry can be averaged")
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        raise ValueError(f"{stage_dir} and {earlier_dir}: the tensors differ")
    # NOTE: at 0.5 the same bits as (a + b) / 2: halving is exact, so either rounds the same sum
    a.load_state_dict({k: weight * sa[k] + (1.0 - weight) * sb[k] if sa[k].is_floating_point() else sa[k]
                       for k in sa}, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    save_model(a, out)
    for name in TOKENIZER_FILES:
        if (stage_dir / name).exists():
            shutil.copy(stage_dir / name, out / name)
    trained = json.loads((stage_dir / "training.json").read_text()) if (stage_dir / "training.json").is_file() else {}
    keep = {k: trained[k] for k in ("geometry", "parameters", "corpus_tokens", "heldout_tokens") if k in trained}
    mean = weight == 0.5
    summary = {"command": f"cedar stage average {stage_dir} {earlier_dir} {out}" + ("" if mean else f" --weight {weight:g}"),
               **keep, "steps": 0, "tokens_seen": 0, "train_seconds": 0.0, "heldout": None, "probes": [],
               "note": note or (f"the mean of this stage's weights and {earlier_dir}'s" if mean else
                                f"{weight:g} x this stage's weights + {1 - weight:g} x {earlier_dir}'s"),
               "warm_start": trained}
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"averaged {len(sa)} tensors of {stage_dir} and {earlier_dir} into {out}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("model_dir", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--note", default="")
    r = sub.add_parser("restore")
    r.add_argument("ckpt", type=Path)
    r.add_argument("model_dir", type=Path)
    r.add_argument("--like", type=Path, default=Path("models/cedar-agent"))
    v = sub.add_parser("average")
    v.add_argument("stage_dir", type=Path)
    v.add_argument("earlier_dir", type=Path)
    v.add_argument("out", type=Path)
    v.add_argument("--weight", type=float, default=0.5, help="the stage's share (the earlier model's: 1 - W)")
    v.add_argument("--note", default="")


def run(a: argparse.Namespace) -> int:
    if a.cmd == "save":
        save(a.model_dir, a.out, a.note)
    elif a.cmd == "average":
        average(a.stage_dir, a.earlier_dir, a.out, a.note, a.weight)
    else:
        restore(a.ckpt, a.model_dir, a.like)
    return 0
