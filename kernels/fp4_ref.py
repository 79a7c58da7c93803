"""FP4 (E2M1) row codec in pure torch: the reference twin of ``fp4_triton``.

Layout of one row of D values (``Fp4Format(group, scale)``):

- codes: D // 2 bytes; element 2j in the LOW nibble of byte j, element 2j+1 in the HIGH nibble.
  A nibble is sign (bit 3) | magnitude code (bits 0-2), magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
- scales: D // group bytes, one per group of consecutive values:
  - "e4m3": s = amax / 6, clamped to <= 448, rounded to nearest even E4M3 (raw float8_e4m3fn bits).
    A nonzero group whose scale rounds to 0 (amax / 6 <= 2**-10) flushes to zero: scale byte 0,
    all codes 0.
  - "e8m0": s = 2**ceil(log2(amax / 6)), computed exactly from frexp(amax), exponent clamped to
    [-127, 127], stored as the biased byte e + 127 (so byte 0 means 2**-127). NOTE: magnitudes
    >= 1.75 * 2**127 (near fp32 max) round up to 4 * 2**126 = 2**128 and dequantize to inf.

Values: code = nearest E2M1 magnitude of |x| / s (s the decoded scale), ties to the even code,
saturating at 6; the sign bit is set iff x < 0 (so -0.0 encodes as code 0). An all-zero group
gets scale byte 0 and codes 0.

Non-finite rule: a NaN or +-inf anywhere in a group POISONS the group: its scale byte is the
scale format's NaN code (E4M3 0x7F, E8M0 0xFF), its codes are 0, and it dequantizes to NaN.
A non-finite KV value is a model bug; it must stay loud, never saturate silently into the cache.
"""

from __future__ import annotations

import math
import struct

import torch

from cedar.kernels.formats import Fp4Format, check_dequantize_args, check_quantize_args

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF


def fp4_quantize(x: torch.Tensor, fmt: Fp4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to FP4.

    x: (N, D) float32/bfloat16/float16, contiguous, D a multiple of ``fmt.group``.
    Returns (packed (N, D // 2) uint8, scales (N, D // group) uint8 raw scale bits).
    """
    check_quantize_args(x, fmt)
    n, d = x.shape
    xg = x.float().reshape(n, d // fmt.group, fmt.group)  # (N, G, group)
    poisoned = ~torch.isfinite(xg).all(dim=-1)  # (N, G)
    xg = torch.where(poisoned[..., None], 0.0, xg)
    amax = xg.abs().amax(dim=-1)  # (N, G)
    if fmt.scale == "e4m3":
        scale_byte, scale = _e4m3_scale(amax)
    else:
        scale_byte, scale = e8m0_scale(amax, E2M1_MAGNITUDES[-1])
    codes = e2m1_codes(xg, scale[..., None])  # (N, G, group) uint8 in [0, 16)
    codes = torch.where(poisoned[..., None], 0, codes).reshape(n, d)
    nan_byte = E4M3_NAN if fmt.scale == "e4m3" else E8M0_NAN
    scale_byte = torch.where(poisoned, nan_byte, scale_byte).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale_byte


def fp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, fmt: Fp4Format, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`fp4_quantize`.

    packed: (N, D // 2) uint8; scales: (N, D // group) uint8. Returns (N, D) ``dtype``;
    a group whose scale byte is NaN comes back as NaN.
    """
    d = check_dequantize_args(packed, scales, fmt, dtype)
    n = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, d).long()
    lut = torch.tensor(E2M1_MAGNITUDES, device=packed.device)
    values = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = decode_e4m3(scales) if fmt.scale == "e4m3" else decode_e8m0(scales)
    values = values.reshape(n, d // fmt.group, fmt.group) * scale[..., None]  # NOTE: exact in fp32
    return values.reshape(n, d).to(dtype)


def e2m1_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (uint8) of x / scale for finite x; a zero scale flushes the codes to 0."""
    y = torch.where(scale > 0, x.abs() / scale, 0.0)
    # NOTE: '>' where the upper code is odd, '>=' where it is even: ties go to the even code.
    mag = (
        (y > 0.25).to(torch.uint8) + (y >= 0.75) + (y > 1.25) + (y >= 1.75)
        + (y > 2.5) + (y >= 3.5) + (y > 5.0)
    )
    sign = ((x < 0) & (scale > 0)).to(torch.uint8)
    return mag | (sign << 3)


def _e4m3_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw E4M3 byte, decoded fp32 scale) of amax / 6, round to nearest even."""
    # NOTE: fp32 division then RNE to 4 significant bits equals exact RNE of amax / 6 (the
    # neighbours of 6 * midpoint are >= 2/3 fp32 ulp of the quotient away), so no double rounding.
    scale = (amax / 6.0).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return scale.view(torch.uint8), scale.float()


def e8m0_scale(amax: torch.Tensor, max_code: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(biased E8M0 byte, decoded fp32 scale) of 2**ceil(log2(amax / max_code)), exactly.

    amax: finite fp32 >= 0; max_code: the largest code magnitude (6 for E2M1, 448 for E4M3).
    """
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    code_mant, code_exp = _frexp_scalar(max_code)  # e.g. 6 = 0.75 * 2**3
    # NOTE: no division: amax / max_code <= 2**(exp - code_exp) exactly when mant <= code_mant.
    e = exp - code_exp + (mant > code_mant).int()
    e = torch.where(amax > 0, e, -127).clamp(-127, 127)
    return (e + 127).to(torch.uint8), torch.ldexp(torch.ones_like(amax), e)


def _frexp_scalar(v: float) -> tuple[float, int]:
    """frexp of v rounded to float32, on the host (NOTE: no tensor read back in a forward)."""
    return math.frexp(struct.unpack("f", struct.pack("f", v))[0])


def decode_e4m3(scales: torch.Tensor) -> torch.Tensor:
    """uint8 raw float8_e4m3fn bits -> fp32 (0x7F / 0xFF -> NaN)."""
    return scales.view(torch.float8_e4m3fn).float()


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> fp32 2**(b - 127) (0xFF -> NaN)."""
    e = scales.int() - 127
    ones = torch.ones(scales.shape, device=scales.device)
    return torch.where(scales == E8M0_NAN, float("nan"), torch.ldexp(ones, e))
