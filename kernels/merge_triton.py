"""Merging two attention partials by log-sum-exp in Triton (twin: ``merge_ref.merge_states``).

``merge(attn(A), attn(B)) == attn(A ++ B)``; an empty key set is ``(0, -inf)`` and two empty
partials stay ``(0, -inf)``. One program handles a block of (row, head) pairs x all of D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _merge_states_kernel(out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
                         num_pairs, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (R,) flattened (row, head)
    r = r.to(tl.int64)
    r_ok = r < num_pairs
    d = tl.arange(0, BLOCK_D)
    offs = r[:, None] * head_dim + d[None, :]
    mask = r_ok[:, None] & (d < head_dim)[None, :]
    lse_a = tl.load(lse_a_ptr + r, mask=r_ok, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + r, mask=r_ok, other=float("-inf"))
    hi = tl.maximum(lse_a, lse_b)
    hi_safe = tl.where(hi == float("-inf"), 0.0, hi)  # NOTE: both empty: no (-inf) - (-inf)
    # logaddexp as torch does it: max + log1p(exp(-|a - b|)), -inf when both sides are empty
    lse = tl.where(hi == float("-inf"), float("-inf"),
                   hi_safe + tl.log(1.0 + tl.exp(tl.minimum(lse_a, lse_b) - hi_safe)))
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    w_a = tl.exp(lse_a - lse_safe)  # (R,) 0 for an empty side
    w_b = tl.exp(lse_b - lse_safe)
    out_a = tl.load(out_a_ptr + offs, mask=mask, other=0.0)
    out_b = tl.load(out_b_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, out_a * w_a[:, None] + out_b * w_b[:, None], mask=mask)
    tl.store(lse_ptr + r, lse, mask=r_ok)


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """out_a, out_b: (T, H, D) float32; lse_a, lse_b: (T, H) float32 (natural log), contiguous.

    Returns (out (T, H, D) float32, lse (T, H) float32), the partial over A then B
    (same contract as ``merge_ref.merge_states``).
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.dim() != 3 \
            or out_a.shape[:2] != lse_a.shape:
        raise ValueError(f"merge_states: shapes {tuple(out_a.shape)}, {tuple(lse_a.shape)}, "
                         f"{tuple(out_b.shape)}, {tuple(lse_b.shape)} do not match")
    tensors = (out_a, lse_a, out_b, lse_b)
    if any(x.dtype != torch.float32 for x in tensors):
        raise ValueError(f"merge_states: float32 expected, got {[str(x.dtype) for x in tensors]}")
    if any(x.device != out_a.device for x in tensors) or not all(x.is_contiguous() for x in tensors):
        raise ValueError("merge_states: all tensors must be contiguous and on one device")
    T, H, D = out_a.shape
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if T * H == 0:
        return out, lse
    block_d = triton.next_power_of_2(D)
    target = 4096 if out_a.is_cuda else 1 << 18  # NOTE: few big programs on the CPU interpreter
    block_r = max(1, min(triton.next_power_of_2(T * H), target // block_d))
    _merge_states_kernel[(triton.cdiv(T * H, block_r),)](
        out_a, lse_a, out_b, lse_b, out, lse, T * H, D, BLOCK_R=block_r, BLOCK_D=block_d)
    return out, lse
