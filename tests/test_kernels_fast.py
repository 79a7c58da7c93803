"""The fast CPU backend (batched plans in torch, C++ decode kernels) against the pure-torch twins.

Layouts are built the way the served path builds them: each request's keys are its ring (row
p % S holds position p, some rows empty or stale) and then its new rows; awkward sizes (1, 3,
W - 1, W, W + 1 rows; floors cutting the window; requests with no entry). Tolerance as for the
Triton kernels: fp32 everywhere, another summation order (~1e-6 seen).
"""

from __future__ import annotations

import pytest
import torch

from cedar.kernels import codec_fast, cpu_ext, fp4_ref, fp8_ref, merge_fast, merge_ref, sparse_attention_fast
from cedar.kernels import sparse_attention_ref
from cedar.kernels import window_attention_fast, window_attention_ref
from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW, WINDOW_ROW
from cedar.kernels.dispatch import KernelSet
from cedar.kernels.plans import PoolPlan, RingPlan, global_plan, window_plan

W, D, H, DI, HI = 128, 64, 4, 32, 2
ATOL = 2e-5
needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="the C++ CPU kernels could not be built here")


def close(a, b):
    assert a.shape == b.shape
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "different -inf pattern"
    fin = torch.isfinite(b)
    err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= ATOL, f"max error {err:.2e}"


def ring_batch(gen, new_lens, starts, S, floors):
    """Ragged keys [ring S rows][new rows] per request, as PoolKeys lays them out."""
    keys, pos, cu = [], [], [0]
    for n, first in zip(new_lens, starts):
        ring_pos = torch.full((S,), -1, dtype=torch.long)
        for p in range(max(0, first - S), first):  # the ring holds the last S positions before first
            if torch.rand((), generator=gen) > 0.1:  # some rows empty
                ring_pos[p % S] = p
        keys += [torch.randn(S + n, D, generator=gen)]
        pos += [ring_pos, torch.arange(first, first + n)]
        cu.append(cu[-1] + S + n)
    return torch.cat(keys), torch.cat(pos), torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("new_lens,starts,S", [
    ([1], [0], W), ([1, 1, 1], [5, 300, 129], W), ([3, W - 1, W, W + 1], [0, 40, 200, 1000], W),
    ([300], [64], 2 * W), ([1, 17], [700, 0], 2 * W),
])
@pytest.mark.parametrize("tail", [0, 1])
def test_window_plan_equals_twin(new_lens, starts, S, tail):
    """tail=1: the queries are each request's last W rows only (layer E's decoder tail), reading
    keys laid out from the request's first new row."""
    gen = torch.Generator().manual_seed(sum(new_lens) + S)
    k, k_pos, cu_k = ring_batch(gen, new_lens, starts, S, None)
    q_lens = [min(n, W) if tail else n for n in new_lens]
    q_first = torch.tensor([f + n - m for n, f, m in zip(new_lens, starts, q_lens)])
    lens = torch.tensor(q_lens)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).int()
    q_pos = torch.cat([torch.arange(f, f + n) for n, f in zip(q_lens, q_first.tolist())])
    q = torch.randn(int(lens.sum()), H, D, generator=gen)
    first = torch.tensor(starts)
    floor = (first - torch.tensor([7, 0, 130, 3, 1][:len(starts)])).clamp_min(0)
    sink = torch.randn(H, generator=gen)
    for block in (1, 5, W):
        plan = window_plan(cu_q, q_first, cu_k, first, S, floor, W, block)
        for s in (sink, None):
            want = window_attention_ref.window_attention(q, k, cu_q, cu_k, q_pos, k_pos, W, floor, s, 0.125)
            got = window_attention_fast._blocked(q, k, k_pos, s, 0.125, plan.blocks)  # the batched-torch path
            close(got[0], want[0]); close(got[1], want[1])
            if cpu_ext.available():
                got = window_attention_fast.window_attention(q, k, cu_q, cu_k, q_pos, k_pos, W, floor, s, 0.125,
                                                             plan=plan)
                close(got[0], want[0]); close(got[1], want[1])


def global_batch(gen, q_lens, c_lens):
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_c = torch.tensor([0, *torch.tensor(c_lens).cumsum(0).tolist()], dtype=torch.int32)
    q_pos = torch.cat([torch.randint(0, 2 * max(c, 1) + 2, (n,), generator=gen) for n, c in zip(q_lens, c_lens)])
    c_pos = torch.cat([(torch.arange(c) + 1) * 2 - 1 for c in c_lens])
    return cu_q, cu_c, q_pos, c_pos


@pytest.mark.parametrize("q_lens,c_lens", [([1], [1]), ([1, 1, 1], [3, 0, 17]), ([300, 2], [130, 260])])
def test_global_plan_equals_twin(q_lens, c_lens):
    gen = torch.Generator().manual_seed(sum(q_lens))
    cu_q, cu_c, q_pos, c_pos = global_batch(gen, q_lens, c_lens)
    T, Nc = int(cu_q[-1]), int(cu_c[-1])
    iq, iw, ik = torch.randn(T, HI, DI, generator=gen), torch.randn(T, HI, generator=gen), torch.randn(Nc, DI, generator=gen)
    plan = global_plan(cu_q, cu_c)
    scores = sparse_attention_fast.indexer_scores(iq, iw, ik, cu_q, cu_c, q_pos, c_pos, plan=plan)
    close(scores, sparse_attention_ref.indexer_scores(iq, iw, ik, cu_q, cu_c, q_pos, c_pos))
    idx = sparse_attention_ref.topk_select(scores, 16)
    q, entries = torch.randn(T, H, D, generator=gen), torch.randn(Nc, D, generator=gen)
    got = sparse_attention_fast.sparse_attention(q, entries, cu_q, cu_c, idx, 0.125, plan=plan)
    want = sparse_attention_ref.sparse_attention(q, entries, cu_q, cu_c, idx, 0.125)
    close(got[0], want[0]); close(got[1], want[1])


def assert_valid_topk(got, scores, k, slack=1e-5):
    """got (T, k) int32 is a top-k of the twin's scores (T, C) up to ``slack`` (the kernel sums in
    another order): as many entries as the twin selects, none below an unselected one, best first."""
    want = sparse_attention_ref.topk_select(scores, k)
    assert got.shape == want.shape and torch.equal(got >= 0, want >= 0)
    for t in range(scores.shape[0]):
        chosen = got[t][got[t] >= 0].long()
        rest = torch.ones(scores.shape[1], dtype=torch.bool)
        rest[chosen] = False
        rest &= torch.isfinite(scores[t])
        if chosen.numel() and rest.any():
            assert scores[t][chosen].min() >= scores[t][rest].max() - slack
        assert (scores[t][chosen].diff() <= slack).all()


