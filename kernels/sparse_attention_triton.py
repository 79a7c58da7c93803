"""Compressed sparse attention over the global KV in Triton (twins: ``sparse_attention_ref``).

Three kernels with the twins' contracts (request-local entry ids, ``-1`` padding, ``-inf`` for
entries not yet visible, ``(0, -inf)`` for a query that selects nothing):

1. ``indexer_scores``: one program per (block of query rows of one request, split of the entry
   range); rows x index heads form one tile, so ``sum_h w * relu(q . k)`` is a dot, a relu and a
   reduction over the head axis of a reshaped tile.
2. ``topk_select``: each score becomes one int64 sort key ``(order-preserving score bits << 32) |
   (2**31 - 1 - id)``, so a plain descending ``tl.topk`` orders by score then by LOWER id: exactly
   the twin's stable descending sort. A row is scanned in chunks, keeping a running top-k.
3. ``sparse_attention``: one program per (block of query rows, block of heads); each row gathers
   its own selected entries, so the dots are batched over rows (3-D ``tl.dot``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cedar.kernels.plans import GlobalPlan
from cedar.kernels.window_attention_triton import (
    DOT_PRECISION,
    FLOAT_INPUTS,
    INDEX_DTYPES,
    ragged_q_blocks,
)

NOT_A_CANDIDATE = tl.constexpr(-(2**31))  # high word of the sort key of a non-finite score


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, q_pos_ptr, c_pos_ptr, items_ptr, scores_ptr,
    num_heads, head_dim, num_cols,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    item = tl.program_id(0)
    q_start = tl.load(items_ptr + item * 5 + 0)
    q_end = tl.load(items_ptr + item * 5 + 1)
    c_start = tl.load(items_ptr + item * 5 + 2)
    c_end = tl.load(items_ptr + item * 5 + 3)

    m_idx = tl.arange(0, BLOCK_Q * BLOCK_H)
    t = q_start + m_idx // BLOCK_H  # (M,)
    h = m_idx % BLOCK_H
    row_ok = (t < q_end) & (h < num_heads)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + (t * num_heads + h)[:, None] * head_dim + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (M, D)
    w = tl.load(w_ptr + t * num_heads + h, mask=row_ok, other=0.0).to(tl.float32)  # (M,)
    tq = q_start + tl.arange(0, BLOCK_Q)  # (Q,)
    tq_ok = tq < q_end
    qp = tl.load(q_pos_ptr + tq, mask=tq_ok, other=0)

    step = BLOCK_C * tl.num_programs(1)
    for c0 in range(c_start + tl.program_id(1) * BLOCK_C, c_end, step):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < c_end
        kk = tl.load(k_ptr + c[:, None] * head_dim + d[None, :],
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (C, D)
        dots = tl.maximum(tl.dot(q, tl.trans(kk), input_precision=DOT_PREC), 0.0) * w[:, None]
        sc = tl.sum(tl.reshape(dots, (BLOCK_Q, BLOCK_H, BLOCK_C)), axis=1)  # (Q, C)
        cp = tl.load(c_pos_ptr + c, mask=c_ok, other=0)
        sc = tl.where(cp[None, :] <= qp[:, None], sc, float("-inf"))
        offs = tq[:, None] * num_cols + (c - c_start)[None, :]
        tl.store(scores_ptr + offs, sc, mask=tq_ok[:, None] & c_ok[None, :])


@triton.jit
def _sort_keys(s, ids):
    """fp32 scores, int ids (< 2**31) -> int64 keys: by score, then by lower id; -inf/nan lowest."""
    s = tl.where(s == 0.0, 0.0, s)  # NOTE: -0.0 and +0.0 tie in the twin's sort
    bits = s.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # monotone in s
    finite = (s == s) & (tl.abs(s) != float("inf"))
    ordered = tl.where(finite, ordered, NOT_A_CANDIDATE)
    return (ordered << 32) | (2147483647 - ids).to(tl.int64)


@triton.jit
def _cube_axis(n_dims: tl.constexpr, j: tl.constexpr):
    """[0, 1] laid along the j-th innermost axis of a (2,) * n_dims hypercube."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(h, flip, i: tl.constexpr, n_dims: tl.constexpr):
    """One bitonic compare-and-swap along the i-th innermost axis of an int64 hypercube."""
    # NOTE: the partner is (pair sum - self) rather than tl.sort's xor_sum: the interpreter runs
    # custom-combine reductions element by element in Python (seconds per sort); int64 sums wrap,
    # so the subtraction is exact.
    partner = tl.sum(h, axis=n_dims - 1 - i, keep_dims=True) - h
    return tl.where((h > partner) != (flip ^ _cube_axis(n_dims, i)), partner, h)


