"""Quantize new KV rows and write them into their cache slots (pure torch twins of
``cache_write_triton``).

- ``quantize_scatter_window``: FP8 sliding-window rows (``formats.WINDOW_ROW``), one per token.
  A row whose position is below the replay ``floor`` is NOT written: bounded replay recomputes
  tokens under the floor only to rebuild state, and their window slots must keep what they hold.
- ``quantize_scatter_global``: FP4 global KV rows (``formats.GLOBAL_ROW``; index keys pass
  ``fmt=formats.INDEX_ROW``), one per compressed group; a group whose last position is below
  ``write_floor`` is already in the cache (a prefix hit) and is NOT rewritten.

Either way a row with ``slot < 0`` is skipped (padding). Written rows are bit-identical to
``fp8_ref.fp8_quantize`` / ``fp4_ref.fp4_quantize`` of the same values. The slots of the rows that
are written must be distinct and ``< S``: the twin raises IndexError on an out-of-range slot, the
kernel skips it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cedar.kernels.formats import (
    FLOAT_DTYPES,
    GLOBAL_ROW,
    WINDOW_ROW,
    Fp4Format,
    RowFormat,
    code_cols,
    scale_cols,
)
from cedar.kernels.fp4_ref import fp4_quantize
from cedar.kernels.fp8_ref import fp8_quantize


def check_scatter_args(name: str, rows: Tensor, slots: Tensor, codes: Tensor, scales: Tensor,
                       pos: Tensor, fmt: RowFormat) -> None:
    """Shapes, dtypes, contiguity and devices of a quantize-scatter call (raises ValueError)."""
    if rows.dim() != 2 or rows.dtype not in FLOAT_DTYPES or not rows.is_contiguous():
        raise ValueError(f"{name}: rows must be contiguous (T, D) in {FLOAT_DTYPES}, "
                         f"got {tuple(rows.shape)} {rows.dtype}")
    T, D = rows.shape
    for arg, x in (("slots", slots), ("positions", pos)):
        if x.shape != (T,) or x.dtype != torch.int64 or not x.is_contiguous():
            raise ValueError(f"{name}: {arg} must be contiguous ({T},) int64, got {tuple(x.shape)} {x.dtype}")
    want_codes, want_scales = code_cols(fmt, D), scale_cols(fmt, D)
    for arg, x, cols in (("codes", codes, want_codes), ("scales", scales, want_scales)):
        if x.dim() != 2 or x.shape[1] != cols or x.dtype != torch.uint8 or not x.is_contiguous():
            raise ValueError(f"{name}: {arg} must be contiguous (S, {cols}) uint8, "
                             f"got {tuple(x.shape)} {x.dtype}")
    if codes.shape[0] != scales.shape[0]:
        raise ValueError(f"{name}: codes and scales disagree on S: {codes.shape[0]} vs {scales.shape[0]}")
    if any(x.device != rows.device for x in (slots, codes, scales, pos)):
        raise ValueError(f"{name}: all tensors must be on one device")


def _scatter(rows: Tensor, slots: Tensor, codes: Tensor, scales: Tensor, keep: Tensor, quantize) -> None:
    keep = keep & (slots >= 0)  # (T,) bool
    new_codes, new_scales = quantize(rows[keep].contiguous())
    dst = slots[keep]
    codes[dst] = new_codes
    scales[dst] = new_scales


def quantize_scatter_window(rows: Tensor, slots: Tensor, codes: Tensor, scales: Tensor,
                            row_pos: Tensor, floor: int) -> None:
    """FP8-quantize window rows and write them in place.

    rows: (T, D) float32 (bf16/fp16 accepted), D a multiple of 32; slots: (T,) int64 cache rows
    (-1 = skip); codes: (S, D) uint8 E4M3 bits, scales: (S, D // 32) uint8 E8M0, both mutated;
    row_pos: (T,) int64 token positions; floor: rows with row_pos < floor are not written.
    """
    check_scatter_args("quantize_scatter_window", rows, slots, codes, scales, row_pos, WINDOW_ROW)
    _scatter(rows, slots, codes, scales, row_pos >= floor, lambda x: fp8_quantize(x, WINDOW_ROW))


def quantize_scatter_global(rows: Tensor, slots: Tensor, codes: Tensor, scales: Tensor,
                            entry_last_pos: Tensor, write_floor: int, fmt: Fp4Format = GLOBAL_ROW) -> None:
    """FP4-quantize global KV rows and write them in place.

    rows: (G, D) float32 (bf16/fp16 accepted), D a multiple of fmt.group; slots: (G,) int64 cache
    rows (-1 = skip); codes: (S, D // 2) uint8 packed E2M1, scales: (S, D // fmt.group) uint8,
    both mutated; entry_last_pos: (G,) int64, the last token position of each group;
    write_floor: groups with entry_last_pos < write_floor are not written.
    fmt: GLOBAL_ROW (E4M3 scales per 16) by default; INDEX_ROW for index keys.
    """
    if not isinstance(fmt, Fp4Format):
        raise ValueError(f"quantize_scatter_global: fmt must be an Fp4Format, got {fmt!r}")
    check_scatter_args("quantize_scatter_global", rows, slots, codes, scales, entry_last_pos, fmt)
    _scatter(rows, slots, codes, scales, entry_last_pos >= write_floor, lambda x: fp4_quantize(x, fmt))