@needs_ext
def test_fused_indexer_topk_on_float_keys_equals_twin():
    gen = torch.Generator().manual_seed(8)
    cu_q, cu_c, q_pos, c_pos = global_batch(gen, [1, 5, 200], [3, 0, 150])
    T, Nc = int(cu_q[-1]), int(cu_c[-1])
    for di in (DI, 12):  # 12: a head size the lane-major layout does not take (the per-entry dots)
        iq, iw, ik = torch.randn(T, HI, di, generator=gen), torch.randn(T, HI, generator=gen), torch.randn(Nc, di, generator=gen)
        scores = sparse_attention_ref.indexer_scores(iq, iw, ik, cu_q, cu_c, q_pos, c_pos)
        for k in (1, 16, 200):
            assert_valid_topk(sparse_attention_fast.indexer_topk(iq, iw, ik, cu_q, cu_c, q_pos, c_pos, k), scores, k)


def test_topk_ties_nonfinite_and_short_rows_equal_twin():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(40, 300, generator=gen)
    s[:, ::3] = 0.0  # relu ties: many exact zeros
    s[:, 200:] = float("-inf")
    s[3, 5], s[4, 7], s[5, :290] = float("nan"), float("inf"), float("-inf")
    for k in (1, 16, 64, 400):
        want = sparse_attention_ref.topk_select(s, k)
        assert torch.equal(sparse_attention_fast.topk_select_torch(s, k), want)
        if cpu_ext.available():
            assert torch.equal(torch.ops.cedar_cpu.topk_exact(s, k), want)


def test_fp4_lut_dequantize_is_bit_exact():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(257, D, generator=gen) * torch.logspace(-8, 8, 257)[:, None]
    x[3, 0], x[4, 20] = float("nan"), float("inf")
    for fmt in (GLOBAL_ROW, INDEX_ROW):
        xs = x if fmt is GLOBAL_ROW else x[:, :DI].contiguous()
        packed, scales = fp4_ref.fp4_quantize(xs, fmt)
        got, want = codec_fast.fp4_dequantize(packed, scales, fmt), fp4_ref.fp4_dequantize(packed, scales, fmt)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


# ------------------------------------------------------------------ the C++ decode kernels
@needs_ext
def test_fp8_ring_store_is_bit_identical_to_the_twin_quantizer():
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(9, D, generator=gen) * torch.logspace(-30, 30, 9)[:, None]
    rows[1, 3], rows[2, 40], rows[3, :32] = float("nan"), float("-inf"), 0.0
    rows[4, 5] = -0.0
    codes = torch.zeros(3, W, D, dtype=torch.uint8)
    scales = torch.zeros(3, W, D // 32, dtype=torch.uint8)
    ring_pos = torch.full((3, W), -1, dtype=torch.long)
    slot, pos = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2]), torch.tensor([0, 5, 130, 1, 6, 131, 2, 7, 132])
    torch.ops.cedar_cpu.fp8_ring_store(rows, slot, pos, codes, scales, ring_pos)
    want_codes, want_scales = fp8_ref.fp8_quantize(rows, WINDOW_ROW)
    assert torch.equal(codes[slot, pos % W], want_codes) and torch.equal(scales[slot, pos % W], want_scales)
    assert torch.equal(ring_pos[slot, pos % W], pos)


