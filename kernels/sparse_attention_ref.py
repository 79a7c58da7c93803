"""Compressed sparse attention over the global KV (pure torch twins of three kernels).

1. ``indexer_scores``: the lightning indexer. Score of entry ``c`` for query ``i`` is
   ``sum_h w[i, h] * relu(q_idx[i, h] . k_idx[c])``; entries not yet complete at the query's
   position (``c_pos[c] > q_pos[i]``) score ``-inf``.
2. ``topk_select``: the ``k`` best entries per query, best first, ties to the lower entry id;
   ``-1`` pads where fewer than ``k`` entries are visible ("top-k larger than the candidates").
   ``indexer_topk`` is 1 then 2 (the fast CPU kernel fuses them, never holding (T, C) scores).
3. ``sparse_attention``: attention of each query over its selected entries (K = V), returning a
   partial ``(out, lse)`` to merge with the window partial.

Entries are request-local: request b's entries are rows ``cu_seqlens_c[b]:[b+1]`` of the entry
tensors, and entry ids in scores / indices count from that request's first row.
"""

from __future__ import annotations

import torch
from torch import Tensor

Q_BLOCK = 512


def indexer_scores(q_idx: Tensor, w_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor,
                   cu_seqlens_c: Tensor, q_pos: Tensor, c_pos: Tensor, plan=None) -> Tensor:
    """q_idx: (T, Hi, Di) f32; w_idx: (T, Hi) f32; k_idx: (Nc, Di) f32 dequantized index keys;
    cu_seqlens_q, cu_seqlens_c: (B+1,) int; q_pos: (T,) int64; c_pos: (Nc,) int64, the position
    at which each entry becomes visible (its group's last token).
    Returns scores (T, C) float32 with C = the largest per-request entry count (at least 1)."""
    if q_idx.dim() != 3 or k_idx.dim() != 2 or q_idx.shape[-1] != k_idx.shape[-1]:
        raise ValueError(f"indexer_scores: q_idx (T, Hi, Di), k_idx (Nc, Di) expected, "
                         f"got {tuple(q_idx.shape)}, {tuple(k_idx.shape)}")
    if w_idx.shape != q_idx.shape[:2] or c_pos.shape != (k_idx.shape[0],):
        raise ValueError("indexer_scores: w_idx must be (T, Hi) and c_pos (Nc,)")
    cq, cc = cu_seqlens_q.tolist(), cu_seqlens_c.tolist()
    C = max([cc[b + 1] - cc[b] for b in range(len(cc) - 1)] + [1])
    scores = torch.full((q_idx.shape[0], C), float("-inf"), dtype=torch.float32, device=q_idx.device)
    for b in range(len(cq) - 1):
        kb, pb = k_idx[cc[b]:cc[b + 1]].float(), c_pos[cc[b]:cc[b + 1]]
        n = kb.shape[0]
        for s in range(cq[b], cq[b + 1], Q_BLOCK):
            e = min(s + Q_BLOCK, cq[b + 1])
            dots = torch.relu(torch.einsum("thd,nd->thn", q_idx[s:e].float(), kb))  # (t, Hi, n)
            sc = torch.einsum("thn,th->tn", dots, w_idx[s:e].float())  # (t, n)
            visible = pb[None, :] <= q_pos[s:e, None]
            scores[s:e, :n] = sc.masked_fill(~visible, float("-inf"))
    return scores


def topk_select(scores: Tensor, k: int) -> Tensor:
    """scores: (T, C) float32 (-inf = not a candidate) -> indices (T, k) int32, -1 padded."""
    if scores.dim() != 2 or k < 0:
        raise ValueError(f"topk_select: scores (T, C) and k >= 0 expected, got {tuple(scores.shape)}, {k}")
    T, C = scores.shape
    # NOTE: NaN / +inf are not candidates (the kernel agrees); -inf marks "not visible".
    scores = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("-inf")))
    # NOTE: a stable descending sort defines ties (lower id first) so kernels can match exactly.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(k, C)]
    valid = torch.isfinite(torch.gather(scores, 1, order))
    idx = torch.where(valid, order, torch.full_like(order, -1)).to(torch.int32)
    if k > C:
        idx = torch.cat([idx, torch.full((T, k - C), -1, dtype=torch.int32, device=scores.device)], 1)
    return idx


def indexer_topk(q_idx: Tensor, w_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor, cu_seqlens_c: Tensor,
                 q_pos: Tensor, c_pos: Tensor, k: int, plan=None) -> Tensor:
    """``topk_select(indexer_scores(...), k)``: (T, k) int32 request-local entry ids, best first."""
    return topk_select(indexer_scores(q_idx, w_idx, k_idx, cu_seqlens_q, cu_seqlens_c, q_pos, c_pos), k)


def sparse_attention(q: Tensor, entries: Tensor, cu_seqlens_q: Tensor, cu_seqlens_c: Tensor,
                     indices: Tensor, scale: float, plan=None) -> tuple[Tensor, Tensor]:
    """q: (T, H, D) f32; entries: (Nc, D) f32 dequantized global KV (K = V);
    indices: (T, k) int32 request-local entry ids, -1 = none.
    Returns out (T, H, D) f32 and lse (T, H) f32; a query with no entry gets (0, -inf)."""
    if q.dim() != 3 or entries.dim() != 2 or q.shape[-1] != entries.shape[-1]:
        raise ValueError(f"sparse_attention: q (T, H, D), entries (Nc, D) expected, "
                         f"got {tuple(q.shape)}, {tuple(entries.shape)}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError("sparse_attention: indices must be (T, k)")
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if indices.shape[1] == 0 or entries.shape[0] == 0:
        return out, lse
    cq, cc = cu_seqlens_q.tolist(), cu_seqlens_c.tolist()
    base = torch.zeros(T, dtype=torch.long, device=q.device)
    count = torch.zeros(T, dtype=torch.long, device=q.device)
    for b in range(len(cq) - 1):
        base[cq[b]:cq[b + 1]] = cc[b]
        count[cq[b]:cq[b + 1]] = cc[b + 1] - cc[b]
    valid = (indices >= 0) & (indices.long() < count[:, None])  # (T, k); ids past a request's entries are ignored
    rows = torch.where(valid, indices.long() + base[:, None], torch.zeros_like(indices, dtype=torch.long))
    kv = entries.float()[rows]  # (T, k, D)
    logits = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - m)
    denom = p.sum(-1)  # (T, H)
    o = torch.einsum("thk,tkd->thd", p, kv) / denom.clamp_min(1e-30)[..., None]
    out = torch.where(denom[..., None] > 0, o, out)
    lse = torch.log(denom) + m.squeeze(-1)
    return out, lse
