"""Safetensors I/O for a Cedar model directory (`model_dir/model.safetensors`).

The file is one flat `name -> tensor` map with metadata
`{"format": "pt", "cedar_format_version": "1"}`. Loading validates the file against what the
model expects (names, shapes, dtypes) so that a bad checkpoint fails at load time with a message
naming the problem, instead of as a shape error deep inside a forward.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = "1"

# name -> (shape, dtype) that a model expects to load.
ExpectedTensors = dict[str, tuple[tuple[int, ...], torch.dtype]]

_MAX_NAMES_IN_MESSAGE = 5


class WeightsError(ValueError):
    """A model directory's weights are missing, unreadable or do not match the model."""


def save_weights(state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write `state_dict` to `out_dir/model.safetensors` (creating `out_dir` if needed).

    Every tensor is stored as a contiguous CPU copy; `state_dict` itself is not modified. The
    file appears atomically: a reader never sees a half-written `model.safetensors`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: _cpu_copy(name, tensor) for name, tensor in state_dict.items()}
    path = out_dir / WEIGHTS_FILE
    tmp_path = out_dir / f".{WEIGHTS_FILE}.tmp"
    metadata = {"format": "pt", "cedar_format_version": FORMAT_VERSION}
    save_file(tensors, str(tmp_path), metadata=metadata)
    os.replace(tmp_path, path)


def load_weights(model_dir: Path, expected: ExpectedTensors) -> dict[str, torch.Tensor]:
    """Read `model_dir/model.safetensors` and check it holds exactly the tensors in `expected`.

    Returns CPU tensors bit-identical to what `save_weights` was given. Raises WeightsError if the
    file is missing, truncated or corrupt, has another `cedar_format_version` (a file without that
    key is accepted), lacks expected names, has unexpected names, or has a tensor whose shape or
    dtype differs from `expected`. All name and shape problems are reported in one message.
    """
    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise WeightsError(f"weights file not found: {path}")
    metadata, tensors = _read_file(path)
    version = metadata.get("cedar_format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise WeightsError(
            f"{path}: cedar_format_version {version!r}, this code reads {FORMAT_VERSION!r}")
    problems = _mismatches(tensors, expected)
    if problems:
        raise WeightsError(f"{path} does not match the model: " + "; ".join(problems))
    return tensors


def _cpu_copy(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise TypeError(f"state_dict entries must be str -> Tensor, got {name!r}: {type(tensor)}")
    # NOTE: always copy: tied weights (e.g. embedding == lm_head) share storage, which
    # safetensors refuses to save; a copy per name stores each as its own tensor.
    return tensor.detach().to("cpu", copy=True).contiguous()


def _read_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read metadata and every tensor; library errors become WeightsError naming `path`."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as exc:
        raise WeightsError(f"{path} is truncated or corrupt: {exc}") from exc
    return metadata, tensors


def _mismatches(tensors: dict[str, torch.Tensor], expected: ExpectedTensors) -> list[str]:
    """One human-readable line per kind of mismatch between `tensors` and `expected`."""
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_few(unexpected)}")
    for name in sorted(set(tensors) & set(expected)):
        want_shape, want_dtype = expected[name]
        got = tensors[name]
        if tuple(got.shape) != tuple(want_shape) or got.dtype != want_dtype:
            problems.append(f"{name}: expected shape {tuple(want_shape)} {want_dtype}, "
                            f"got {tuple(got.shape)} {got.dtype}")
    return problems


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_MESSAGE])
    more = len(names) - _MAX_NAMES_IN_MESSAGE
    return shown + (f", ... ({more} more)" if more > 0 else "")
