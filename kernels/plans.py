"""Attention plans: the per-forward index tensors the batched CPU kernels (``*_fast.py``) run on.

FlashInfer's shape: a forward's ragged layout (which query rows belong to which request, where
each request's keys sit) is turned into dense index tensors *once* (``plan``), and every layer
then runs a fixed number of batched ops over them (``run``), whatever the batch size. The plans
hold no CPU-only assumption (plain int64 / bool tensors on the rows' device): a GPU kernel can
take the same tables.

Two plans:

- :class:`WindowPlan`: where each request's keys sit (its ring rows, then its new rows at
  consecutive positions) and which queries read them; the C++ kernel walks each query's window
  in it, the batched-torch path cuts queries into blocks of ``Q`` consecutive positions that read
  ``K = W - 1 + Q`` key positions each (:class:`WindowBlocks`).
- :class:`GlobalPlan`: each request's query rows and its global entries, padded per request
  (``(B, Tq)`` and ``(B, C)``), for the batched indexer and sparse attention.

Two more for decode steps (one row per request), read by the C++ kernels in place:

- :class:`RingPlan`: each query reads its request's FP8 ring directly (its own new key already
  stored there), dequantizing only the keys in its window.
- :class:`PoolPlan`: each query reads its request's FP4 entries from the token pool through the
  entry row table, dequantizing index keys as it scores them and global rows only where selected.

Builders take the key layout the caller produced (:func:`window_plan`): a request's keys are
``[S ring rows, row p % S holds position p][its new rows, consecutive positions]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class WindowBlocks:
    q_index: Tensor  # (nb, Q) int64 query row of each block slot, -1 = padding
    k_index: Tensor  # (nb, K) int64 ragged key row of each key slot (0 where not ok)
    k_expect: Tensor  # (nb, K) int64 position the key slot must hold to be read
    k_ok: Tensor  # (nb, K) bool readable by layout: at or above the floor, a row that exists
    band: Tensor  # (Q, K) bool: key slot j is in the window of block query i (i <= j <= i + W - 1)


@dataclass(frozen=True)
class WindowPlan:
    """The key layout of one window read (who reads what); ``blocks`` are built on first use."""

    cu_q: Tensor  # (B + 1,) int64 query rows per request
    q_first: Tensor  # (B,) int64 position of each request's first query row
    row_req: Tensor  # (T,) int64 request of every query row
    cu_k: Tensor  # (B + 1,) int64 ragged keys per request: ring_size ring rows, then new rows
    k_first: Tensor  # (B,) int64 position of each request's first new key
    floor: Tensor  # (B,) int64 lowest readable key position
    ring_size: int
    window: int
    block_q: int  # query rows per block of the batched-torch path
    num_blocks: int | None = None  # blocks of the batched-torch path, where known on the host

    @cached_property
    def blocks(self) -> WindowBlocks:
        return _window_blocks(self)
@dataclass(frozen=True)
class GlobalPlan:
    q_index: Tensor  # (B, Tq) int64 query rows of each request, -1 = padding
    c_index: Tensor  # (B, C) int64 ragged entry row of request-local entry c (0 where invalid)
    c_valid: Tensor  # (B, C) bool entry c exists for the request
    row_req: Tensor  # (T,) int64 request of every query row


@dataclass(frozen=True)
class RingPlan:
    codes: Tensor  # (num_slots, S, D) uint8 FP8 ring rows of one layer
    scales: Tensor  # (num_slots, S, D / 32) uint8 E8M0
    ring_pos: Tensor  # (num_slots, S) int64 position held by each ring row, -1 = empty
    slot: Tensor  # (T,) int64 request slot of each query row
    row_req: Tensor  # (T,) int64 request of each query row


@dataclass(frozen=True)
class PoolPlan:
    rows: Tensor  # (num_rows, D / 2) uint8 FP4 global rows of one source
    row_scales: Tensor  # (num_rows, D / 16) uint8 E4M3
    index_rows: Tensor  # (num_rows, Di / 2) uint8 FP4 index keys
    index_scales: Tensor  # (num_rows, Di / 32) uint8 E8M0
    entry_rows: Tensor  # (Nc,) int64 pool row of each request's entries, ragged by the view's cu
    cu_c: Tensor  # (B + 1,) int64
    row_req: Tensor  # (T,) int64 request of every query row
    ratio: int


def segments(lens: Tensor, total: int | None = None) -> tuple[Tensor, Tensor]:
    """(B,) counts -> (sum,) owner index and (sum,) offset within the owner's segment.

    total: sum(lens) where the caller knows it on the host (the planner does): then no output
    size is read back from the device (NOTE: without it, repeat_interleave syncs to size its
    output)."""
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    starts = torch.cumsum(lens, 0) - lens
    n = owner.numel() if total is None else total
    return owner, torch.arange(n, device=lens.device) - starts[owner]


def row_owners(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """(B + 1,) offsets -> (T,) int64 request of every row (total: T, where known on the host)."""
    cu = cu_seqlens.long()
    return segments(cu[1:] - cu[:-1], total)[0]


def window_plan(cu_q: Tensor, q_first: Tensor, cu_k: Tensor, k_first: Tensor, ring_size: int,
                floor: Tensor, window: int, block_q: int, q_lens: tuple[int, ...] | None = None) -> WindowPlan:
    """A window read over a ragged key layout.

    cu_q: (B + 1,) query rows per request (consecutive positions from q_first (B,) int64);
    cu_k: (B + 1,) ragged key rows per request: ``ring_size`` ring rows (position p at ring row
    p % ring_size), then its new keys at consecutive positions from k_first (B,);
    floor: (B,) int64 lowest readable key position. All on one device.
    q_lens: the query rows per request as host ints, where the caller has them: then neither
    this plan nor its blocks read a size back from the device."""
    cu_q = cu_q.long()
    row_req = row_owners(cu_q, None if q_lens is None else sum(q_lens))
    num_blocks = None if q_lens is None else sum(-(-n // block_q) for n in q_lens)
    return WindowPlan(cu_q, q_first, row_req, cu_k.long(), k_first, floor, ring_size, window, block_q, num_blocks)


def _window_blocks(plan: WindowPlan) -> WindowBlocks:
    """Query rows in blocks of ``block_q`` consecutive positions of one request; block b reads
    the K = W - 1 + Q key positions [p_b - W + 1, p_b + Q - 1] (p_b its first query position)."""
    cu_q, cu_k, block_q, window, ring_size = plan.cu_q, plan.cu_k, plan.block_q, plan.window, plan.ring_size
    n_q, n_new = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1] - ring_size
    nblk = (n_q + block_q - 1) // block_q
    req, i = segments(nblk, plan.num_blocks)
    row0 = cu_q[:-1][req] + i * block_q  # (nb,) first query row of each block
    q_index = row0[:, None] + torch.arange(block_q, device=cu_q.device)
    q_index = torch.where(q_index < cu_q[1:][req][:, None], q_index, -1)
    K = window - 1 + block_q
    k_expect = (plan.q_first[req] + i * block_q)[:, None] + torch.arange(K, device=cu_q.device) - (window - 1)
    new = k_expect - plan.k_first[req][:, None]  # (nb, K) offset among the new keys
    k_index = torch.where(new >= 0, cu_k[:-1][req][:, None] + ring_size + new,
                          cu_k[:-1][req][:, None] + k_expect.remainder(ring_size))
    k_ok = (k_expect >= plan.floor[req].clamp_min(0)[:, None]) & (new < n_new[req][:, None])
    j = torch.arange(K, device=cu_q.device)
    qi = torch.arange(block_q, device=cu_q.device)[:, None]
    band = (j >= qi) & (j <= qi + window - 1)
    return WindowBlocks(q_index, torch.where(k_ok, k_index, 0), k_expect, k_ok, band)


def global_plan(cu_q: Tensor, cu_c: Tensor, q_lens: tuple[int, ...] | None = None,
                max_c: int | None = None) -> GlobalPlan:
    """cu_q: (B + 1,) query rows per request; cu_c: (B + 1,) ragged entries per request.
    q_lens (query rows per request) and max_c (the most entries of a request) as host ints,
    where the caller has them: then no size is read back from the device."""
    cu_q, cu_c = cu_q.long(), cu_c.long()
    n_q, n_c = cu_q[1:] - cu_q[:-1], cu_c[1:] - cu_c[:-1]
    if q_lens is None:
        Tq = int(n_q.max()) if n_q.numel() else 0
    else:
        Tq = max(q_lens, default=0)
    C = max(max_c if max_c is not None else int(n_c.max()) if n_c.numel() else 0, 1)
    t = torch.arange(Tq, device=cu_q.device)
    q_index = torch.where(t < n_q[:, None], cu_q[:-1, None] + t, -1)
    c = torch.arange(C, device=cu_q.device)
    c_valid = c < n_c[:, None]
    c_index = torch.where(c_valid, cu_c[:-1, None] + c, 0)
    row_req = row_owners(cu_q, None if q_lens is None else sum(q_lens))
    return GlobalPlan(q_index, c_index, c_valid, row_req)
