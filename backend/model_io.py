"""A CED model directory in HF layout: config.json, model.safetensors, tokenizer files,
generation_config.json. ``init_model_dir`` writes a random-init model; ``load_model`` reads one
back bit-identically and rejects wrong or truncated files with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cedar.kernels.dispatch import KernelSet

from .config import CEDConfig
from .geometries import geometry
from .model import CEDModel
from .tokenizer import build_tokenizer, generation_eos_token_ids, special_token_ids
from .weights import WeightsError, load_weights, save_weights

INIT_STD = 0.05  # weights ~ N(0, 0.05): large enough that a random model's outputs vary


def random_model(cfg: CEDConfig, seed: int = 0) -> CEDModel:
    """Deterministic random init: linear/embedding weights N(0, INIT_STD), norms 1, sinks N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    model = CEDModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sink"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
    return model


def init_model_dir(geometry_name: str, out_dir: Path, seed: int = 0) -> CEDConfig:
    """Write a random-init model of a named geometry (with its tokenizer) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=512)
    ids = special_token_ids(out_dir)
    base = geometry(geometry_name)
    if geometry_name == "cedar-tiny":
        from .geometries import cedar_tiny

        base = cedar_tiny(vocab_size=512, bos=ids["<|bos|>"], eos=tuple(generation_eos_token_ids(out_dir)),
                          pad=ids["<|pad|>"])
    save_model(random_model(base, seed), out_dir)
    return base


def save_model(model: CEDModel, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    model.cfg.save(out_dir)
    save_weights(model.state_dict(), out_dir)
    gen = {"bos_token_id": model.cfg.bos_token_id, "eos_token_id": list(model.cfg.eos_token_ids),
           "pad_token_id": model.cfg.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def load_model(model_dir: Path, kernels: KernelSet | None = None, quantize: bool = True) -> CEDModel:
    """Read a model directory; raises ValueError (WeightsError) naming what is wrong."""
    cfg = CEDConfig.load(model_dir)
    model = CEDModel(cfg, kernels=kernels, quantize=quantize)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    tensors = load_weights(Path(model_dir), expected)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


__all__ = ["random_model", "init_model_dir", "save_model", "load_model", "WeightsError"]
