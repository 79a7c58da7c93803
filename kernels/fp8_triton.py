"""FP8 (E4M3) row codec with E8M0 group scales in Triton; bit-exact twin of ``fp8_ref``.

Also home of the scalar-format helpers that ``fp4_triton`` shares (E4M3 and E8M0 encode/decode).

NOTE: E4M3 is encoded and decoded with integer/float arithmetic, never ``.to(tl.float8e4nv)``:
the Triton interpreter's fp8 cast rounds ties away from zero, truncates subnormals and does not
saturate (notes/triton-cpu.md), and the twins must agree bit for bit on CPU and GPU alike.
Divisions use ``tl.math.div_rn``: plain ``/`` is approximate (2 ulp) on NVIDIA GPUs.
bfloat16 tensors travel as their int16 bits for the same reason: the interpreter's bf16 <-> fp32
casts truncate and mangle subnormals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cedar.kernels.formats import Fp8Format, check_dequantize_args, check_quantize_args

E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)  # fp32 quiet NaN


@triton.jit
def e4m3_encode(a):
    """fp32 a in [0, 448] (finite) -> int32 E4M3 byte, round to nearest even (subnormals too)."""
    bits = a.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127  # NOTE: fp32 zero/subnormal give -127 and round to 0 below
    sig = (bits & 0x7FFFFF) | 0x800000
    e = tl.maximum(exp, -6)  # E4M3 subnormals share the quantum 2**-9 of exponent -6
    shift = tl.minimum(20 + e - exp, 25)  # keep 3 fraction bits below the E4M3 leading bit
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    # NOTE: a carry (q == 16) lands on the next exponent's code, so no special case is needed.
    return (e + 6) * 8 + q


@triton.jit
def e4m3_decode(byte):
    """int32 E4M3 byte (0..255) -> fp32 value; 0x7F / 0xFF -> NaN."""
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((byte & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((byte & 0x80) != 0, -mag, mag)


@triton.jit
def e8m0_exponent(amax, CODE_EXP: tl.constexpr, CODE_MANT_BITS: tl.constexpr):
    """ceil(log2(amax / max_code)) clamped to [-127, 127], exactly, for finite fp32 amax >= 0.

    max_code = m * 2**CODE_EXP with m in [0.5, 1) and CODE_MANT_BITS = (2m - 1) * 2**23 (the
    fp32 mantissa field of 2m); mirrors ``fp4_ref.e8m0_scale``.
    """
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # NOTE: amax = (0.5 * 1.f) * 2**(biased - 126); zero and fp32 subnormals land below -127.
    e = biased - 126 - CODE_EXP + ((bits & 0x7FFFFF) > CODE_MANT_BITS).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def e8m0_decode(byte):
    """int32 biased exponent byte -> fp32 2**(byte - 127); 0xFF -> NaN."""
    bits = tl.where(byte == 0, 0x400000, byte << 23)  # 2**-127 is an fp32 subnormal
    bits = tl.where(byte == 255, NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_fp32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load as fp32; with IS_BF16, ``ptr`` holds bfloat16 bits as int16 and is widened exactly."""
    if IS_BF16:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_fp32(ptr, offs, values, mask, IS_BF16: tl.constexpr):
    """Store fp32 values; with IS_BF16, as bfloat16 bits (int16), round to nearest even."""
    if IS_BF16:
        bits = values.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(values != values, 0x7FC0, bits)
        tl.store(ptr + offs, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, values.to(ptr.dtype.element_ty), mask=mask)