@triton.jit
def _bitonic_stage(h, stage: tl.constexpr, order: tl.constexpr, n_dims: tl.constexpr):
    """order 1: descending runs of 2**stage; order 2: alternating runs (as in tl.sort)."""
    if order == 2:
        flip = _cube_axis(n_dims, stage)
    else:
        flip = order
    for i in tl.static_range(stage):
        h = _compare_swap(h, flip, stage - 1 - i, n_dims)
    return h


@triton.jit
def _topk_rows(x, LOG_T: tl.constexpr, LOG_C: tl.constexpr, LOG_K: tl.constexpr):
    """int64 (2**LOG_T, 2**LOG_C) -> its 2**LOG_K largest per row, descending (bitonic top-k,
    the algorithm of tl.topk with an interpreter-friendly compare-and-swap)."""
    n_dims: tl.constexpr = LOG_T + LOG_C
    h = tl.reshape(x, [2] * n_dims)
    for i in tl.static_range(1, LOG_K + 1):
        h = _bitonic_stage(h, i, 2 if i < LOG_C else 1, n_dims)
    for i in tl.static_range(LOG_K + 1, LOG_C + 1):
        dims: tl.constexpr = n_dims - (i - LOG_K - 1)
        h = tl.max(h, axis=dims - 1 - LOG_K)  # NOTE: keeps the top half of two sorted runs
        h = _bitonic_stage(h, LOG_K, 2 if i < LOG_C else 1, dims - 1)
    return tl.reshape(h, (2**LOG_T, 2**LOG_K))


