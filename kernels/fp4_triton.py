"""FP4 (E2M1) row codec in Triton; bit-exact twin of ``fp4_ref`` (layout and rules are there).

A program handles a block of rows as a (rows, groups, group // 2) tile of element PAIRS: the even
and odd elements are loaded separately, so packing two nibbles per byte needs no reshape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cedar.kernels.formats import Fp4Format, check_dequantize_args, check_quantize_args
from cedar.kernels.fp8_triton import (
    check_triton_group,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    e8m0_exponent,
    as_kernel_arg,
    group_offsets,
    launch_geometry,
    load_fp32,
    store_fp32,
)


@triton.jit
def e2m1_code(x, scale):
    """fp32 finite x, decoded scale (> 0 or 0 = flush) -> int32 E2M1 nibble; mirrors e2m1_codes."""
    y = tl.math.div_rn(tl.abs(x), tl.where(scale > 0, scale, 1.0))
    # NOTE: '>' where the upper code is odd, '>=' where it is even: ties go to the even code.
    mag = ((y > 0.25).to(tl.int32) + (y >= 0.75).to(tl.int32) + (y > 1.25).to(tl.int32)
           + (y >= 1.75).to(tl.int32) + (y > 2.5).to(tl.int32) + (y >= 3.5).to(tl.int32)
           + (y > 5.0).to(tl.int32))
    code = mag | ((x < 0).to(tl.int32) << 3)
    return tl.where(scale > 0, code, 0)


@triton.jit
def e2m1_value(code):
    """int32 nibble -> fp32 signed E2M1 value (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    m = code & 7
    big = ((m & 1) + 2).to(tl.float32) * (1 << (m >> 1)).to(tl.float32) * 0.25
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, big)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _fp4_quantize_kernel(x_ptr, packed_ptr, scales_ptr, n_rows, num_groups,
                         GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         E4M3_SCALE: tl.constexpr, IS_BF16: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_ROWS
    offs, mask = group_offsets(row0, n_rows, num_groups, num_groups * (GROUP // 2),
                               BLOCK_ROWS, GROUPS_PAD, GROUP // 2)  # byte offsets
    x_even = load_fp32(x_ptr, 2 * offs, mask, IS_BF16)  # (R, G, GROUP / 2)
    x_odd = load_fp32(x_ptr, 2 * offs + 1, mask, IS_BF16)
    packed, scale_byte = fp4_encode_groups(x_even, x_odd, E4M3_SCALE)
    tl.store(packed_ptr + offs, packed.to(tl.uint8), mask=mask)
    s_offs, s_mask = group_offsets(row0, n_rows, num_groups, num_groups, BLOCK_ROWS, GROUPS_PAD, 1)
    tl.store(scales_ptr + s_offs, scale_byte[:, :, None].to(tl.uint8), mask=s_mask)


@triton.jit
def fp4_encode_groups(x_even, x_odd, E4M3_SCALE: tl.constexpr):
    """x_even, x_odd: (R, G, GROUP / 2) f32, the even / odd elements of each group ->
    packed bytes (R, G, GROUP / 2) int32 and scale bytes (R, G) int32 (NaN code if poisoned)."""
    finite_even = (x_even == x_even) & (tl.abs(x_even) != float("inf"))
    finite_odd = (x_odd == x_odd) & (tl.abs(x_odd) != float("inf"))
    poisoned = tl.max((~(finite_even & finite_odd)).to(tl.int32), axis=2) > 0  # (R, G)
    x_even = tl.where(finite_even, x_even, 0.0)
    x_odd = tl.where(finite_odd, x_odd, 0.0)
    amax = tl.maximum(tl.max(tl.abs(x_even), axis=2), tl.max(tl.abs(x_odd), axis=2))
    if E4M3_SCALE:
        scale_byte = e4m3_encode(tl.minimum(tl.math.div_rn(amax, 6.0), 448.0))
        nan_byte = 0x7F
        scale = e4m3_decode(scale_byte)
    else:
        scale_byte = e8m0_exponent(amax, 3, 0x400000) + 127  # 6 = 0.75 * 2**3
        nan_byte = 0xFF
        scale = e8m0_decode(scale_byte)
    scale = scale[:, :, None]
    packed = e2m1_code(x_even, scale) | (e2m1_code(x_odd, scale) << 4)
    packed = tl.where(poisoned[:, :, None], 0, packed)
    return packed, tl.where(poisoned, nan_byte, scale_byte)


@triton.jit
def _fp4_dequantize_kernel(packed_ptr, scales_ptr, out_ptr, n_rows, num_groups,
                           GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, E4M3_SCALE: tl.constexpr,
                           IS_BF16: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_ROWS
    offs, mask = group_offsets(row0, n_rows, num_groups, num_groups * (GROUP // 2),
                               BLOCK_ROWS, GROUPS_PAD, GROUP // 2)
    s_offs, s_mask = group_offsets(row0, n_rows, num_groups, num_groups, BLOCK_ROWS, GROUPS_PAD, 1)
    packed = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale_byte = tl.load(scales_ptr + s_offs, mask=s_mask, other=0).to(tl.int32)
    if E4M3_SCALE:
        scale = e4m3_decode(scale_byte)
    else:
        scale = e8m0_decode(scale_byte)
    # NOTE: magnitude (3 bits) * scale (<= 4 bits) is exact in fp32, so this matches the twin.
    store_fp32(out_ptr, 2 * offs, e2m1_value(packed & 0xF) * scale, mask, IS_BF16)
    store_fp32(out_ptr, 2 * offs + 1, e2m1_value(packed >> 4) * scale, mask, IS_BF16)


def fp4_quantize(x: torch.Tensor, fmt: Fp4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to FP4 (same contract as ``fp4_ref.fp4_quantize``).

    x: (N, D) float32/bfloat16/float16, contiguous, D a multiple of ``fmt.group`` (a power of two).
    Returns (packed (N, D // 2) uint8 codes, scales (N, D // group) uint8 raw scale bits).
    """
    check_quantize_args(x, fmt)
    check_triton_group(fmt.group)
    n, d = x.shape
    num_groups = d // fmt.group
    packed = torch.empty((n, d // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((n, num_groups), dtype=torch.uint8, device=x.device)
    if n == 0:
        return packed, scales
    groups_pad, block_rows = launch_geometry(n, num_groups, fmt.group, x.is_cuda)
    x_arg, is_bf16 = as_kernel_arg(x)
    _fp4_quantize_kernel[(triton.cdiv(n, block_rows),)](
        x_arg, packed, scales, n, num_groups, fmt.group, groups_pad, block_rows,
        fmt.scale == "e4m3", is_bf16)
    return packed, scales


def fp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, fmt: Fp4Format, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`fp4_quantize` (same contract as ``fp4_ref.fp4_dequantize``).

    packed: (N, D // 2) uint8; scales: (N, D // group) uint8. Returns (N, D) ``dtype``.
    """
    d = check_dequantize_args(packed, scales, fmt, dtype)
    check_triton_group(fmt.group)
    n = packed.shape[0]
    out = torch.empty((n, d), dtype=dtype, device=packed.device)
    if n == 0:
        return out
    num_groups = d // fmt.group
    groups_pad, block_rows = launch_geometry(n, num_groups, fmt.group, packed.is_cuda)
    out_arg, is_bf16 = as_kernel_arg(out)
    _fp4_dequantize_kernel[(triton.cdiv(n, block_rows),)](
        packed, scales, out_arg, n, num_groups, fmt.group, groups_pad, block_rows,
        fmt.scale == "e4m3", is_bf16)
    return out