def as_kernel_arg(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor to pass, IS_BF16): bfloat16 tensors are passed as their int16 bits."""
    is_bf16 = t.dtype == torch.bfloat16
    return (t.view(torch.int16) if is_bf16 else t), is_bf16


@triton.jit
def group_offsets(row0, n_rows, num_groups, row_stride,
                  BLOCK_ROWS: tl.constexpr, GROUPS_PAD: tl.constexpr, WIDTH: tl.constexpr):
    """(BLOCK_ROWS, GROUPS_PAD, WIDTH) element offsets of a block of rows, and its mask."""
    rows = (row0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None, None]
    groups = tl.arange(0, GROUPS_PAD)[None, :, None]
    offs = rows * row_stride + groups * WIDTH + tl.arange(0, WIDTH)[None, None, :]
    mask = (rows < n_rows) & (groups < num_groups)
    return offs, mask


@triton.jit
def _fp8_quantize_kernel(x_ptr, codes_ptr, scales_ptr, n_rows, num_groups,
                         GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         IS_BF16: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_ROWS
    offs, mask = group_offsets(row0, n_rows, num_groups, num_groups * GROUP,
                               BLOCK_ROWS, GROUPS_PAD, GROUP)
    x = load_fp32(x_ptr, offs, mask, IS_BF16)  # (R, G, GROUP)
    finite = (x == x) & (tl.abs(x) != float("inf"))
    poisoned = tl.max((~finite).to(tl.int32), axis=2) > 0  # (R, G)
    x = tl.where(finite, x, 0.0)
    e = e8m0_exponent(tl.max(tl.abs(x), axis=2), 9, 0x600000)  # 448 = 0.875 * 2**9
    scale = e8m0_decode(e + 127)[:, :, None]
    y = tl.minimum(tl.math.div_rn(tl.abs(x), scale), E4M3_MAX)
    codes = e4m3_encode(y) | ((x < 0).to(tl.int32) << 7)
    codes = tl.where(poisoned[:, :, None], 0, codes)
    tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)
    s_offs, s_mask = group_offsets(row0, n_rows, num_groups, num_groups, BLOCK_ROWS, GROUPS_PAD, 1)
    scale_byte = tl.where(poisoned, 255, e + 127)[:, :, None]
    tl.store(scales_ptr + s_offs, scale_byte.to(tl.uint8), mask=s_mask)


@triton.jit
def _fp8_dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, num_groups,
                           GROUP: tl.constexpr, GROUPS_PAD: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, IS_BF16: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_ROWS
    offs, mask = group_offsets(row0, n_rows, num_groups, num_groups * GROUP,
                               BLOCK_ROWS, GROUPS_PAD, GROUP)
    s_offs, s_mask = group_offsets(row0, n_rows, num_groups, num_groups, BLOCK_ROWS, GROUPS_PAD, 1)
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = e8m0_decode(tl.load(scales_ptr + s_offs, mask=s_mask, other=0).to(tl.int32))
    values = e4m3_decode(codes) * scale  # NOTE: exact in fp32 (power-of-two scale)
    store_fp32(out_ptr, offs, values, mask, IS_BF16)


def launch_geometry(n_rows: int, num_groups: int, group: int, on_gpu: bool) -> tuple[int, int]:
    """(GROUPS_PAD, BLOCK_ROWS) for a row codec launch.

    NOTE: the CPU interpreter costs ~12 ms per program instance whatever its size, so CPU
    launches take large blocks of rows; on a GPU ~4K elements per program keeps registers low.
    """
    groups_pad = triton.next_power_of_2(num_groups)
    target = 4096 if on_gpu else 1 << 16
    block_rows = max(1, min(triton.next_power_of_2(n_rows), target // (groups_pad * group)))
    return groups_pad, block_rows


def check_triton_group(group: int) -> None:
    if group & (group - 1):
        raise ValueError(f"Triton codecs need a power-of-two group (tl.arange), got {group}")


def fp8_quantize(x: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to FP8 (same contract as ``fp8_ref.fp8_quantize``).

    x: (N, D) float32/bfloat16/float16, contiguous, D a multiple of ``fmt.group``.
    Returns (codes (N, D) uint8 raw float8_e4m3fn bits, scales (N, D // group) uint8 E8M0).
    """
    check_quantize_args(x, fmt)
    check_triton_group(fmt.group)
    n, d = x.shape
    num_groups = d // fmt.group
    codes = torch.empty((n, d), dtype=torch.uint8, device=x.device)
    scales = torch.empty((n, num_groups), dtype=torch.uint8, device=x.device)
    if n == 0:
        return codes, scales
    groups_pad, block_rows = launch_geometry(n, num_groups, fmt.group, x.is_cuda)
    x_arg, is_bf16 = as_kernel_arg(x)
    _fp8_quantize_kernel[(triton.cdiv(n, block_rows),)](
        x_arg, codes, scales, n, num_groups, fmt.group, groups_pad, block_rows, is_bf16)
    return codes, scales


def fp8_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize` (same contract as ``fp8_ref.fp8_dequantize``).

    codes: (N, D) uint8; scales: (N, D // group) uint8. Returns (N, D) ``dtype``.
    """
    d = check_dequantize_args(codes, scales, fmt, dtype)
    check_triton_group(fmt.group)
    n = codes.shape[0]
    out = torch.empty((n, d), dtype=dtype, device=codes.device)
    if n == 0:
        return out
    num_groups = d // fmt.group
    groups_pad, block_rows = launch_geometry(n, num_groups, fmt.group, codes.is_cuda)
    out_arg, is_bf16 = as_kernel_arg(out)
    _fp8_dequantize_kernel[(triton.cdiv(n, block_rows),)](
        codes, scales, out_arg, n, num_groups, fmt.group, groups_pad, block_rows, is_bf16)
    return out
