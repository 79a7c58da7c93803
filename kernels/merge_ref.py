"""Merging two attention partials by log-sum-exp (pure torch twin).

An attention *partial* over a key set A is ``(out_A, lse_A)``: the softmax-weighted value sum
over A and the log of A's softmax denominator. ``merge_states`` gives the partial over A then B,
so ``merge(attn(A), attn(B)) == attn(A ++ B)``. An empty key set is ``(0, -inf)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """out_*: (T, H, D) float32; lse_*: (T, H) float32 (natural log) -> (out (T, H, D), lse (T, H)).

    Rows where both partials are empty stay ``(0, -inf)``.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:2] != lse_a.shape:
        raise ValueError(f"merge_states: shapes {tuple(out_a.shape)}, {tuple(lse_a.shape)}, "
                         f"{tuple(out_b.shape)}, {tuple(lse_b.shape)} do not match")
    lse = torch.logaddexp(lse_a, lse_b)  # (T, H); -inf where both are empty
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)  # (T, H, 1); 0 for an empty side
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse
