"""Compressed sparse attention, batched over a :class:`~cedar.kernels.plans.GlobalPlan` (the
CPU fast path of ``sparse_attention_ref``: same signatures, same results).

- ``indexer_scores``: every request's queries against its own index keys in one batched matmul
  over the per-request padding (queries in tiles of ``Q_TILE`` rows bound the (B, t, Hi, C)
  intermediate on long prefills).
- ``topk_select``: the C++ partial sort where built; else ``torch.topk`` then the twin's tie rule
  made exact: every entry above the k-th value, then the lowest ids among those equal to it,
  ordered best first, ties to the lower id (a full stable sort of every row, the twin's way,
  costs C log C per row).
- ``sparse_attention``: one gather of the selected entries, as the twin, without its loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_ext, sparse_attention_ref
from .plans import GlobalPlan, PoolPlan, row_owners

Q_TILE = 256


def indexer_scores(q_idx: Tensor, w_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor,
                   cu_seqlens_c: Tensor, q_pos: Tensor, c_pos: Tensor,
                   plan: GlobalPlan | None = None) -> Tensor:
    """As the twin: (T, C) float32 scores, C = the largest per-request entry count (>= 1).
    (The served path calls ``indexer_topk``, which never builds this matrix on the C++ path.)"""
    if not isinstance(plan, GlobalPlan):
        return sparse_attention_ref.indexer_scores(q_idx, w_idx, k_idx, cu_seqlens_q, cu_seqlens_c, q_pos, c_pos)
    T, Hi, Di = q_idx.shape
    B, C = plan.c_index.shape
    scores = q_idx.new_full((T + 1, C), float("-inf"))  # NOTE: row T is the padding slots' sink
    keys = k_idx[plan.c_index].float().transpose(1, 2)  # (B, Di, C)
    cpos = torch.where(plan.c_valid, c_pos[plan.c_index], torch.iinfo(torch.long).max)  # (B, C)
    for s in range(0, plan.q_index.shape[1], Q_TILE):
        qi = plan.q_index[:, s:s + Q_TILE]  # (B, t)
        t = qi.shape[1]
        rows = qi.clamp_min(0)
        dots = torch.relu(torch.bmm(q_idx[rows].float().reshape(B, t * Hi, Di), keys)).view(B, t, Hi, C)
        sc = torch.einsum("bthc,bth->btc", dots, w_idx[rows].float())
        sc = sc.masked_fill(cpos[:, None, :] > q_pos[rows][:, :, None], float("-inf"))
        scores[torch.where(qi >= 0, qi, T)] = sc
    return scores[:T]


def topk_select(scores: Tensor, k: int) -> Tensor:
    """As the twin: (T, C) float32 -> (T, k) int32 best first, ties to the lower id, -1 padded."""
    if scores.dim() != 2 or k < 0:
        raise ValueError(f"topk_select: scores (T, C) and k >= 0 expected, got {tuple(scores.shape)}, {k}")
    if cpu_ext.available() and scores.device.type == "cpu":
        return torch.ops.cedar_cpu.topk_exact(scores.float().contiguous(), k)
    return topk_select_torch(scores, k)


def topk_select_torch(scores: Tensor, k: int) -> Tensor:
    """``topk_select`` in batched torch (where the C++ kernels are not built)."""
    T, C = scores.shape
    kk = min(k, C)
    if T == 0 or kk == 0:
        return torch.full((T, k), -1, dtype=torch.int32, device=scores.device)
    s = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("-inf")))
    kth = torch.topk(s, kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (T, 1)
    above, tied = s > kth, (s == kth) & torch.isfinite(s)
    need = kk - above.sum(-1, keepdim=True)
    take = above | (tied & (torch.cumsum(tied.int(), -1) <= need))  # (T, C): the chosen ids
    rank = torch.cumsum(take.int(), -1) - 1
    ids = torch.arange(C, device=s.device).expand(T, C)
    chosen = torch.full((T, kk + 1), C, dtype=torch.long, device=s.device)  # column kk: discard
    chosen.scatter_(1, torch.where(take, rank, kk), ids)
    chosen = chosen[:, :kk]  # ascending ids, C where fewer than kk are finite
    vals = torch.gather(s, 1, chosen.clamp_max(C - 1)).masked_fill(chosen == C, float("-inf"))
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # NOTE: ties keep id order
    chosen = torch.gather(chosen, 1, order)
    idx = torch.where(chosen < C, chosen, -1).to(torch.int32)
    if k > C:
        idx = torch.cat([idx, torch.full((T, k - C), -1, dtype=torch.int32, device=s.device)], 1)
    return idx


def indexer_topk(q_idx: Tensor, w_idx: Tensor, k_idx: Tensor | None, cu_seqlens_q: Tensor,
                 cu_seqlens_c: Tensor, q_pos: Tensor, c_pos: Tensor, k: int,
                 plan: GlobalPlan | PoolPlan | None = None) -> Tensor:
    """As the twin; with a :class:`PoolPlan` the C++ kernel scores a request's rows a few at a
    time over its visible entries (index keys from ``k_idx`` when given, else dequantized from the
    pool in place) and keeps each row's k best: no (T, C) score matrix (8k x 4k floats on an 8k
    prompt), only one row group's scores at a time."""
    if isinstance(plan, PoolPlan):
        return torch.ops.cedar_cpu.indexer_topk(
            q_idx.float().contiguous(), w_idx.float().contiguous(),
            None if k_idx is None else k_idx.float().contiguous(), plan.index_rows, plan.index_scales,
            plan.entry_rows, plan.cu_c, plan.row_req, q_pos, c_pos, k)
    if cpu_ext.available() and q_idx.device.type == "cpu" and plan is None:  # float keys, any layout
        none = torch.zeros(1, 1, dtype=torch.uint8)
        return torch.ops.cedar_cpu.indexer_topk(
            q_idx.float().contiguous(), w_idx.float().contiguous(), k_idx.float().contiguous(), none, none,
            c_pos, cu_seqlens_c.long(), row_owners(cu_seqlens_q), q_pos, c_pos, k)
    return topk_select(indexer_scores(q_idx, w_idx, k_idx, cu_seqlens_q, cu_seqlens_c, q_pos, c_pos, plan=plan), k)


