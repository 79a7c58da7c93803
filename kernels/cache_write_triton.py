"""Quantize new KV rows and write them into their cache slots in one pass (Triton; twins and
the skip rules in ``cache_write_ref``).

Each program quantizes a block of rows as a (rows, groups, group) tile with the codec helpers
of ``fp8_triton`` / ``fp4_triton`` (integer E4M3/E8M0 encoders, bit-exact with the torch codecs
on CPU and GPU) and stores codes and scales at the row's slot instead of its own index.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from cedar.kernels.cache_write_ref import check_scatter_args
from cedar.kernels.formats import GLOBAL_ROW, WINDOW_ROW, Fp4Format
from cedar.kernels.fp4_triton import fp4_encode_groups
from cedar.kernels.fp8_triton import (
    check_triton_group,
    e4m3_encode,
    e8m0_decode,
    e8m0_exponent,
    launch_geometry,
)


@triton.jit
def _rows_to_write(slots_ptr, pos_ptr, floor, n_rows, num_slots, BLOCK_ROWS: tl.constexpr):
    """(R,) source rows of this program, their (R,) slots and the (R,) mask of rows to write."""
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    r_ok = r < n_rows
    slot = tl.load(slots_ptr + r, mask=r_ok, other=-1)
    pos = tl.load(pos_ptr + r, mask=r_ok, other=0)
    return r, slot, r_ok & (slot >= 0) & (slot < num_slots) & (pos >= floor)


@triton.jit
def _fp8_scatter_kernel(x_ptr, slots_ptr, pos_ptr, codes_ptr, scales_ptr, floor,
                        n_rows, num_slots, num_groups,
                        GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    r, slot, write = _rows_to_write(slots_ptr, pos_ptr, floor, n_rows, num_slots, BLOCK_ROWS)
    g = tl.arange(0, GROUPS_PAD)
    elem = (g[:, None] * GROUP + tl.arange(0, GROUP)[None, :])[None, :, :]  # (1, G, GROUP)
    g_mask = write[:, None] & (g < num_groups)[None, :]  # (R, G)
    mask = g_mask[:, :, None]
    row_len = num_groups * GROUP
    x = tl.load(x_ptr + r[:, None, None] * row_len + elem, mask=mask, other=0.0).to(tl.float32)
    finite = (x == x) & (tl.abs(x) != float("inf"))
    poisoned = tl.max((~finite).to(tl.int32), axis=2) > 0  # (R, G)
    x = tl.where(finite, x, 0.0)
    e = e8m0_exponent(tl.max(tl.abs(x), axis=2), 9, 0x600000)  # 448 = 0.875 * 2**9
    scale = e8m0_decode(e + 127)[:, :, None]
    y = tl.minimum(tl.math.div_rn(tl.abs(x), scale), 448.0)
    codes = e4m3_encode(y) | ((x < 0).to(tl.int32) << 7)
    codes = tl.where(poisoned[:, :, None], 0, codes)
    tl.store(codes_ptr + slot[:, None, None] * row_len + elem, codes.to(tl.uint8), mask=mask)
    scale_byte = tl.where(poisoned, 255, e + 127)
    tl.store(scales_ptr + slot[:, None] * num_groups + g[None, :], scale_byte.to(tl.uint8), mask=g_mask)


@triton.jit
def _fp4_scatter_kernel(x_ptr, slots_ptr, pos_ptr, codes_ptr, scales_ptr, floor,
                        n_rows, num_slots, num_groups,
                        GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        E4M3_SCALE: tl.constexpr):
    r, slot, write = _rows_to_write(slots_ptr, pos_ptr, floor, n_rows, num_slots, BLOCK_ROWS)
    HALF: tl.constexpr = GROUP // 2
    g = tl.arange(0, GROUPS_PAD)
    pair = (g[:, None] * HALF + tl.arange(0, HALF)[None, :])[None, :, :]  # (1, G, HALF) byte
    g_mask = write[:, None] & (g < num_groups)[None, :]  # (R, G)
    mask = g_mask[:, :, None]
    row_bytes = num_groups * HALF
    # NOTE: the tile is element PAIRS (one output byte each), as in fp4_triton.
    src = x_ptr + r[:, None, None] * (2 * row_bytes) + 2 * pair
    x_even = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # (R, G, HALF)
    x_odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    packed, scale_byte = fp4_encode_groups(x_even, x_odd, E4M3_SCALE)
    tl.store(codes_ptr + slot[:, None, None] * row_bytes + pair, packed.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + slot[:, None] * num_groups + g[None, :], scale_byte.to(tl.uint8), mask=g_mask)


def quantize_scatter_window(rows: Tensor, slots: Tensor, codes: Tensor, scales: Tensor,
                            row_pos: Tensor, floor: int) -> None:
    """FP8-quantize window rows and write them in place (contract of the twin in ``cache_write_ref``).

    rows: (T, D) float32 (bf16/fp16 accepted), D a multiple of 32; slots: (T,) int64 (-1 = skip);
    codes: (S, D) uint8, scales: (S, D // 32) uint8, both mutated; row_pos: (T,) int64;
    floor: rows with row_pos < floor are not written. All contiguous.
    """
    check_scatter_args("quantize_scatter_window", rows, slots, codes, scales, row_pos, WINDOW_ROW)
    check_triton_group(WINDOW_ROW.group)
    n, d = rows.shape
    if n == 0:
        return
    num_groups = d // WINDOW_ROW.group
    groups_pad, block_rows = launch_geometry(n, num_groups, WINDOW_ROW.group, rows.is_cuda)
    _fp8_scatter_kernel[(triton.cdiv(n, block_rows),)](
        rows, slots, row_pos, codes, scales, int(floor), n, codes.shape[0], num_groups,
        GROUP=WINDOW_ROW.group, GROUPS_PAD=groups_pad, BLOCK_ROWS=block_rows)


def quantize_scatter_global(rows: Tensor, slots: Tensor, codes: Tensor, scales: Tensor,
                            entry_last_pos: Tensor, write_floor: int, fmt: Fp4Format = GLOBAL_ROW) -> None:
    """FP4-quantize global KV rows and write them in place (contract of the twin in ``cache_write_ref``).

    rows: (G, D) float32 (bf16/fp16 accepted); slots: (G,) int64 (-1 = skip); codes: (S, D // 2)
    uint8, scales: (S, D // fmt.group) uint8, both mutated; entry_last_pos: (G,) int64;
    write_floor: groups with entry_last_pos < write_floor are not written. All contiguous.
    fmt: GLOBAL_ROW by default; INDEX_ROW for index keys.
    """
    if not isinstance(fmt, Fp4Format):
        raise ValueError(f"quantize_scatter_global: fmt must be an Fp4Format, got {fmt!r}")
    check_scatter_args("quantize_scatter_global", rows, slots, codes, scales, entry_last_pos, fmt)
    check_triton_group(fmt.group)
    n, d = rows.shape
    if n == 0:
        return
    num_groups = d // fmt.group
    groups_pad, block_rows = launch_geometry(n, num_groups, fmt.group, rows.is_cuda)
    _fp4_scatter_kernel[(triton.cdiv(n, block_rows),)](
        rows, slots, entry_last_pos, codes, scales, int(write_floor), n, codes.shape[0], num_groups,
        GROUP=fmt.group, GROUPS_PAD=groups_pad, BLOCK_ROWS=block_rows, E4M3_SCALE=fmt.scale == "e4m3")
