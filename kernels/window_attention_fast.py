"""Sliding-window attention, batched over a :class:`~cedar.kernels.plans.WindowPlan` (the CPU
fast path; same signature and result as ``window_attention_ref``).

NOTE: why vectorised torch and not a compiled kernel: on 2 CPU cores the twin's cost is the
per-request, per-block Python loop (thousands of small torch calls per decode step), not the
arithmetic. With the plan, one layer is ~15 torch calls whatever the batch size: a gather of each
block's queries and keys, one batched matmul for the logits, the mask, the softmax with the sink
and one batched matmul for the values. ``torch.compile`` took tens of seconds per shape here and
would recompile for every new batch layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import window_attention_ref
from .plans import RingPlan, WindowPlan


def window_attention(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, q_pos: Tensor,
                     k_pos: Tensor, window: int, window_floor: Tensor, sink: Tensor | None,
                     scale: float, plan: WindowPlan | RingPlan | None = None) -> tuple[Tensor, Tensor]:
    """As ``window_attention_ref.window_attention``; ``plan`` describes where each block's keys
    sit in ``k`` (without one, the twin runs), or, a :class:`RingPlan`, the rings the C++ kernel
    reads in place (``k`` / ``k_pos`` unused). Returns out (T, H, D) f32, lse (T, H) f32."""
    if isinstance(plan, RingPlan):
        floor = window_floor.long()[plan.row_req]
        return torch.ops.cedar_cpu.window_ring_attention(
            q.contiguous(), plan.codes, plan.scales, plan.ring_pos, plan.slot, q_pos, floor,
            None if sink is None else sink.float().contiguous(), window, scale)
    if plan is None:
        return window_attention_ref.window_attention(q, k, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
                                                     window, window_floor, sink, scale)
    T, H, D = q.shape
    nb, Q = plan.q_index.shape
    K = plan.k_index.shape[1]
    out = q.new_zeros(T, H, D)
    lse = q.new_full((T, H), float("-inf"))
    if nb == 0:
        return out, lse
    ok = plan.k_ok & (k_pos[plan.k_index] == plan.k_expect)  # (nb, K): the ring holds the position
    qb = q[plan.q_index.clamp_min(0)].float().reshape(nb, Q * H, D)  # (nb, Q*H, D)
    kb = k[plan.k_index].float()  # (nb, K, D)
    logits = torch.bmm(qb, kb.transpose(1, 2)).view(nb, Q, H, K) * scale
    vis = (plan.band[None] & ok[:, None, :])[:, :, None, :]  # (nb, Q, 1, K)
    logits = logits.masked_fill(~vis, float("-inf"))
    m = logits.amax(dim=-1)  # (nb, Q, H)
    if sink is not None:
        m = torch.maximum(m, sink.float()[None, None, :])
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - m[..., None])  # (nb, Q, H, K)
    denom = p.sum(-1)
    if sink is not None:
        denom = denom + torch.exp(sink.float()[None, None, :] - m)
    o = torch.bmm(p.view(nb, Q * H, K), kb).view(nb, Q, H, D) / denom.clamp_min(1e-30)[..., None]
    o = torch.where(denom[..., None] > 0, o, torch.zeros_like(o))
    valid = plan.q_index >= 0
    rows = plan.q_index[valid]
    out[rows] = o[valid]
    lse[rows] = (torch.log(denom) + m)[valid]
    return out, lse