@needs_ext
def test_ring_attention_equals_twin_on_the_dequantized_ring():
    gen = torch.Generator().manual_seed(3)
    B, S = 5, 2 * W
    codes = torch.zeros(B + 2, S, D, dtype=torch.uint8)
    scales = torch.zeros(B + 2, S, D // 32, dtype=torch.uint8)
    ring_pos = torch.full((B + 2, S), -1, dtype=torch.long)
    slot = torch.tensor([6, 0, 3, 1, 2])
    q_pos = torch.tensor([0, 5, 127, 128, 900])
    floor = torch.tensor([0, 3, 0, 100, 850])
    for b in range(B):  # the ring holds the last S positions up to q_pos, a few missing
        ps = torch.arange(max(0, int(q_pos[b]) - S + 1), int(q_pos[b]) + 1)
        ps = ps[torch.rand(ps.shape, generator=gen) > 0.05]
        torch.ops.cedar_cpu.fp8_ring_store(torch.randn(ps.numel(), D, generator=gen), torch.full_like(ps, int(slot[b])),
                                           ps, codes, scales, ring_pos)
    q, sink = torch.randn(B, H, D, generator=gen), torch.randn(H, generator=gen)
    keys = fp8_ref.fp8_dequantize(codes[slot].view(-1, D), scales[slot].view(-1, D // 32), WINDOW_ROW)
    cu = torch.arange(B + 1, dtype=torch.int32)
    for s in (sink, None):
        plan = RingPlan(codes, scales, ring_pos, slot, torch.arange(B))
        got = window_attention_fast.window_attention(q, keys[:0], cu, cu, q_pos, q_pos[:0], W, floor, s, 0.125, plan=plan)
        want = window_attention_ref.window_attention(q, keys, cu, cu * S, q_pos, ring_pos[slot].view(-1), W, floor, s, 0.125)
        close(got[0], want[0]); close(got[1], want[1])


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _exp_neg(x: torch.Tensor) -> torch.Tensor:
    """The kernels' exp of x <= 0 (exp_neg / exp8: Cody-Waite reduction, degree-7 Taylor), the same
    float32 operations one by one."""
    x = torch.maximum(x, _f32(-87.0))
    t = x * _f32(1.44269504088896341)
    n = (t + torch.where(t >= 0, _f32(0.5), _f32(-0.5))).trunc()
    r = (x - n * _f32(0.693359375)) - n * _f32(-2.12194440e-4)
    p = torch.full_like(x, 1.0 / 5040.0)
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0):
        p = p * r + _f32(c)
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def _dots_exactly(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(A, D) x (B, D) -> (A, B) float32 dots summed as the kernels' dots() sums them (D % 8 == 0):
    8 lane sums over i (from 0.f, a product then an add a step), then ((s0 + s1) + (s2 + s3)) +
    ((s4 + s5) + (s6 + s7)) + 0.f."""
    A, D = a.shape
    prod = (a[:, None, :] * b[None, :, :]).view(A, b.shape[0], D // 8, 8)
    s = torch.zeros(A, b.shape[0], 8)
    for i in range(D // 8):
        s = s + prod[:, :, i]
    dot = ((s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])) + ((s[..., 4] + s[..., 5]) + (s[..., 6] + s[..., 7]))
    return dot + 0.0


def _attend_exactly(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row's window attention out (H, D) summed in the kernels' order: each logit a dot of
    8 lane sums over i (from 0.f), then ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) + 0.f,
    times scale; the softmax's values summed key by key from 0.f, then divided."""
    H, D = q.shape
    logits = _dots_exactly(q, keys) * _f32(scale)
    m = torch.maximum(logits.max(1).values, sink)
    p = _exp_neg(logits - m[:, None])
    denom, out = _exp_neg(sink - m), torch.zeros(H, D)
    for j in range(keys.shape[0]):
        denom = denom + p[:, j]
        out = out + p[:, j, None] * keys[j]
    return out / denom[:, None]


@needs_ext
@pytest.mark.parametrize("D,n", [(64, 29), (32, 8), (128, 17), (64, 3)])
def test_window_attention_sums_in_the_kernels_fixed_order(D, n):
    """Window attention (ragged keys) equals, bit for bit, its sums taken one by one in the order the
    kernels fix (tests/ emulation in float32 torch ops): a change in how the logits or the values are
    vectorized must keep every sum's order (served = reference depends on it). Keys 8 at a time and
    the rest one by one, with and without a full block."""
    gen = torch.Generator().manual_seed(D + n)
    H, T = 4, 3
    q, keys = torch.randn(T, H, D, generator=gen), torch.randn(n, D, generator=gen) * 2
    sink, scale = torch.randn(H, generator=gen), D ** -0.5
    q_pos = torch.tensor([n - 3, n - 2, n - 1])
    o, _ = torch.ops.cedar_cpu.window_ragged_attention(
        q, keys, torch.arange(n), torch.tensor([0, n]), torch.tensor([0]), torch.zeros(T, dtype=torch.long), q_pos,
        torch.tensor([0]), sink, -1, 128, scale)
    for t in range(T):
        seen = int(q_pos[t]) + 1
        assert torch.equal(o[t], _attend_exactly(q[t], keys[:seen], sink, scale)), t


@needs_ext
def test_pool_indexer_and_sparse_attention_equal_twins_on_dequantized_rows():
    gen = torch.Generator().manual_seed(4)
    c_lens, ratio = [1, 0, 37, 300], 2
    R = sum(c_lens) + 10
    perm = torch.randperm(R, generator=gen)[:sum(c_lens)]  # entries sit anywhere in the pool
    rows, row_scales = fp4_ref.fp4_quantize(torch.randn(R, D, generator=gen), GLOBAL_ROW)
    index_rows, index_scales = fp4_ref.fp4_quantize(torch.randn(R, DI, generator=gen), INDEX_ROW)
    cu_c = torch.tensor([0, *torch.tensor(c_lens).cumsum(0).tolist()])
    q_pos = torch.tensor([1, 9, 40, 599])
    cu_q = torch.arange(5, dtype=torch.int32)
    c_pos = torch.cat([(torch.arange(c) + 1) * ratio - 1 for c in c_lens])
    plan = PoolPlan(rows, row_scales, index_rows, index_scales, perm, cu_c, torch.arange(4), ratio)
    iq, iw = torch.randn(4, HI, DI, generator=gen), torch.randn(4, HI, generator=gen)
    ik = fp4_ref.fp4_dequantize(index_rows[perm], index_scales[perm], INDEX_ROW)
    want_scores = sparse_attention_ref.indexer_scores(iq, iw, ik, cu_q, cu_c.int(), q_pos, c_pos)
    for k_idx in (None, ik):  # index keys read from the pool in place, or given dequantized
        got = sparse_attention_fast.indexer_topk(iq, iw, k_idx, cu_q, cu_c.int(), q_pos, c_pos, 16, plan=plan)
        assert_valid_topk(got, want_scores, 16)
    idx = sparse_attention_ref.topk_select(want_scores, 16)
    q = torch.randn(4, H, D, generator=gen)
    entries = fp4_ref.fp4_dequantize(rows[perm], row_scales[perm], GLOBAL_ROW)
    got = sparse_attention_fast.sparse_attention(q, None, cu_q, cu_c.int(), idx, 0.125, plan=plan)
    want = sparse_attention_ref.sparse_attention(q, entries, cu_q, cu_c.int(), idx, 0.125)
    close(got[0], want[0]); close(got[1], want[1])


@needs_ext
def test_pool_indexer_scores_a_requests_rows_together_exactly_as_each_alone():
    """A prefill's rows of one request are scored over keys dequantized once per request, laid
    out 8 or 16 entries a vector (lane-major) and scored up to 4 rows at a time: the top-k equals,
    bit for bit, the kernel run on each row alone (and is a valid top-k of the twin's scores).
    Requests of several rows share a chunk, and a row's visible entries grow with its position
    (some see none)."""
    gen = torch.Generator().manual_seed(6)
    c_lens, q_lens, ratio = [300, 5, 120], [37, 3, 10], 2
    R = sum(c_lens) + 10
    perm = torch.randperm(R, generator=gen)[:sum(c_lens)]
    index_rows, index_scales = fp4_ref.fp4_quantize(torch.randn(R, DI, generator=gen), INDEX_ROW)
    cu_c = torch.tensor([0, *torch.tensor(c_lens).cumsum(0).tolist()])
    c_pos = torch.cat([(torch.arange(c) + 1) * ratio - 1 for c in c_lens])
    q_pos = torch.cat([torch.arange(520, 557), torch.arange(0, 3), torch.arange(100, 110)])
    row_req = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu_q[-1])
    iq, iw = torch.randn(T, HI, DI, generator=gen), torch.randn(T, HI, generator=gen)
    op = torch.ops.cedar_cpu.indexer_topk
    for k in (1, 16, 64):
        together = op(iq, iw, None, index_rows, index_scales, perm, cu_c, row_req, q_pos, c_pos, k)
        alone = torch.cat([op(iq[t:t + 1], iw[t:t + 1], None, index_rows, index_scales, perm, cu_c,
                              row_req[t:t + 1], q_pos[t:t + 1], c_pos, k) for t in range(T)])
        assert torch.equal(together, alone), k
        ik = fp4_ref.fp4_dequantize(index_rows[perm], index_scales[perm], INDEX_ROW)
        scores = sparse_attention_ref.indexer_scores(iq, iw, ik, cu_q, cu_c.int(), q_pos, c_pos)
        assert_valid_topk(together, scores, k)
    assert (together[37:40] >= 0).sum(1).tolist() == [0, 1, 1]  # positions 0-2 see entries at 1, 3, ...


@needs_ext
def test_pool_indexer_dequantizes_exactly_as_the_twin():
    """Index keys read from the FP4 pool in place (8 rows at a time where the CPU has AVX2, else
    row by row) select exactly what the same keys dequantized by the twin select: the same floats
    in, so the same scores, bit for bit. Every code, E8M0 scales from the smallest (a subnormal
    2^-127) to NaN (0xFF: its keys score NaN and are never selected), entries counts that are
    and are not multiples of 8, pool rows in any order, decode rows and a prefill's rows."""
    gen = torch.Generator().manual_seed(9)
    c_lens, q_lens = [1, 7, 8, 9, 64, 301], [1, 1, 1, 1, 1, 5]
    n, R = sum(c_lens), sum(c_lens) + 40
    codes = torch.randint(0, 256, (R, DI // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (R, DI // INDEX_ROW.group), dtype=torch.uint8, generator=gen)
    scales[:5, 0] = torch.tensor([0, 1, 254, 255, 127], dtype=torch.uint8)
    perm = torch.randperm(R, generator=gen)[:n]
    perm[:5] = torch.arange(5)  # the extreme scales are read
    cu_c = torch.tensor([0, *torch.tensor(c_lens).cumsum(0).tolist()])
    c_pos = torch.cat([torch.arange(c) * 2 + 1 for c in c_lens])
    row_req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    q_pos = torch.tensor([5, 20, 16, 100, 200, 590, 597, 600, 601, 700])
    T = row_req.numel()
    iq, iw = torch.randn(T, HI, DI, generator=gen), torch.randn(T, HI, generator=gen)
    keys = fp4_ref.fp4_dequantize(codes[perm], scales[perm], INDEX_ROW)
    assert keys[3].isnan().all() and not keys[4].isnan().any()
    op = torch.ops.cedar_cpu.indexer_topk
    for k in (1, 16, 64):
        pool = op(iq, iw, None, codes, scales, perm, cu_c, row_req, q_pos, c_pos, k)
        given = op(iq, iw, keys, codes, scales, perm, cu_c, row_req, q_pos, c_pos, k)
        assert torch.equal(pool, given), k
        assert (pool >= 0).sum().item() > 0


@needs_ext
def test_pool_indexer_selects_exactly_the_twins_top_k_where_scores_are_exact():
    """Queries, head weights and FP4 keys of few dyadic values, so every score is exact in any
    summation order: the kernel's selection equals the twin's stable top-k id for id, ties (most
    scores tie: small integers, many relu zeros) to the lower id, whatever k and however many rows
    of a request are scored together (1-5 rows, each seeing its own prefix). Rows of keys with a
    NaN scale (NaN scores) and with the largest scale (products overflow: +-inf and NaN scores) are
    never selected, and a row seeing fewer entries than k is padded with -1."""
    gen = torch.Generator().manual_seed(11)
    c_lens, q_lens = [700, 40, 3, 129], [5, 4, 2, 1]
    n = sum(c_lens)
    codes = torch.randint(0, 256, (n, DI // 2), dtype=torch.uint8, generator=gen)
    scales = torch.full((n, DI // INDEX_ROW.group), 127, dtype=torch.uint8)
    scales[5], scales[17], scales[701] = 255, 254, 255  # NaN keys; keys near 2^127
    codes[17] = 0x77  # all +6: every nonzero product overflows
    cu_c = torch.tensor([0, *torch.tensor(c_lens).cumsum(0).tolist()])
    c_pos = torch.cat([torch.arange(c) * 2 + 1 for c in c_lens])
    row_req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    q_pos = torch.tensor([1399, 1398, 900, 40, 1401, 81, 30, 79, 60, 0, 5, 300])
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    T = row_req.numel()
    iq = torch.randint(-2, 3, (T, HI, DI), generator=gen).float()
    iw = torch.tensor([[1.0, -0.5], [-0.5, -1.0], [-1.0, 2.0], [1.0, 1.0]]).repeat(3, 1)  # row 1: all scores <= 0
    keys = fp4_ref.fp4_dequantize(codes, scales, INDEX_ROW)
    scores = sparse_attention_ref.indexer_scores(iq, iw, keys, cu_q, cu_c.int(), q_pos, c_pos)
    assert (scores == 0).sum() > 500 and scores.isnan().any() and scores.isinf().any()
    op = torch.ops.cedar_cpu.indexer_topk
    for k in (1, 15, 16, 17, 32, 64, 300):
        want = sparse_attention_ref.topk_select(scores, k)
        assert torch.equal(op(iq, iw, None, codes, scales, torch.arange(n), cu_c, row_req, q_pos, c_pos, k), want), k
        assert torch.equal(op(iq, iw, keys, codes, scales, torch.arange(n), cu_c, row_req, q_pos, c_pos, k), want), k
    assert (want[9] >= 0).sum() == 0 and (want[10] >= 0).sum() == 3  # position 0 sees no entry; 5 sees 1, 3, 5


@needs_ext
def test_cpp_quantizers_are_bit_identical_to_the_twins():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, D, generator=gen) * torch.logspace(-40, 38, 300)[:, None]
    x[3, 0], x[4, 20], x[5, 33], x[6, :] = float("nan"), float("inf"), float("-inf"), 0.0
    x[7, 1], x[8, :16] = -0.0, 1e-30  # a group whose E4M3 scale flushes to zero
    got, want = codec_fast.fp8_quantize(x, WINDOW_ROW), fp8_ref.fp8_quantize(x, WINDOW_ROW)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for fmt, xs in ((GLOBAL_ROW, x), (INDEX_ROW, x[:, :DI].contiguous())):
        got, want = codec_fast.fp4_quantize(xs, fmt), fp4_ref.fp4_quantize(xs, fmt)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fmt


@needs_ext
def test_cpp_merge_equals_twin_with_empty_sides():
    gen = torch.Generator().manual_seed(6)
    oa, ob = torch.randn(7, H, D, generator=gen), torch.randn(7, H, D, generator=gen)
    la, lb = torch.randn(7, H, generator=gen) * 5, torch.randn(7, H, generator=gen) * 5
    la[0], lb[1], la[2], lb[2] = float("-inf"), float("-inf"), float("-inf"), float("-inf")
    oa[0], ob[1], oa[2], ob[2] = 0, 0, 0, 0
    got, want = merge_fast.merge_states(oa, la, ob, lb), merge_ref.merge_states(oa, la, ob, lb)
    close(got[0], want[0]); close(got[1], want[1])


@needs_ext
def test_cpp_norm_and_rope_equal_the_torch_modules():
    from cedar.backend.modules import RMSNorm, Rope, apply_rope

    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(D, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=gen))
    x = torch.randn(33, H, D, generator=gen)
    with torch.no_grad():
        want = norm(x)
        norm.fast = True
        close(norm(x), want)
        pos = torch.randint(0, 16384, (33,), generator=gen)
        for inverse in (False, True):
            want = apply_rope(x, Rope.of(pos, D, 16, 10000.0), 16, 10000.0, inverse)
            close(apply_rope(x, Rope.of(pos, D, 16, 10000.0, fast=True), 16, 10000.0, inverse), want)


@needs_ext
@pytest.mark.parametrize("layer_id", [0, 1, 5])  # a window-only layer, a full one (indexer), a reader
@pytest.mark.parametrize("rows", [1, 3, 130])
def test_fused_layer_projections_and_tail_are_bit_identical_to_the_composition(layer_id, rows):
    """CEDLayer.project / .tail in one C++ call each run the same ops as the composition on the
    fast path (C++ norms, RoPE and few-row matmuls): the same bits, with and without the window
    rows (1 and 3 rows: the C++ matmul; 130: at::linear)."""
    from cedar.backend.config import CEDConfig
    from cedar.backend.layer import CEDLayer
    from cedar.backend.modules import RMSNorm, Rope, SwiGLU

    cfg = CEDConfig(vocab_size=64, hidden_size=128, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4,
                    kv_latent_dim=64, rope_dim=16, index_head_dim=32, index_num_heads=2, index_topk=8,
                    compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4),
                    index_source_layer_ids=(1, 4, 6), sliding_window=128)
    torch.manual_seed(layer_id * 100 + rows)
    layer = CEDLayer(cfg, layer_id)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    h = torch.randn(rows, cfg.hidden_size)
    o = torch.randn(rows, cfg.num_attention_heads, cfg.kv_latent_dim)
    pos = torch.randint(0, 16384, (rows,))
    fast = Rope.of(pos, cfg.kv_latent_dim, cfg.rope_dim, cfg.rope_theta, fast=True)
    slow = Rope.of(pos, cfg.kv_latent_dim, cfg.rope_dim, cfg.rope_theta)
    with torch.no_grad():
        ref = layer.project(h, slow)  # the pure-torch twin
        ref_out = layer.tail(h, o, slow)
        for m in layer.modules():
            if isinstance(m, (RMSNorm, SwiGLU)):
                m.fast = True
        hn = layer.attn_norm(h)  # the composition on the fast path: C++ norms, RoPE and matmuls
        want_q, want_kv = layer.queries(hn, fast), layer.window_kv(hn, fast)
        h1 = h + layer.attn_output(o, fast)
        want_out = h1 + layer.mlp(layer.mlp_norm(h1))
        for window in (True, False):
            got = layer.project(h, fast, window=window)
            assert torch.equal(got.q, want_q)
            assert (got.kv is None) != window and (not window or torch.equal(got.kv, want_kv))
            assert (got.iq is None) == (not layer.has_indexer)
            if layer.has_indexer:
                want_iq, want_iw = layer.index_queries(hn)
                assert torch.equal(got.iq, want_iq) and torch.equal(got.iw, want_iw)
                close(got.iw, ref.iw)
            close(got.q, ref.q)  # and the twin within the C++ norm's tolerance
        got_out = layer.tail(h, o, fast)
    assert torch.equal(got_out, want_out)
    close(got_out, ref_out)
    with torch.enable_grad():  # training keeps the torch ops (autograd)
        assert layer.tail(h, o, fast).requires_grad


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_cpp_rope_tables_and_rotation_are_bit_identical_to_torch(rows):
    """Rope.of in one C++ call (the same ATen ops) gives the same tables, and the C++ rotation the
    same bits as the torch formula (no FMA contraction): the compressor may use either."""
    from cedar.backend.modules import Rope, apply_rope

    gen = torch.Generator().manual_seed(rows)
    pos = torch.randint(0, 16384, (rows,), generator=gen)
    x = torch.randn(rows, H, D, generator=gen)
    with torch.no_grad():
        fast, slow = Rope.of(pos, D, 16, 10000.0, fast=True), Rope.of(pos, D, 16, 10000.0)
        for a, b in ((fast.cos, slow.cos), (fast.sin, slow.sin), (fast.sin_inverse, slow.sin_inverse)):
            assert torch.equal(a, b)
        for inverse in (False, True):
            assert torch.equal(apply_rope(x, fast, 16, 10000.0, inverse), apply_rope(x, slow, 16, 10000.0, inverse))
            assert torch.equal(apply_rope(x[:, 0], fast, 16, 10000.0, inverse),
                               apply_rope(x[:, 0], slow, 16, 10000.0, inverse))


def _mixed_decode_steps(model, weights: str = "float32"):
    """Thirteen requests prefilled (37, 300 and 64 tokens: one past the window; ten of 20-29),
    then 6 served decode steps of 1 and 13 requests (more than 8 rows: the packed weights' tiles of
    4 rows and their remainder) at odd and even positions -> (each step's StepOutput, pools,
    slots). weights: the serving flag (bf16: the model's projection weights rounded at allocation)."""
    from cedar.backend.serving.driver import Driver, Req
    from cedar.backend.serving.planner import ServingFlags

    lens = (37, 300, 64) + tuple(range(20, 30))
    d = Driver(model, ServingFlags(weights=weights), num_slots=4096, num_reqs=len(lens))
    reqs = [Req(f"r{b}", b, [8 + (7 * b + 3 * i) % 400 for i in range(n)]) for b, n in enumerate(lens)]
    for r in reqs:
        d.run([(r, len(r.ids))])
    outs = []
    for step in range(6):
        batch = reqs if step % 2 else reqs[:1]
        for r in batch:
            r.ids.append(9 + step)
        outs.append(d.run([(r, 1) for r in batch]))
    return outs, d.rt.pools, d.rt.slots


def _assert_same_caches(cfg, pa, sa, pb, sb):
    """Every ring row and position, pool row, scale and index row, and compressor tail equal."""
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(sa.ring_rows[layer], sb.ring_rows[layer]) and torch.equal(sa.ring_pos[layer], sb.ring_pos[layer])
    for s in pa.sources:
        for name in ("rows", "row_scales", "index_rows", "index_scales"):
            assert torch.equal(getattr(pa.sources[s], name), getattr(pb.sources[s], name)), (s, name)
    for s in sa.tail_kv:
        assert torch.equal(sa.tail_kv[s], sb.tail_kv[s]) and torch.equal(sa.tail_gate[s], sb.tail_gate[s])
        assert torch.equal(sa.tail_len[s], sb.tail_len[s])


@needs_ext
def test_a_decode_steps_one_call_path_is_bit_identical_to_the_per_kernel_path(monkeypatch):
    """PoolKeys' one-call decode path (a layer's attention in one ``decode_attention`` call: ring
    store, window attention, top-k, sparse attention, merge; a source's compressor in one
    ``compress_decode`` call) against the per-kernel path (``window_keys``, the model's kernels
    and ``write_global``'s torch ops one by one) on the same served decode steps: requests at odd and even
    positions (a compression group completing or not), one past the window, batches of 1 and 3,
    each step's hidden rows and every ring and pool byte equal."""
    from cedar.backend.geometries import cedar_tiny
    from cedar.backend.model_io import random_model
    from cedar.backend.serving import native_step
    from cedar.backend.serving.pool_keys import PoolKeys

    cfg = cedar_tiny()
    model = random_model(cfg, seed=5).eval().use_kernels(KernelSet.for_device("cpu"))
    monkeypatch.setattr(native_step, "ENABLED", False)  # NOTE: the layer loop in Python (the native call's own test is below)
    runs, fused_calls = [], []
    attend = PoolKeys.attend_in_place
    for fused in (True, False):
        if fused:  # counted: the one-call path must run (a test that never took it proves nothing)
            monkeypatch.setattr(PoolKeys, "attend_in_place",
                                lambda self, *a, **k: fused_calls.append(attend(self, *a, **k)) or fused_calls[-1])
        else:
            monkeypatch.setattr(PoolKeys, "ONE_CALL", False)
        runs.append(_mixed_decode_steps(model))
    (a, pa, sa), (b, pb, sb) = runs
    assert sum(o is not None for o in fused_calls) == 6 * cfg.num_hidden_layers  # every decode step's layers
    for x, y in zip(a, b):
        assert torch.equal(x.hidden, y.hidden)
    _assert_same_caches(cfg, pa, sa, pb, sb)


def _mixed_extends(model):
    """Multi-row forwards of every kind: three prefills in one forward (37, 130 and 64 tokens), a
    chunk after each (a ring already written, a batch of 3), a chunk past the window, then two
    prefix hits with 16 and 3 new tokens (replayed rows over a ring another request wrote) ->
    (each forward's StepOutput, pools, slots)."""
    from cedar.backend.serving.driver import Driver, Req

    d = Driver(model, num_slots=8192, num_reqs=5)
    reqs = [Req(f"r{b}", b, [8 + (7 * b + 3 * i) % 400 for i in range(n)]) for b, n in enumerate((37, 130, 64))]
    outs = [d.run([(r, len(r.ids)) for r in reqs])]
    for r, n in zip(reqs, (20, 5, 150)):
        r.ids += [9 + (5 * i) % 300 for i in range(n)]
    outs.append(d.run([(r, n) for r, n in zip(reqs, (20, 5, 150))]))
    reqs[1].ids += [11 + i for i in range(200)]
    outs.append(d.run([(reqs[1], 200)]))
    for slot, (P, n) in enumerate(((300, 16), (212, 3)), start=3):
        hit = Req(f"h{slot}", slot, reqs[1].ids[:P] + [17 + i for i in range(n)], token_slots=reqs[1].token_slots[:P])
        outs.append(d.run([(hit, n)]))
    # a new request on r2's slot, hitting its first 180 tokens (the slot is reset: r2's rows unread)
    again = Req("r2b", 2, reqs[2].ids[:180] + [23 + i for i in range(40)], token_slots=reqs[2].token_slots[:180])
    outs.append(d.run([(again, 40)]))
    return outs, d.rt.pools, d.rt.slots


@needs_ext
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_keys_op_is_the_codec_and_index_ops(seed):
    """``cedar_cpu::fp8_window_keys`` on random rings against the torch ops it replaces: keys are
    the twin's FP8 round trip of new rows and decode of ring rows (NaN scales included), laid out
    by ``perm``; a ring row written at or after its request's first new position reads as -1; the
    kept rows' codes, scales and positions land in the rings, after every ring row was read."""
    from cedar.kernels import fp8_ref
    from cedar.kernels.formats import WINDOW_ROW

    gen = torch.Generator().manual_seed(seed)
    T, D, R, S, B = 40, 64, 6, 8, 3
    kv = torch.randn(T, D, generator=gen) * 3
    kv[5, :32] = float("nan")  # a poisoned group
    rows = torch.randint(0, 256, (R * S, D), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (R * S, D // 32), generator=gen, dtype=torch.uint8)
    scales[3, 1] = 0xFF
    ring_pos = torch.randint(-1, 90, (R * S,), generator=gen)
    ring_src = torch.randint(0, R * S, (B * S,), generator=gen)
    ring_first = torch.randint(0, 90, (B * S,), generator=gen)
    perm = torch.randperm(T + B * S, generator=gen)[:T + B * S - 5]
    write_dst = torch.randperm(R * S, generator=gen)[:12]
    write_src = torch.randint(0, T, (12,), generator=gen)
    pos = torch.randint(0, 200, (T,), generator=gen)
    want_rows, want_scales, want_pos = rows.clone(), scales.clone(), ring_pos.clone()
    codes, cs = fp8_ref.fp8_quantize(kv, WINDOW_ROW)
    new = fp8_ref.fp8_dequantize(codes, cs, WINDOW_ROW)
    old = fp8_ref.fp8_dequantize(rows[ring_src], scales[ring_src], WINDOW_ROW)
    old_pos = torch.where(ring_pos[ring_src] < ring_first, ring_pos[ring_src], -1)
    want_keys, want_key_pos = torch.cat([new, old])[perm], torch.cat([pos, old_pos])[perm]
    want_rows[write_dst], want_scales[write_dst], want_pos[write_dst] = codes[write_src], cs[write_src], pos[write_src]
    keys, key_pos = torch.ops.cedar_cpu.fp8_window_keys(kv, ring_src, ring_first, perm, write_src, write_dst, pos,
                                                        rows, scales, ring_pos)
    assert torch.equal(keys.isnan(), want_keys.isnan()) and keys.isnan().any()
    assert torch.equal(keys.nan_to_num(), want_keys.nan_to_num()) and torch.equal(key_pos, want_key_pos)
    assert (key_pos == -1).any() and (old_pos >= 0).any()
    assert torch.equal(rows, want_rows) and torch.equal(scales, want_scales) and torch.equal(ring_pos, want_pos)


@needs_ext
@pytest.mark.parametrize("geometry", ["cedar-tiny", "cedar-agent"])
def test_a_prefills_window_keys_in_one_call_are_bit_identical_to_the_torch_ops(monkeypatch, geometry):
    """``cedar_cpu::fp8_window_keys`` (a multi-row forward's window keys: new rows encoded and
    decoded, ring rows decoded with their positions, laid out, the kept rows stored) against the
    same steps as torch ops, over prefills, chunks, a batch, a chunk past the window and prefix
    hits with replayed rows: every forward's hidden rows and every ring and pool byte equal; and
    the one-call path is what ran (counted)."""
    from cedar.backend.geometries import cedar_tiny, geometry as named
    from cedar.backend.model_io import random_model
    from cedar.backend.serving.pool_keys import PoolKeys

    cfg = cedar_tiny() if geometry == "cedar-tiny" else named(geometry)
    model = random_model(cfg, seed=11).eval().use_kernels(KernelSet.for_device("cpu"))
    runs, calls = [], []
    op = torch.ops.cedar_cpu.fp8_window_keys
    for native in (True, False):
        if native:
            monkeypatch.setattr(torch.ops.cedar_cpu, "fp8_window_keys", lambda *a: calls.append(1) or op(*a),
                                raising=False)
        else:
            monkeypatch.setattr(PoolKeys, "NATIVE_WINDOW", False)
        runs.append(_mixed_extends(model))
    (a, pa, sa), (b, pb, sb) = runs
    assert len(calls) == 6 * cfg.num_hidden_layers  # every forward's layers (no decode step here)
    for x, y in zip(a, b):
        assert torch.equal(x.decoded, y.decoded) and x.decoded.any() and torch.equal(x.hidden, y.hidden)
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(sa.ring_scales[layer], sb.ring_scales[layer])
    _assert_same_caches(cfg, pa, sa, pb, sb)


@needs_ext
@pytest.mark.parametrize("geometry, weights", [("cedar-tiny", "float32"), ("cedar-agent", "float32"),
                                               ("cedar-agent", "bf16")])
def test_a_decode_step_in_one_native_call_is_bit_identical_to_the_per_layer_path(monkeypatch, geometry, weights):
    """``cedar_cpu::decode_step`` (the layer loop and the cut in C++) against ``run_layers`` over
    PoolKeys' one-call path on the same served decode steps: batches of 1 and 3, groups completing
    or not, a context past the window; every step's hidden rows, ring, pool, tail and stored
    encoder-output byte equal; and the native call is what ran (counted). With bf16 weights the
    native call reads bfloat16 copies, the per-layer path the rounded float32 weights."""
    from cedar.backend.geometries import cedar_tiny, geometry as named
    from cedar.backend.model_io import random_model
    from cedar.backend.serving import native_step

    cfg = cedar_tiny() if geometry == "cedar-tiny" else named(geometry)
    model = random_model(cfg, seed=7).eval().use_kernels(KernelSet.for_device("cpu"))
    runs, native_calls = [], []
    decode = native_step.native_decode
    for native in (True, False):
        if native:
            monkeypatch.setattr(native_step, "native_decode",
                                lambda *a: native_calls.append(1) or decode(*a))
            monkeypatch.setattr("cedar.backend.serving.step.native_decode", native_step.native_decode)
        else:
            monkeypatch.setattr(native_step, "ENABLED", False)
        runs.append(_mixed_decode_steps(model, weights))
    (a, pa, sa), (b, pb, sb) = runs
    nw = native_step.native_weights(model)
    assert (nw.bf16 is not None) == (weights == "bf16")
    if nw.bf16 is not None:  # what the native call read: bf16 projections, the rest as they were
        assert {t.dtype for i, t in enumerate(nw.bf16) if t is not None and i % native_step.NW in native_step.LINEAR} \
            == {torch.bfloat16}
        assert nw.bf16[0] is nw.tensors[0] and nw.tensors[1].dtype == torch.float32
    else:  # what it read: the projections packed where their sizes allow (pack_rows), the rest as they were
        assert nw.packed[1].dim() == 4 and nw.packed[0] is nw.tensors[0]
    assert len(native_calls) == 6  # every decode step, and no prefill
    for x, y in zip(a, b):
        assert torch.equal(x.decoded, y.decoded) and x.decoded.all() and torch.equal(x.hidden, y.hidden)
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(sa.ring_scales[layer], sb.ring_scales[layer])
    _assert_same_caches(cfg, pa, sa, pb, sb)
    assert torch.equal(sa.enc_out, sb.enc_out) and torch.equal(sa.enc_pos, sb.enc_pos)


@pytest.mark.parametrize("T", [0, 1, 5])
def test_the_cuts_rows_are_those_of_the_concatenation_without_building_it(T):
    """``rows_of_cut``: the decoder's rows of cat(this forward's rows, the kept encoder outputs),
    read by two gathers; for any indices (own rows, kept rows, repeats, any order) the same
    values as indexing the concatenation, and no row of the kept outputs is copied but those
    asked for (the result is sized by the indices)."""
    from cedar.backend.serving.pool_keys import rows_of_cut

    g = torch.Generator().manual_seed(T)
    h, enc_out = torch.randn(T, 16, generator=g), torch.randn(4 * 8, 16, generator=g)
    for n in (0, 1, 7, 40):
        src = torch.randint(0, T + enc_out.shape[0], (n,), generator=g)
        got = rows_of_cut(h, enc_out, src)
        assert got.shape == (n, 16) and torch.equal(got, torch.cat([h, enc_out])[src])
    if T:  # one own row and one kept row, each exactly where it was
        got = rows_of_cut(h, enc_out, torch.tensor([T - 1, T + 3]))
        assert torch.equal(got[0], h[T - 1]) and torch.equal(got[1], enc_out[3])


@needs_ext
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 13, 16, 17])
@pytest.mark.parametrize("n, k", [(2, 256), (32, 64), (256, 256), (512, 256), (2048, 256), (7, 12)])
def test_few_row_linear_is_the_matmul_and_does_not_depend_on_the_threads(rows, n, k):
    """``cedar_cpu::linear``: x @ w.T within float32 summation error; for more than 16 rows or an
    inner size it does not vectorize, exactly ``at::linear``; its own results the same bits on 1 and
    2 threads."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.cedar_cpu.linear(x, w)
        torch.set_num_threads(2)
        two = torch.ops.cedar_cpu.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    want = torch.nn.functional.linear(x, w)
    assert one.shape == want.shape == (rows, n)
    if rows > 16 or k % 8:  # NOTE: MKL's own bits may depend on the threads
        assert torch.equal(two, want)
    else:
        assert torch.equal(one, two)
        assert rows == 0 or (one - want).abs().max().item() <= 1e-4
        assert torch.equal(torch.ops.cedar_cpu.linear(x.t().contiguous().t(), w), one)  # strided rows: the same


@needs_ext
@pytest.mark.parametrize("n, k", [(256, 256), (2048, 256), (300, 64), (12, 512), (2, 256), (7, 40)])
def test_few_row_linear_sums_in_dots_fixed_order_whatever_the_rows(n, k):
    """``cedar_cpu::linear`` of 1-16 rows equals, bit for bit, each output summed in dots()'s order
    (tests/ emulation in float32 torch ops): a decode step's projections keep one order however
    they are tiled (8 outputs of up to 4 rows at once on AVX-512, the last n % 8 one by one), and a
    row's outputs do not depend on which other rows share its call."""
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(8, k, generator=gen), torch.randn(n, k, generator=gen)
    x = torch.cat([x, torch.randn(8, k, generator=gen)])
    want = _dots_exactly(x, w)
    for rows in range(1, 17):
        assert torch.equal(torch.ops.cedar_cpu.linear(x[:rows], w), want[:rows]), rows
        assert torch.equal(torch.ops.cedar_cpu.linear(x[16 - rows:], w), want[16 - rows:]), rows


@needs_ext
def test_a_projection_changed_in_place_is_packed_again_for_the_next_decode_step():
    """The packed copies a decode step reads follow the model's weights: an in-place update
    (a version counter moved) repacks them; nothing changed, the same copies are read."""
    from cedar.backend.geometries import cedar_tiny
    from cedar.backend.model_io import random_model
    from cedar.backend.modules import pack_rows
    from cedar.backend.serving.native_step import native_weights

    model = random_model(cedar_tiny(), seed=3).eval().use_kernels(KernelSet.for_device("cpu"))
    before = native_weights(model)
    assert native_weights(model).packed[1] is before.packed[1]
    with torch.no_grad():
        model.layers[0].wq.weight.mul_(2)
    after = native_weights(model)
    assert torch.equal(after.packed[1], pack_rows(model.layers[0].wq.weight))
    assert not torch.equal(after.packed[1], before.packed[1])


@needs_ext
def test_a_per_layer_forward_of_few_rows_reads_the_decode_steps_packed_copies_and_follows_in_place_changes():
    """A per-layer forward of up to LINEAR_ROWS rows (a short prompt's, a decode step's LM head)
    reads the same packed copy a decode step's native call does (one copy a weight, kept
    on it), with the unpacked weight's bits; an in-place update, or a storage swapped through
    ``.data``, is read at the next call; more rows read the weight itself (at::linear)."""
    from cedar.backend.geometries import cedar_tiny
    from cedar.backend.model_io import random_model
    from cedar.backend.modules import LINEAR_ROWS, linear, matmul_weight, pack_rows
    from cedar.backend.serving.native_step import native_weights

    model = random_model(cedar_tiny(), seed=5).eval().use_kernels(KernelSet.for_device("cpu"))
    wq = model.layers[0].wq
    assert matmul_weight(wq.weight, LINEAR_ROWS) is native_weights(model).packed[1]
    assert matmul_weight(wq.weight, LINEAR_ROWS + 1) is wq.weight
    x = torch.randn(LINEAR_ROWS + 1, wq.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (1, 5, LINEAR_ROWS):
            assert torch.equal(linear(x[:rows], wq, True), torch.ops.cedar_cpu.linear(x[:rows], wq.weight)), rows
        before = linear(x[:4], wq, True)
        wq.weight.add_(1.0)
        after = linear(x[:4], wq, True)
        assert not torch.equal(after, before)
        assert torch.equal(after, _dots_exactly(x[:4], wq.weight))
        assert torch.equal(matmul_weight(wq.weight, 4), pack_rows(wq.weight))
        wq.weight.data = 3 * wq.weight.detach()  # a swapped storage leaves the counter as it was
        assert torch.equal(matmul_weight(wq.weight, 4), pack_rows(wq.weight))
        assert torch.equal(linear(x, wq, True), torch.nn.functional.linear(x, wq.weight))


@needs_ext
@pytest.mark.parametrize("n, k", [(256, 256), (512, 256), (64, 512), (8, 8)])
def test_packed_linear_is_the_unpacked_linear_bit_for_bit(n, k):
    """A decode step's packed projection weights (``modules.pack_rows``: 8 outputs' values
    side by side, read 4 rows by 8 outputs at a time) give the unpacked weight's bits at 1-16 rows,
    and dots()'s order at any row count; a weight that does not pack stays as it was; a packed
    weight against rows of another width is refused with a message."""
    from cedar.backend.modules import pack_rows

    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(19, k, generator=gen), torch.randn(n, k, generator=gen)
    packed = pack_rows(w)
    assert packed.shape == (n // 8, k // 8, 8, 8) and torch.equal(packed[0, 0, 1], w[1, :8])
    want = _dots_exactly(x, w)
    for rows in range(1, 20):
        got = torch.ops.cedar_cpu.linear(x[:rows], packed)
        assert torch.equal(got, want[:rows]), rows
        if rows <= 16:
            assert torch.equal(got, torch.ops.cedar_cpu.linear(x[:rows], w)), rows
    odd = torch.randn(2, k, generator=gen)
    assert pack_rows(odd) is odd
    with pytest.raises(RuntimeError, match="packed weight"):
        torch.ops.cedar_cpu.linear(torch.randn(2, k + 8), packed)


@needs_ext
def test_the_lm_head_reads_a_decode_steps_rows_natively_and_sglang_reaches_the_same_forward():
    from types import SimpleNamespace

    from sglang.srt.layers.logits_processor import LogitsProcessor, should_apply_lm_head_quant_method

    from cedar.backend.modules import LMHead
    from cedar.backend.serving.served_model import HeadMethod

    torch.manual_seed(0)
    head = LMHead(64, 300, bias=False)
    head.fast = True
    few, many = torch.randn(3, 64), torch.randn(20, 64)
    with torch.no_grad():
        native = head(few)
        assert torch.equal(native, torch.ops.cedar_cpu.linear(few, head.weight))  # the native few-row path
        assert (native - torch.nn.functional.linear(few, head.weight)).abs().max() <= 1e-4
        assert torch.equal(head(many), torch.nn.functional.linear(many, head.weight))  # many rows: at::linear
        head.fast = False
        assert torch.equal(head(few), torch.nn.functional.linear(few, head.weight))  # other backends: nn.Linear
        head.fast = True
    assert torch.equal(head(few), torch.nn.functional.linear(few, head.weight))  # autograd (training): nn.Linear
    # SGLang's LogitsProcessor multiplies through the head's quant_method, i.e. the head's own forward
    head.quant_method = HeadMethod()
    assert should_apply_lm_head_quant_method(head, head.quant_method)
    with torch.no_grad():
        served = LogitsProcessor._compute_lm_head(SimpleNamespace(), few, head)
    assert torch.equal(served, native)
