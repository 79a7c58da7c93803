"""Sliding-window attention over a K = V latent cache with a replay floor and an attention sink
(pure torch twin; the Triton kernel in ``window_attention_triton.py`` has the same signature).

Key ``j`` is visible to query ``i`` of request ``b`` iff
``max(window_floor[b], q_pos[i] - window + 1) <= k_pos[j] <= q_pos[i]``. Keys may be stored in
any order (a ring); a key with ``k_pos < 0`` is an empty slot and never visible. The sink is one
extra logit per head with no value: it adds ``exp(sink[h])`` to the softmax denominator, and the
returned ``lse`` includes it, so the result merges with other partials by ``merge_states``.
"""

from __future__ import annotations

import torch
from torch import Tensor

Q_BLOCK = 256  # query rows per block: bounds the (block, keys) score tile on long extends


def _validate(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, q_pos: Tensor,
              k_pos: Tensor, window_floor: Tensor, sink: Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"window_attention: q (T, H, D) and k (N, D) expected, got {tuple(q.shape)}, {tuple(k.shape)}")
    num_reqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != num_reqs + 1 or window_floor.numel() != num_reqs:
        raise ValueError("window_attention: cu_seqlens_q/k and window_floor disagree on the number of requests")
    if q_pos.shape != (q.shape[0],) or k_pos.shape != (k.shape[0],):
        raise ValueError("window_attention: q_pos (T,) and k_pos (N,) must match q and k")
    if sink is not None and sink.shape != (q.shape[1],):
        raise ValueError(f"window_attention: sink must be (H,), got {tuple(sink.shape)}")


def window_attention(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, q_pos: Tensor,
                     k_pos: Tensor, window: int, window_floor: Tensor, sink: Tensor | None,
                     scale: float, plan=None) -> tuple[Tensor, Tensor]:
    """Ragged batch of requests; K = V. ``plan`` (a ``plans.WindowPlan``, read by the batched
    CPU path) is ignored: the twin derives everything from the ragged layout.

    q: (T, H, D) float32, the queries of all requests, request b in rows cu_seqlens_q[b]:[b+1].
    k: (N, D) float32 dequantized window keys (= values), request b in rows cu_seqlens_k[b]:[b+1].
    cu_seqlens_q, cu_seqlens_k: (B + 1,) int; q_pos: (T,) int64; k_pos: (N,) int64 (-1 = empty).
    window: int (W); window_floor: (B,) int64, the lowest readable key position per request.
    sink: (H,) float32 or None. scale: softmax scale.
    Returns out (T, H, D) float32 and lse (T, H) float32 (-inf where nothing, not even a sink, is seen).
    """
    _validate(q, k, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, window_floor, sink)
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        kb, kpb = k[ck[b]:ck[b + 1]].float(), k_pos[ck[b]:ck[b + 1]]
        floor = int(window_floor[b])
        for s in range(cq[b], cq[b + 1], Q_BLOCK):
            e = min(s + Q_BLOCK, cq[b + 1])
            qp = q_pos[s:e]
            # NOTE: restrict to keys that any query of the block can see, then mask exactly.
            near = (kpb >= max(floor, 0, int(qp.min()) - window + 1)) & (kpb <= int(qp.max()))
            kk, kp = kb[near], kpb[near]  # (n, D), (n,)
            lo = torch.clamp(qp - window + 1, min=max(floor, 0))  # (t,); NOTE: empty slots are -1
            vis = (kp[None, :] >= lo[:, None]) & (kp[None, :] <= qp[:, None])  # (t, n)
            logits = torch.einsum("thd,nd->thn", q[s:e].float(), kk) * scale  # (t, H, n)
            logits = logits.masked_fill(~vis[:, None, :], float("-inf"))
            if sink is not None:
                logits = torch.cat([logits, sink.float()[None, :, None].expand(e - s, H, 1)], dim=-1)
            if logits.shape[-1] == 0:  # no key near the block and no sink: an empty partial
                continue
            m = logits.amax(dim=-1, keepdim=True)  # (t, H, 1)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(logits - m)
            denom = p.sum(dim=-1)  # (t, H)
            pv = p[..., : kk.shape[0]]
            o = torch.einsum("thn,nd->thd", pv, kk) / denom.clamp_min(1e-30)[..., None]
            out[s:e] = torch.where(denom[..., None] > 0, o, torch.zeros_like(o))
            lse[s:e] = torch.log(denom) + m.squeeze(-1)
    return out, lse
