"""Row formats of Cedar's quantized caches and their byte accounting (SPEC section 2).

A cache row of ``dim`` values is stored as two byte tensors:

- codes: FP4 E2M1 packed two per byte (``dim // 2`` bytes), or FP8 E4M3 one per byte (``dim``);
- scales: one byte per ``group`` consecutive values (``dim // group`` bytes), E4M3 or E8M0.

The codecs (``fp4_ref`` / ``fp8_ref`` and their Triton twins) take these descriptors and use the
argument checks below, so every implementation rejects the same bad inputs with ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

FP4_SCALES = ("e4m3", "e8m0")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp4Format:
    """FP4 E2M1 values, one ``scale`` byte (E4M3 or E8M0) per ``group`` values."""

    group: int
    scale: str

    def __post_init__(self) -> None:
        if self.group <= 0 or self.group % 2:
            raise ValueError(f"Fp4Format.group must be a positive even number, got {self.group}")
        if self.scale not in FP4_SCALES:
            raise ValueError(f"Fp4Format.scale must be one of {FP4_SCALES}, got {self.scale!r}")


@dataclass(frozen=True)
class Fp8Format:
    """FP8 E4M3 values, one E8M0 scale byte per ``group`` values."""

    group: int

    def __post_init__(self) -> None:
        if self.group <= 0:
            raise ValueError(f"Fp8Format.group must be positive, got {self.group}")


RowFormat = Union[Fp4Format, Fp8Format]

GLOBAL_ROW = Fp4Format(16, "e4m3")  # global KV: 512 values -> 288 B
INDEX_ROW = Fp4Format(32, "e8m0")  # index keys: 128 values -> 68 B
WINDOW_ROW = Fp8Format(32)  # sliding-window KV: 512 values -> 528 B


def code_cols(fmt: RowFormat, dim: int) -> int:
    """Bytes of value codes per row of ``dim`` values (raises ValueError on a bad ``dim``)."""
    check_dim(fmt, dim)
    return dim // 2 if isinstance(fmt, Fp4Format) else dim


def scale_cols(fmt: RowFormat, dim: int) -> int:
    """Scale bytes per row of ``dim`` values (raises ValueError on a bad ``dim``)."""
    check_dim(fmt, dim)
    return dim // fmt.group


def row_bytes(fmt: RowFormat, dim: int) -> int:
    """Bytes one cache row of ``dim`` values occupies: codes plus scales."""
    return code_cols(fmt, dim) + scale_cols(fmt, dim)


def check_format(fmt: RowFormat) -> None:
    if not isinstance(fmt, (Fp4Format, Fp8Format)):
        raise ValueError(f"expected an Fp4Format or Fp8Format, got {type(fmt).__name__}")


def check_dim(fmt: RowFormat, dim: int) -> None:
    check_format(fmt)
    if dim <= 0 or dim % fmt.group:
        raise ValueError(f"row dim {dim} is not a positive multiple of the group {fmt.group}")


def check_quantize_args(x: torch.Tensor, fmt: RowFormat) -> None:
    """``x``: (N, D) float32/bfloat16/float16, contiguous; D a multiple of ``fmt.group``."""
    if x.dim() != 2:
        raise ValueError(f"expected x of shape (N, D), got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"expected x in {FLOAT_DTYPES}, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    check_dim(fmt, x.shape[1])


def check_dequantize_args(
    codes: torch.Tensor, scales: torch.Tensor, fmt: RowFormat, dtype: torch.dtype
) -> int:
    """Validate a (codes, scales) pair of uint8 rows; returns the row dim D they describe."""
    check_format(fmt)
    if codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0]:
        raise ValueError(f"expected codes (N, C), scales (N, G); got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"codes and scales must be uint8, got {codes.dtype}, {scales.dtype}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("codes and scales must be contiguous")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"output dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    dim = codes.shape[1] * 2 if isinstance(fmt, Fp4Format) else codes.shape[1]
    if dim == 0 or scales.shape[1] != scale_cols(fmt, dim):
        raise ValueError(f"{tuple(codes.shape)} codes and {tuple(scales.shape)} scales do not "
                         f"form rows of format {fmt}")
    return dim