def sparse_attention(q: Tensor, entries: Tensor, cu_seqlens_q: Tensor, cu_seqlens_c: Tensor,
                     indices: Tensor, scale: float, plan: GlobalPlan | PoolPlan | None = None) -> tuple[Tensor, Tensor]:
    """As the twin: out (T, H, D) f32 and lse (T, H) f32; a query with no entry gets (0, -inf).
    With a :class:`PoolPlan` the C++ kernel reads ``entries`` where given, else dequantizes only the
    selected rows from the pool in place."""
    if isinstance(plan, PoolPlan):
        return torch.ops.cedar_cpu.sparse_pool_attention(q.contiguous(), entries, plan.rows, plan.row_scales,
                                                         plan.entry_rows, plan.cu_c, plan.row_req,
                                                         indices.int().contiguous(), scale)
    if cpu_ext.available() and q.device.type == "cpu" and plan is None:  # float entries, any layout
        none = torch.zeros(1, entries.shape[1] // 16, dtype=torch.uint8)
        rows = row_owners(cu_seqlens_q)
        return torch.ops.cedar_cpu.sparse_pool_attention(q.float().contiguous(), entries.float().contiguous(), none,
                                                         none, rows, cu_seqlens_c.long(), rows,
                                                         indices.int().contiguous(), scale)
    if plan is None or indices.shape[1] == 0 or entries.shape[0] == 0:
        return sparse_attention_ref.sparse_attention(q, entries, cu_seqlens_q, cu_seqlens_c, indices, scale)
    cu = cu_seqlens_c.long()
    base, count = cu[:-1][plan.row_req], (cu[1:] - cu[:-1])[plan.row_req]  # (T,)
    valid = (indices >= 0) & (indices.long() < count[:, None])  # (T, k)
    rows = torch.where(valid, indices.long() + base[:, None], 0)
    kv = entries.float()[rows]  # (T, k, D)
    logits = torch.bmm(q.float(), kv.transpose(1, 2)) * scale  # (T, H, k)
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - m)
    denom = p.sum(-1)  # (T, H)
    o = torch.bmm(p, kv) / denom.clamp_min(1e-30)[..., None]
    out = torch.where(denom[..., None] > 0, o, torch.zeros_like(o))
    return out, torch.log(denom) + m.squeeze(-1)