@triton.jit
def _topk_select_kernel(
    scores_ptr, out_ptr, num_rows, num_cols, k,
    LOG_T: tl.constexpr, LOG_C: tl.constexpr, LOG_K: tl.constexpr,
):
    BLOCK_T: tl.constexpr = 2**LOG_T
    BLOCK_C: tl.constexpr = 2**LOG_C
    K_PAD: tl.constexpr = 2**LOG_K
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_rows
    best = tl.full((BLOCK_T, K_PAD), NOT_A_CANDIDATE, tl.int64) << 32  # running top-k keys
    for c0 in range(0, num_cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        s = tl.load(scores_ptr + t[:, None].to(tl.int64) * num_cols + c[None, :],
                    mask=t_ok[:, None] & (c < num_cols)[None, :], other=float("-inf"))
        top = _topk_rows(_sort_keys(s, c[None, :]), LOG_T, LOG_C, LOG_K)  # (T, K_PAD)
        both = tl.reshape(tl.join(best, top), (BLOCK_T, 2 * K_PAD))
        best = _topk_rows(both, LOG_T, LOG_K + 1, LOG_K)
    ids = (2147483647 - (best & 0xFFFFFFFF)).to(tl.int32)
    ids = tl.where((best >> 32) == NOT_A_CANDIDATE, -1, ids)
    j = tl.arange(0, K_PAD)
    tl.store(out_ptr + t[:, None].to(tl.int64) * k + j[None, :], ids,
             mask=t_ok[:, None] & (j < k)[None, :])


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, idx_ptr, row_base_ptr, row_count_ptr, out_ptr, lse_ptr,
    num_rows, num_heads, head_dim, topk, scale,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (T,)
    t_ok = t < num_rows
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (H,)
    d = tl.arange(0, BLOCK_D)
    q_offs = ((t.to(tl.int64) * num_heads)[:, None, None] + h[None, :, None]) * head_dim + d[None, None, :]
    q_mask = t_ok[:, None, None] & (h < num_heads)[None, :, None] & (d < head_dim)[None, None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)  # (T, H, D)
    base = tl.load(row_base_ptr + t, mask=t_ok, other=0)
    count = tl.load(row_count_ptr + t, mask=t_ok, other=0)

    m_i = tl.full((BLOCK_T, BLOCK_H), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_H, BLOCK_D), tl.float32)
    for j0 in range(0, topk, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + t[:, None].to(tl.int64) * topk + j[None, :],
                      mask=t_ok[:, None] & (j < topk)[None, :], other=-1)  # (T, N)
        ok = (ids >= 0) & (ids < count[:, None])  # NOTE: ids past the request's entries are ignored
        rows = base[:, None] + tl.where(ok, ids, 0).to(tl.int64)
        kv = tl.load(kv_ptr + rows[:, :, None] * head_dim + d[None, None, :],
                     mask=ok[:, :, None] & (d < head_dim)[None, None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(kv, 0, 2, 1), input_precision=DOT_PREC) * scale  # (T, H, N)
        s = tl.where(ok[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, :, None])
        l_i = l_i * alpha + tl.sum(p, axis=2)
        acc = acc * alpha[:, :, None] + tl.dot(p, kv, input_precision=DOT_PREC)
        m_i = m_new

    seen = l_i > 0
    tl.store(out_ptr + q_offs, acc / tl.where(seen, l_i, 1.0)[:, :, None], mask=q_mask)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    lse_mask = t_ok[:, None] & (h < num_heads)[None, :]
    tl.store(lse_ptr + t[:, None].to(tl.int64) * num_heads + h[None, :], lse, mask=lse_mask)


def _log2(n: int) -> int:
    """log2 of a power of two."""
    return n.bit_length() - 1


def _check_common(name: str, floats: dict[str, Tensor], ints: dict[str, Tensor]) -> None:
    for arg, x in floats.items():
        if x.dtype not in FLOAT_INPUTS:
            raise ValueError(f"{name}: {arg} must be one of {FLOAT_INPUTS}, got {x.dtype}")
    for arg, x in ints.items():
        if x.dtype not in INDEX_DTYPES or x.dim() != 1:
            raise ValueError(f"{name}: {arg} must be 1-D int32/int64, got {tuple(x.shape)} {x.dtype}")
    tensors = list(floats.values()) + list(ints.values())
    if any(x.device != tensors[0].device for x in tensors):
        raise ValueError(f"{name}: all tensors must be on one device")
    if not all(x.is_contiguous() for x in tensors):
        raise ValueError(f"{name}: all tensors must be contiguous")


def indexer_scores(q_idx: Tensor, w_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor,
                   cu_seqlens_c: Tensor, q_pos: Tensor, c_pos: Tensor, plan=None) -> Tensor:
    """Lightning-indexer scores (same contract as ``sparse_attention_ref.indexer_scores``).

    q_idx: (T, Hi, Di) f32; w_idx: (T, Hi) f32; k_idx: (Nc, Di) f32 dequantized index keys
    (bf16/fp16 accepted, upcast); cu_seqlens_q, cu_seqlens_c: (B+1,) int32/int64; q_pos: (T,) int;
    c_pos: (Nc,) int, the position at which each entry becomes visible. All contiguous.
    Returns scores (T, C) float32, C = the largest per-request entry count (at least 1);
    entry ids are request-local; ``-inf`` for invisible entries and padding columns.
    """
    if q_idx.dim() != 3 or k_idx.dim() != 2 or q_idx.shape[-1] != k_idx.shape[-1]:
        raise ValueError(f"indexer_scores: q_idx (T, Hi, Di), k_idx (Nc, Di) expected, "
                         f"got {tuple(q_idx.shape)}, {tuple(k_idx.shape)}")
    if w_idx.shape != q_idx.shape[:2] or c_pos.shape != (k_idx.shape[0],) or q_pos.shape != (q_idx.shape[0],):
        raise ValueError("indexer_scores: w_idx must be (T, Hi), q_pos (T,) and c_pos (Nc,)")
    if cu_seqlens_q.shape != cu_seqlens_c.shape or (cu_seqlens_q.numel() < 2 and q_idx.shape[0] > 0):
        raise ValueError("indexer_scores: cu_seqlens_q and cu_seqlens_c must both be (B+1,), B >= 1")
    _check_common("indexer_scores", dict(q_idx=q_idx, w_idx=w_idx, k_idx=k_idx),
                  dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_c=cu_seqlens_c, q_pos=q_pos, c_pos=c_pos))
    T, Hi, Di = q_idx.shape
    # NOTE: C is an output shape: a served forward's GlobalPlan knows it on the host; without
    # one, this host sync is part of the contract.
    if isinstance(plan, GlobalPlan):
        num_cols = plan.c_index.shape[1]
    else:
        counts = cu_seqlens_c[1:] - cu_seqlens_c[:-1]
        num_cols = max(int(counts.max()) if counts.numel() else 0, 1)
    scores = torch.full((T, num_cols), float("-inf"), dtype=torch.float32, device=q_idx.device)
    if T == 0 or Hi == 0:
        return scores
    block_h = triton.next_power_of_2(Hi)
    block_d = max(16, triton.next_power_of_2(Di))
    rows = 64 if q_idx.is_cuda else 512
    block_q = max(min(max(1, rows // block_h), triton.next_power_of_2(T)), triton.cdiv(16, block_h))
    block_c = 64 if q_idx.is_cuda else 256
    splits = triton.cdiv(num_cols, block_c) if q_idx.is_cuda else 1
    items = ragged_q_blocks(cu_seqlens_q, cu_seqlens_c, block_q, T)
    _indexer_scores_kernel[(items.shape[0], splits)](
        q_idx, w_idx, k_idx, q_pos, c_pos, items, scores, Hi, Di, num_cols,
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_D=block_d, DOT_PREC=DOT_PRECISION)
    return scores


def topk_select(scores: Tensor, k: int) -> Tensor:
    """The ``k`` best entries per row (same contract as ``sparse_attention_ref.topk_select``).

    scores: (T, C) float32, contiguous (-inf = not a candidate); k: int >= 0.
    Returns indices (T, k) int32: best first, ties to the lower id, -1 padded (also past C).
    NOTE: +inf and NaN count as non-candidates here too, but go to the padding end of the row.
    """
    if scores.dim() != 2 or k < 0:
        raise ValueError(f"topk_select: scores (T, C) and k >= 0 expected, got {tuple(scores.shape)}, {k}")
    if scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"topk_select: scores must be contiguous float32, got {scores.dtype}")
    T, C = scores.shape
    out = torch.full((T, k), -1, dtype=torch.int32, device=scores.device)
    if T == 0 or k == 0 or C == 0:
        return out
    k_pad = max(2, triton.next_power_of_2(k))  # NOTE: a 1-wide top-k would reduce to a scalar
    if scores.is_cuda:
        block_t, block_c = 1, max(k_pad, 1024)
    else:
        block_t, block_c = 16, max(k_pad, 16, min(triton.next_power_of_2(C), 1024))
    _topk_select_kernel[(triton.cdiv(T, block_t),)](
        scores, out, T, C, k, LOG_T=_log2(block_t), LOG_C=_log2(block_c), LOG_K=_log2(k_pad))
    return out


def indexer_topk(q_idx: Tensor, w_idx: Tensor, k_idx: Tensor, cu_seqlens_q: Tensor, cu_seqlens_c: Tensor,
                 q_pos: Tensor, c_pos: Tensor, k: int, plan=None) -> Tensor:
    """The two kernels in turn (same contract as ``sparse_attention_ref.indexer_topk``)."""
    return topk_select(indexer_scores(q_idx, w_idx, k_idx, cu_seqlens_q, cu_seqlens_c, q_pos, c_pos, plan), k)


def sparse_attention(q: Tensor, entries: Tensor, cu_seqlens_q: Tensor, cu_seqlens_c: Tensor,
                     indices: Tensor, scale: float, plan=None) -> tuple[Tensor, Tensor]:
    """Attention over each query's selected entries (same contract as the twin), K = V.

    q: (T, H, D) f32; entries: (Nc, D) f32 dequantized global KV (bf16/fp16 accepted, upcast);
    cu_seqlens_q, cu_seqlens_c: (B+1,) int32/int64; indices: (T, k) int32 request-local entry ids,
    -1 = none (ids >= the request's entry count are ignored too). All contiguous.
    Returns out (T, H, D) f32 and lse (T, H) f32; a query with no entry gets (0, -inf).
    """
    if q.dim() != 3 or entries.dim() != 2 or q.shape[-1] != entries.shape[-1]:
        raise ValueError(f"sparse_attention: q (T, H, D), entries (Nc, D) expected, "
                         f"got {tuple(q.shape)}, {tuple(entries.shape)}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0] or indices.dtype != torch.int32:
        raise ValueError(f"sparse_attention: indices must be (T, k) int32, "
                         f"got {tuple(indices.shape)} {indices.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_c.shape or (cu_seqlens_q.numel() < 2 and q.shape[0] > 0):
        raise ValueError("sparse_attention: cu_seqlens_q and cu_seqlens_c must both be (B+1,), B >= 1")
    _check_common("sparse_attention", dict(q=q, entries=entries),
                  dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_c=cu_seqlens_c))
    if not indices.is_contiguous() or indices.device != q.device:
        raise ValueError("sparse_attention: indices must be contiguous and on q's device")
    T, H, D = q.shape
    topk = indices.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0 or topk == 0 or entries.shape[0] == 0:
        return out, lse
    cu_q, cu_c = cu_seqlens_q.long(), cu_seqlens_c.long()
    req = torch.repeat_interleave(torch.arange(cu_q.numel() - 1, device=q.device),
                                  cu_q[1:] - cu_q[:-1], output_size=T)  # (T,) request of each row
    row_base, row_count = cu_c[req].contiguous(), (cu_c[req + 1] - cu_c[req]).contiguous()
    geo = _sparse_geometry(H, D, topk, q.is_cuda)
    grid = (triton.cdiv(T, geo["BLOCK_T"]), triton.cdiv(H, geo["BLOCK_H"]))
    _sparse_attention_kernel[grid](
        q, entries, indices, row_base, row_count, out, lse, T, H, D, topk, float(scale),
        DOT_PREC=DOT_PRECISION, num_warps=8 if q.is_cuda and geo["BLOCK_D"] > 128 else 4, **geo)
    return out, lse


def _sparse_geometry(num_heads: int, head_dim: int, topk: int, on_gpu: bool) -> dict[str, int]:
    """Block sizes: every tl.dot dim >= 16; one query row per program on a GPU (its own gather),
    64 rows per program in the CPU interpreter (~12 ms per program instance)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(num_heads))
    if on_gpu:
        block_t, block_h, block_n = 1, min(block_h, 16 if block_d > 128 else 64), 32
    else:
        block_t, block_n = 64, 128
    block_n = min(block_n, max(16, triton.next_power_of_2(topk)))
    return dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d)
