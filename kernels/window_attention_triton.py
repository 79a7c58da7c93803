"""Sliding-window attention over a K = V latent cache (Triton; twin: ``window_attention_ref``).

Same contract as the twin: key ``j`` is visible to query ``i`` of request ``b`` iff
``k_pos[j] >= 0`` and ``max(window_floor[b], q_pos[i] - window + 1) <= k_pos[j] <= q_pos[i]``;
the per-head sink adds ``exp(sink[h])`` to the softmax denominator and to ``lse``.

Kernel shape: one program per (block of ``BLOCK_Q`` query rows of one request, block of
``BLOCK_H`` heads). The rows x heads are flattened into one ``M = BLOCK_Q * BLOCK_H`` tile (MQA:
every head reads the same keys), and the program walks ALL of its request's keys in blocks of
``BLOCK_N`` with an online softmax, masking by position: keys sit in a ring in any order, so
there is no contiguous range to skip to. Extend (many rows) and decode (one row) share the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# NOTE: the twins compute in fp32; "ieee" keeps tl.dot in fp32 on GPUs too (the default, tf32,
# gives ~1e-3 relative error). "tf32x3" is the fast candidate to evaluate with gpu_check.
DOT_PRECISION = "ieee"
FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _window_attention_kernel(
    q_ptr, k_ptr, q_pos_ptr, k_pos_ptr, sink_ptr, items_ptr, out_ptr, lse_ptr,
    num_heads, head_dim, window, scale,
    HAS_SINK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    item = tl.program_id(0)
    q_start = tl.load(items_ptr + item * 5 + 0)
    q_end = tl.load(items_ptr + item * 5 + 1)
    k_start = tl.load(items_ptr + item * 5 + 2)
    k_end = tl.load(items_ptr + item * 5 + 3)
    floor = tl.load(items_ptr + item * 5 + 4)

    m_idx = tl.arange(0, BLOCK_Q * BLOCK_H)
    t = q_start + m_idx // BLOCK_H  # (M,) query row of each tile row
    h = tl.program_id(1) * BLOCK_H + m_idx % BLOCK_H  # (M,) head of each tile row
    row_ok = (t < q_end) & (h < num_heads)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_offs = (t * num_heads + h)[:, None] * head_dim + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    qp = tl.load(q_pos_ptr + t, mask=row_ok, other=0)
    lo = tl.maximum(qp - window + 1, floor)  # (M,) lowest visible key position

    if HAS_SINK:  # NOTE: the sink is a logit with no value: it starts the running max and sum
        m_i = tl.load(sink_ptr + h, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full((BLOCK_Q * BLOCK_H,), 1.0, tl.float32)
    else:
        m_i = tl.full((BLOCK_Q * BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_Q * BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_Q * BLOCK_H, BLOCK_D), tl.float32)

    for n0 in range(k_start, k_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < k_end
        kv = tl.load(k_ptr + n[:, None] * head_dim + d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (N, D)
        kp = tl.load(k_pos_ptr + n, mask=n_ok, other=-1)
        vis = (kp[None, :] >= 0) & (kp[None, :] >= lo[:, None]) & (kp[None, :] <= qp[:, None])
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC) * scale  # (M, N)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: no (-inf) - (-inf) NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision=DOT_PREC)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offs, out, mask=row_ok[:, None] & d_ok[None, :])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * num_heads + h, lse, mask=row_ok)


def ragged_q_blocks(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_q: int, num_rows: int) -> Tensor:
    """Work items of a ragged batch: one per block of ``block_q`` query rows of one request.

    cu_seqlens_q, cu_seqlens_k: (B + 1,) int32/int64 on the kernel's device; num_rows: T.
    Returns items (cdiv(T, block_q) + B, 5) int64 rows ``(q_start, q_end, k_start, k_end, b)``;
    unused trailing items have ``q_start == q_end``, no keys and ``b == 0``.
    NOTE: the item count is an upper bound known on the host, so planning never syncs the device.
    """
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    num_reqs = cu_q.numel() - 1
    blocks = (cu_q[1:] - cu_q[:-1] + block_q - 1) // block_q  # (B,)
    ends = torch.cumsum(blocks, 0)  # (B,) first item of the next request
    num_items = triton.cdiv(num_rows, block_q) + num_reqs
    item = torch.arange(num_items, device=cu_q.device)
    req = torch.searchsorted(ends, item, right=True)  # (I,) == B for unused items
    used = req < num_reqs
    req = req.clamp(max=max(num_reqs - 1, 0))
    q_start = cu_q[req] + (item - (ends[req] - blocks[req])) * block_q
    q_end = torch.minimum(q_start + block_q, cu_q[req + 1])
    zero = torch.zeros_like(item)
    q_start, q_end = torch.where(used, q_start, zero), torch.where(used, q_end, zero)
    k_start = torch.where(used, cu_k[req], zero)
    k_end = torch.where(used, cu_k[req + 1], zero)
    req = torch.where(used, req, zero)
    return torch.stack([q_start, q_end, k_start, k_end, req], dim=1)


def _launch_geometry(num_heads: int, head_dim: int, num_rows: int, on_gpu: bool) -> dict[str, int]:
    """Block sizes: every tl.dot dim >= 16 (the GPU's minimum tile) on both devices; small
    tiles on a GPU (registers: D = 512), few large programs in the CPU interpreter (~12 ms each)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if on_gpu:
        block_h = min(triton.next_power_of_2(num_heads), 16 if block_d > 128 else 64)
        rows = 16 if block_d > 128 else 64
        block_n = 32 if block_d > 128 else 64
    else:
        block_h = triton.next_power_of_2(num_heads)
        rows, block_n = 512, 128
    block_q = min(max(1, rows // block_h), triton.next_power_of_2(max(num_rows, 1)))
    block_q = max(block_q, triton.cdiv(16, block_h))
    return dict(BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d)


def _check(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, q_pos: Tensor,
           k_pos: Tensor, window_floor: Tensor, sink: Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"window_attention: q (T, H, D) and k (N, D) expected, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype not in FLOAT_INPUTS or k.dtype not in FLOAT_INPUTS:
        raise ValueError(f"window_attention: q and k must be one of {FLOAT_INPUTS}, "
                         f"got {q.dtype}, {k.dtype}")
    num_reqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_q.dim() != 1 or num_reqs < 0 or cu_seqlens_k.shape != cu_seqlens_q.shape \
            or window_floor.shape != (num_reqs,):
        raise ValueError("window_attention: cu_seqlens_q/k (B+1,) and window_floor (B,) disagree")
    if num_reqs == 0 and q.shape[0] > 0:
        raise ValueError("window_attention: query rows but no request (cu_seqlens_q has one element)")
    if q_pos.shape != (q.shape[0],) or k_pos.shape != (k.shape[0],):
        raise ValueError("window_attention: q_pos (T,) and k_pos (N,) must match q and k")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("q_pos", q_pos), ("k_pos", k_pos), ("window_floor", window_floor)):
        if x.dtype not in INDEX_DTYPES:
            raise ValueError(f"window_attention: {name} must be int32 or int64, got {x.dtype}")
    if sink is not None and (sink.shape != (q.shape[1],) or sink.dtype != torch.float32):
        raise ValueError(f"window_attention: sink must be (H,) float32, got {tuple(sink.shape)} {sink.dtype}")
    tensors = [q, k, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, window_floor]
    tensors += [sink] if sink is not None else []
    if any(x.device != q.device for x in tensors):
        raise ValueError("window_attention: all tensors must be on one device")
    if not all(x.is_contiguous() for x in tensors):
        raise ValueError("window_attention: all tensors must be contiguous")


def window_attention(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, q_pos: Tensor,
                     k_pos: Tensor, window: int, window_floor: Tensor, sink: Tensor | None,
                     scale: float, plan=None) -> tuple[Tensor, Tensor]:
    """Ragged batch of requests; K = V (same contract as ``window_attention_ref.window_attention``).

    q: (T, H, D) float32 (bf16/fp16 accepted, upcast), request b in rows cu_seqlens_q[b]:[b+1].
    k: (N, D) float32 (bf16/fp16 accepted) dequantized window keys (= values), request b in rows
    cu_seqlens_k[b]:[b+1]. cu_seqlens_q, cu_seqlens_k: (B + 1,) int32/int64; q_pos: (T,) int;
    k_pos: (N,) int (-1 = empty); window: int (W); window_floor: (B,) int, the lowest readable key
    position per request; sink: (H,) float32 or None; scale: softmax scale. All contiguous.
    Returns out (T, H, D) float32 and lse (T, H) float32 (-inf where nothing, not even a sink, is seen).
    """
    _check(q, k, cu_seqlens_q, cu_seqlens_k, q_pos, k_pos, window_floor, sink)
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    geo = _launch_geometry(H, D, T, q.is_cuda)
    items = ragged_q_blocks(cu_seqlens_q, cu_seqlens_k, geo["BLOCK_Q"], T)  # (I, 5)
    items[:, 4] = window_floor.long()[items[:, 4]]  # NOTE: the kernel reads column 4 as the floor
    grid = (items.shape[0], triton.cdiv(H, geo["BLOCK_H"]))
    _window_attention_kernel[grid](
        q, k, q_pos, k_pos, sink if sink is not None else q, items, out, lse,
        H, D, int(window), float(scale), HAS_SINK=sink is not None, DOT_PREC=DOT_PRECISION,
        num_warps=8 if q.is_cuda and geo["BLOCK_D"] > 128 else 4, **geo)
    return out, lse
