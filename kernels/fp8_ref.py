"""FP8 (E4M3) row codec with E8M0 group scales in pure torch: the reference twin of ``fp8_triton``.

Layout of one row of D values (``Fp8Format(group)``):

- codes: D bytes, raw float8_e4m3fn bits of x / s, clamped to +-448, round to nearest even;
  the sign bit is set iff x < 0 (so -0.0 encodes as 0x00).
- scales: D // group bytes; s = 2**ceil(log2(amax / 448)), computed exactly from frexp(amax),
  exponent clamped to [-127, 127], stored as the biased byte e + 127. An all-zero group gets
  scale byte 0 (2**-127) and codes 0. NOTE: magnitudes >= 1.9375 * 2**127 (near fp32 max)
  round up to 256 * 2**120 = 2**128 and dequantize to inf.

Non-finite rule (as in ``fp4_ref``): a NaN or +-inf anywhere in a group POISONS the group: scale
byte 0xFF (E8M0 NaN), codes 0, and the whole group dequantizes to NaN. A non-finite KV value is a
model bug; it must stay loud, never saturate silently into the cache.
"""

from __future__ import annotations

import torch

from cedar.kernels.formats import Fp8Format, check_dequantize_args, check_quantize_args
from cedar.kernels.fp4_ref import E4M3_MAX, E8M0_NAN, decode_e8m0, e8m0_scale


def fp8_quantize(x: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to FP8.

    x: (N, D) float32/bfloat16/float16, contiguous, D a multiple of ``fmt.group``.
    Returns (codes (N, D) uint8 raw float8_e4m3fn bits, scales (N, D // group) uint8 E8M0).
    """
    check_quantize_args(x, fmt)
    n, d = x.shape
    xg = x.float().reshape(n, d // fmt.group, fmt.group)  # (N, G, group)
    poisoned = ~torch.isfinite(xg).all(dim=-1)  # (N, G)
    xg = torch.where(poisoned[..., None], 0.0, xg)
    amax = xg.abs().amax(dim=-1)
    scale_byte, scale = e8m0_scale(amax, E4M3_MAX)  # (N, G): powers of two
    scale = scale[..., None]
    mag = (xg.abs() / scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = mag | ((xg < 0).to(torch.uint8) << 7)
    codes = torch.where(poisoned[..., None], 0, codes).to(torch.uint8)
    scale_byte = torch.where(poisoned, E8M0_NAN, scale_byte).to(torch.uint8)
    return codes.reshape(n, d), scale_byte


def fp8_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`.

    codes: (N, D) uint8; scales: (N, D // group) uint8. Returns (N, D) ``dtype``;
    a group whose scale byte is 0xFF comes back as NaN.
    """
    d = check_dequantize_args(codes, scales, fmt, dtype)
    n = codes.shape[0]
    values = codes.view(torch.float8_e4m3fn).float().reshape(n, d // fmt.group, fmt.group)
    values = values * decode_e8m0(scales)[..., None]  # NOTE: exact in fp32 (power-of-two scale)
    return values.reshape(n, d).to(dtype)
