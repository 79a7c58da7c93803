"""Sliding-window attention, batched over a :class:`~cedar.kernels.plans.WindowPlan` (the CPU
fast path; same signature and result as ``window_attention_ref``).

NOTE: why C++ first, and batched torch as the fallback: on 2 CPU cores the twin's cost is its
per-request, per-block Python loop (thousands of small torch calls per decode step). Batched over
blocks of queries (``_blocked``), one layer is ~15 torch calls whatever the batch size, but each
pass over the (blocks, Q, H, W - 1 + Q) logits is elementwise work at ~10 us per query row
(measured at 1k-8k rows), and a block reads up to 2x the keys its queries need. The C++ kernel
walks each query's own window (at most W keys) once: dot products, softmax with the sink and
values in one pass (4x faster at 1k-8k rows here). ``torch.compile`` took tens of seconds per
shape here and would recompile for every new batch layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_ext, window_attention_ref
from .plans import RingPlan, WindowBlocks, WindowPlan, row_owners


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
        if cpu_ext.available() and q.device.type == "cpu":  # any ragged layout: each request's keys scanned
            cu = cu_seqlens_k.long()
            rows = row_owners(cu_seqlens_q)
            return torch.ops.cedar_cpu.window_ragged_attention(
                q.float().contiguous(), k.float().contiguous(), k_pos.contiguous(), cu, cu[:-1], rows, q_pos,
                window_floor.long(), None if sink is None else sink.float().contiguous(), -1, window, scale)
        return window_attention_ref.window_attention(q, k, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos,
                                                     window, window_floor, sink, scale)
    if cpu_ext.available() and q.device.type == "cpu":
        return torch.ops.cedar_cpu.window_ragged_attention(
            q.float().contiguous(), k.float().contiguous(), k_pos, plan.cu_k, plan.k_first, plan.row_req, q_pos,
            plan.floor, None if sink is None else sink.float().contiguous(), plan.ring_size, window, scale)
    return _blocked(q, k, k_pos, sink, scale, plan.blocks)


def _blocked(q: Tensor, k: Tensor, k_pos: Tensor, sink: Tensor | None, scale: float,
             plan: WindowBlocks) -> tuple[Tensor, Tensor]:
    """The batched-torch path: a fixed number of calls per layer over query blocks."""
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
    # NOTE: padding slots land in a sink row T: no mask is read back to size a selection
    rows = torch.where(plan.q_index >= 0, plan.q_index, T)
    out, lse = torch.cat([out, out[:1]]), torch.cat([lse, lse[:1]])
    out[rows] = o
    lse[rows] = torch.log(denom) + m
    return out[:T], lse[:T]


