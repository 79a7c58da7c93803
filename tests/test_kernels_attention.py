"""Attention and cache-write kernels vs their pure-torch twins, plus metamorphic checks.

Every Triton launcher is compared with its twin over a small grid of awkward shapes (rows 1, 3,
127-131; keys around the window edge W = 128; entry counts 1, 3, 17; ragged batches; replay
floors cutting the window; empty key sets). The metamorphic checks hold for both backends:
window attention == plain softmax over the visible keys; merge(A, B) == attention over A ++ B;
sparse attention with top-k = every visible entry == dense causal attention over the entries.

On CPU the kernels run in the Triton interpreter (tests/conftest.py); on a GPU natively.
"""

from __future__ import annotations

import pytest
import torch

from cedar.kernels import cache_write_ref, cache_write_triton, merge_ref, merge_triton
from cedar.kernels import sparse_attention_ref, sparse_attention_triton
from cedar.kernels import window_attention_ref, window_attention_triton
from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW

pytestmark = pytest.mark.kernels

# dtype -> tolerances for kernel-vs-twin and kernel-vs-plain comparisons (fp32 math everywhere;
# online softmax and a different summation order cost a few ulp; measured max errors are ~1e-6)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5)}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W = 128
D = 64  # cedar-tiny latent
DI = 32  # cedar-tiny index-key dim
NEG_INF = float("-inf")

BACKENDS = {
    "torch": dict(window=window_attention_ref.window_attention, merge=merge_ref.merge_states,
                  scores=sparse_attention_ref.indexer_scores, topk=sparse_attention_ref.topk_select,
                  sparse=sparse_attention_ref.sparse_attention),
    "triton": dict(window=window_attention_triton.window_attention, merge=merge_triton.merge_states,
                   scores=sparse_attention_triton.indexer_scores, topk=sparse_attention_triton.topk_select,
                   sparse=sparse_attention_triton.sparse_attention),
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """NOTE: these tests run many tiny torch ops; on a shared 2-core machine intra-op threads
    oversubscribe the cores and make the file ~8x slower. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Same -inf pattern, then |got - want| <= atol + rtol |want| on the finite entries; a failure
    prints the max and mean error."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    tol = TOL[want.dtype]
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_got, inf_want), f"{name}: -inf at {int((inf_got != inf_want).sum())} differing places"
    assert torch.equal(got[inf_got], want[inf_want]), f"{name}: infinities of different sign"
    fin = ~inf_want
    err = (got[fin] - want[fin]).abs()
    bound = tol["atol"] + tol["rtol"] * want[fin].abs()
    if err.numel() and not bool((err <= bound).all()):
        pytest.fail(f"{name}: max err {err.max().item():.3e}, mean err {err.mean().item():.3e}, "
                    f"{int((err > bound).sum())}/{err.numel()} over atol={tol['atol']} rtol={tol['rtol']}")


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, device=DEVICE).cumsum(0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE)


# ---------------------------------------------------------------- batch builders


def window_batch(q_lens, k_lens, heads, floor_cut, seed, lasts=None):
    """Ragged window batch: request b's queries are its last q_len positions (ending at lasts[b],
    default 300 + 17 b); its keys cover the k_len positions up to the last query, stored shuffled
    (a ring) with ~1/8 empty slots (-1), and negative positions (before the sequence) empty too.
    floor_cut[b] = how far into the first query's window the replay floor lies (0: no cut)."""
    g = gen(seed)
    q_pos, k_pos, floors = [], [], []
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        last = 300 + 17 * b if lasts is None else lasts[b]
        q_pos.append(torch.arange(last - nq + 1, last + 1))
        kp = torch.arange(last - nk + 1, last + 1)[torch.randperm(nk, generator=g)]
        kp[(torch.rand(nk, generator=g) < 0.125) | (kp < 0)] = -1
        k_pos.append(kp)
        floors.append(max(0, last - nq + 1 - W + 1 + floor_cut[b]))
    return dict(q=randn(g, sum(q_lens), heads, D), k=randn(g, sum(k_lens), D),
                cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens),
                q_pos=torch.cat(q_pos).to(DEVICE), k_pos=torch.cat(k_pos).to(DEVICE), window=W,
                window_floor=torch.tensor(floors, device=DEVICE), sink=randn(g, heads), scale=D**-0.5)


def global_batch(q_lens, c_lens, heads, seed, ratio=4):
    """Ragged global batch: entry c of a request becomes visible at position (c + 1) * ratio - 1;
    queries sit at the request's last q_len positions, which end inside the last entry's group."""
    g = gen(seed)
    q_pos, c_pos = [], []
    for nq, nc in zip(q_lens, c_lens):
        last = max(nc * ratio - 2, nq - 1)  # NOTE: the newest entry is not complete yet
        q_pos.append(torch.arange(last - nq + 1, last + 1))
        c_pos.append(torch.arange(1, nc + 1) * ratio - 1)
    T, Nc = sum(q_lens), sum(c_lens)
    return dict(q_idx=randn(g, T, 2, DI), w_idx=randn(g, T, 2), k_idx=randn(g, Nc, DI),
                cu_seqlens_q=cu(q_lens), cu_seqlens_c=cu(c_lens), q_pos=torch.cat(q_pos).to(DEVICE),
                c_pos=torch.cat(c_pos).to(DEVICE), q=randn(g, T, heads, D), entries=randn(g, Nc, D),
                scale=D**-0.5)


def scores_args(bt):
    return [bt[n] for n in ("q_idx", "w_idx", "k_idx", "cu_seqlens_q", "cu_seqlens_c", "q_pos", "c_pos")]


# ---------------------------------------------------------------- plain references (inline)


def plain_attention(q_row, keys, sink, scale):
    """q_row (H, D), keys (n, D) (K = V), sink (H,) or None -> out (H, D), lse (H,); plain softmax."""
    logits = q_row @ keys.T * scale  # (H, n)
    if sink is not None:
        logits = torch.cat([logits, sink[:, None]], dim=1)
    if logits.shape[1] == 0:
        return torch.zeros_like(q_row), torch.full(q_row.shape[:1], NEG_INF, device=q_row.device)
    p = torch.softmax(logits, dim=1)[:, : keys.shape[0]]
    return p @ keys, torch.logsumexp(logits, dim=1)


def visible_window_keys(a, b, i):
    ks, ke = int(a["cu_seqlens_k"][b]), int(a["cu_seqlens_k"][b + 1])
    kp, qp = a["k_pos"][ks:ke], int(a["q_pos"][i])
    lo = max(int(a["window_floor"][b]), qp - a["window"] + 1)
    return a["k"][ks:ke][(kp >= 0) & (kp >= lo) & (kp <= qp)]


def visible_entries(bt, b, i):
    cs, ce = int(bt["cu_seqlens_c"][b]), int(bt["cu_seqlens_c"][b + 1])
    return bt["entries"][cs:ce][bt["c_pos"][cs:ce] <= bt["q_pos"][i]]


def plain_rows(q, cu_seqlens_q, keys_of, sink, scale):
    """Stack plain_attention over every query row; keys_of(b, i) -> (n, D) visible keys."""
    outs, lses = [], []
    for b in range(cu_seqlens_q.numel() - 1):
        for i in range(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])):
            o, l = plain_attention(q[i], keys_of(b, i), sink, scale)
            outs.append(o)
            lses.append(l)
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------- window attention

WINDOW_CASES = [  # (q_lens, k_lens, heads, floor_cut per request, last query positions or None)
    ([1], [128], 4, [0], None),  # decode, a full window
    ([1, 1, 1], [127, 129, 257], 4, [0, 60, 0], None),  # ragged decode around the window edge
    ([3, 131], [129, 257], 4, [0, 40], None),  # extend: prime rows, keys past the window, floor cut
    ([127, 128], [128, 127], 1, [0, 100], [126, 400]),  # a prefill from position 0
    ([129, 1, 3], [257, 0, 3], 4, [5, 0, 0], [128, 50, 60]),  # a request with no keys at all
]


@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=[f"q{c[0]}-k{c[1]}-h{c[2]}" for c in WINDOW_CASES])
def test_window_attention_matches_twin_and_plain(case, with_sink):
    q_lens, k_lens, heads, cut, lasts = case
    a = window_batch(q_lens, k_lens, heads, cut, seed=len(q_lens) * 1000 + sum(q_lens), lasts=lasts)
    if not with_sink:
        a["sink"] = None
    out, lse = window_attention_triton.window_attention(**a)
    want_out, want_lse = plain_rows(a["q"], a["cu_seqlens_q"], lambda b, i: visible_window_keys(a, b, i),
                                    a["sink"], a["scale"])
    assert_close("window out vs plain", out, want_out)
    assert_close("window lse vs plain", lse, want_lse)
    if with_sink or 0 not in k_lens:  # NOTE: the twin crashes on an empty key set without a sink
        ref_out, ref_lse = window_attention_ref.window_attention(**a)
        assert_close("window out vs twin", out, ref_out)
        assert_close("window lse vs twin", lse, ref_lse)
        assert_close("twin out vs plain", ref_out, want_out)


def test_window_attention_empty_everything():
    """Nothing visible and no sink: (0, -inf); floor above every key: only the sink is seen."""
    a = window_batch([3, 2], [5, 0], 4, [0, 0], seed=7)
    a["window_floor"] = torch.tensor([10**6, 0], device=DEVICE)
    out, lse = window_attention_triton.window_attention(**a)
    assert_close("sink-only lse", lse, a["sink"].expand(5, 4).contiguous())
    assert bool((out == 0).all())
    a["sink"] = None
    out, lse = window_attention_triton.window_attention(**a)
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all())


def test_window_attention_int32_metadata_and_bf16_keys():
    """int32 cu_seqlens / positions and bf16 keys give the same result as int64 and fp32 keys."""
    a = window_batch([3, 1], [129, 128], 4, [0, 20], seed=13)
    a["k"] = a["k"].bfloat16()
    want = window_attention_ref.window_attention(**a)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "q_pos", "k_pos", "window_floor"):
        a[name] = a[name].int()
    out, lse = window_attention_triton.window_attention(**a)
    assert_close("int32 out", out, want[0])
    assert_close("int32 lse", lse, want[1])


def test_window_empty_key_set_without_sink_is_an_empty_partial():
    a = window_batch([2], [0], 4, [0], seed=3)
    a["sink"] = None
    for impl in (window_attention_ref, window_attention_triton):
        out, lse = impl.window_attention(**a)
        assert bool((out == 0).all()) and bool(torch.isinf(lse).all() & (lse < 0).all()), impl.__name__


def test_window_negative_floor_never_reads_empty_slots():
    a = window_batch([3], [12], 4, [0], seed=4, lasts=[5])  # positions 0..5, others empty (-1)
    a["window_floor"] = torch.tensor([-7], device=a["k_pos"].device)
    want = window_attention_ref.window_attention(**a)
    got = window_attention_triton.window_attention(**a)
    assert_close("neg floor out", got[0], want[0])
    assert_close("neg floor lse", got[1], want[1])


def test_topk_non_finite_scores_are_not_candidates():
    scores = torch.tensor([[float("nan"), 1.0, float("inf"), 2.0, float("-inf")]])
    for impl in (sparse_attention_ref, sparse_attention_triton):
        assert impl.topk_select(scores, 4).tolist() == [[3, 1, -1, -1]], impl.__name__


# ---------------------------------------------------------------- merge


@pytest.mark.parametrize("rows,heads", [(1, 4), (3, 1), (129, 4)])
def test_merge_states_matches_twin(rows, heads):
    g = gen(rows + heads)
    out_a, out_b = randn(g, rows, heads, D), randn(g, rows, heads, D)
    lse_a, lse_b = randn(g, rows, heads) * 4, randn(g, rows, heads) * 4
    lse_a.view(-1)[::3] = NEG_INF  # empty A, empty B, and both empty
    lse_b.view(-1)[::2] = NEG_INF
    got = merge_triton.merge_states(out_a, lse_a, out_b, lse_b)
    want = merge_ref.merge_states(out_a, lse_a, out_b, lse_b)
    assert_close("merge out", got[0], want[0])
    assert_close("merge lse", got[1], want[1])
    both_empty = torch.isinf(lse_a) & torch.isinf(lse_b)
    assert bool((got[0][both_empty] == 0).all())


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_merge_of_window_split_equals_attention_over_union(backend):
    """Split a request's keys into two halves A (with the sink) and B: merge == attention on A ++ B."""
    ops = BACKENDS[backend]
    a = window_batch([131, 3], [257, 129], 4, [0, 30], seed=11)
    ks = a["cu_seqlens_k"].tolist()
    halves = [[], []]
    for b in range(2):
        rows = torch.arange(ks[b], ks[b + 1], device=DEVICE)
        halves[0].append(rows[::2])
        halves[1].append(rows[1::2])
    parts = []
    for h, sink in zip(halves, (a["sink"], None)):
        rows = torch.cat(h)
        part = dict(a, k=a["k"][rows].contiguous(), k_pos=a["k_pos"][rows].contiguous(),
                    cu_seqlens_k=cu([len(x) for x in h]), sink=sink)
        parts.append(ops["window"](**part))
    merged = ops["merge"](*parts[0], *parts[1])
    whole = ops["window"](**a)
    assert_close(f"{backend} merged out", merged[0], whole[0])
    assert_close(f"{backend} merged lse", merged[1], whole[1])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_merge_of_window_and_global_equals_attention_over_concatenation(backend):
    """merge(global partial, window partial) == plain softmax over visible entries ++ window keys + sink."""
    ops = BACKENDS[backend]
    q_lens = [129, 3]
    a = window_batch(q_lens, [257, 128], 4, [0, 0], seed=5)
    bt = global_batch(q_lens, [17, 3], 4, seed=6)
    bt["q"] = a["q"]  # NOTE: each partial keeps its own positions; only the queries are shared
    scores = ops["scores"](*scores_args(bt))
    idx = ops["topk"](scores, scores.shape[1])
    g_part = ops["sparse"](bt["q"], bt["entries"], bt["cu_seqlens_q"], bt["cu_seqlens_c"], idx, bt["scale"])
    merged = ops["merge"](*g_part, *ops["window"](**a))
    want = plain_rows(a["q"], a["cu_seqlens_q"],
                      lambda b, i: torch.cat([visible_entries(bt, b, i), visible_window_keys(a, b, i)]),
                      a["sink"], a["scale"])
    assert_close(f"{backend} concat out", merged[0], want[0])
    assert_close(f"{backend} concat lse", merged[1], want[1])


# ---------------------------------------------------------------- indexer, top-k, sparse attention

GLOBAL_CASES = [  # (q_lens, c_lens)
    ([1], [1]),
    ([3, 1], [3, 17]),
    ([131, 1, 128], [17, 0, 3]),  # a request with no entries
]


@pytest.mark.parametrize("q_lens,c_lens", GLOBAL_CASES)
def test_indexer_scores_matches_twin(q_lens, c_lens):
    bt = global_batch(q_lens, c_lens, 1, seed=sum(q_lens) + sum(c_lens))
    got = sparse_attention_triton.indexer_scores(*scores_args(bt))
    want = sparse_attention_ref.indexer_scores(*scores_args(bt))
    assert_close("indexer scores", got, want)


def tie_heavy_scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), -inf non-candidates, +-0.0 and a fully empty row."""
    g = gen(seed)
    s = torch.randint(-3, 4, (rows, cols), generator=g).float() / 2
    s[torch.rand(rows, cols, generator=g) < 0.3] = NEG_INF
    s[:, ::5] = -0.0
    s[0] = NEG_INF
    return s.to(DEVICE)


@pytest.mark.parametrize("k", [0, 1, 16, 40])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (131, 33)])
def test_topk_select_matches_twin_exactly(rows, cols, k):
    scores = tie_heavy_scores(rows, cols, seed=rows * cols)
    got = sparse_attention_triton.topk_select(scores, k)
    want = sparse_attention_ref.topk_select(scores, k)
    assert got.dtype == torch.int32 and torch.equal(got, want), \
        f"topk k={k}: {int((got != want).sum())} indices differ"


def test_topk_select_long_rows_and_large_k():
    """Rows longer than one scan chunk (running top-k merge) and k = 512 > the candidates."""
    scores = tie_heavy_scores(3, 2500, seed=9)
    scores[1] = torch.randn(2500, generator=gen(1)).to(DEVICE)
    for k in (16, 512):
        got = sparse_attention_triton.topk_select(scores, k)
        assert torch.equal(got, sparse_attention_ref.topk_select(scores, k)), f"k={k}"


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("k_extra", [-16, 0, 5])  # k = 1, k = the largest entry count, k > it
@pytest.mark.parametrize("q_lens,c_lens", GLOBAL_CASES)
def test_sparse_attention_matches_twin(q_lens, c_lens, k_extra, heads):
    bt = global_batch(q_lens, c_lens, heads, seed=sum(q_lens) * 7 + heads)
    scores = sparse_attention_ref.indexer_scores(*scores_args(bt))
    idx = sparse_attention_ref.topk_select(scores, max(1, max(c_lens) + k_extra))
    idx[::4, 0] = -1  # holes in the middle of a selection are skipped too
    args = (bt["q"], bt["entries"], bt["cu_seqlens_q"], bt["cu_seqlens_c"], idx.contiguous(), bt["scale"])
    got = sparse_attention_triton.sparse_attention(*args)
    want = sparse_attention_ref.sparse_attention(*args)
    assert_close("sparse out", got[0], want[0])
    assert_close("sparse lse", got[1], want[1])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sparse_with_every_visible_entry_equals_dense_causal(backend):
    ops = BACKENDS[backend]
    q_lens, c_lens = [131, 1, 3], [17, 0, 3]
    bt = global_batch(q_lens, c_lens, 4, seed=21)
    scores = ops["scores"](*scores_args(bt))
    idx = ops["topk"](scores, max(c_lens) + 3)
    out, lse = ops["sparse"](bt["q"], bt["entries"], bt["cu_seqlens_q"], bt["cu_seqlens_c"], idx, bt["scale"])
    want = plain_rows(bt["q"], bt["cu_seqlens_q"], lambda b, i: visible_entries(bt, b, i), None, bt["scale"])
    assert_close(f"{backend} dense out", out, want[0])
    assert_close(f"{backend} dense lse", lse, want[1])


# ---------------------------------------------------------------- cache writes (bit exact)


def scatter_case(rows: int, dim: int, num_slots: int, seed: int):
    g = gen(seed)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    x[rows // 2, 3] = float("nan")  # a poisoned group must stay loud
    slots = torch.randperm(num_slots, generator=g)[:rows]
    slots[1::5] = -1
    return x.to(DEVICE), slots.to(DEVICE), (torch.arange(rows) + 50).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 3, 129])
def test_quantize_scatter_window_bit_exact(rows):
    x, slots, pos = scatter_case(rows, D, 160, seed=rows)
    floor = 50 + rows // 3  # the replay floor cuts the batch
    codes = torch.randint(0, 256, (160, D), dtype=torch.uint8, generator=gen(1)).to(DEVICE)
    scales = torch.randint(0, 256, (160, D // 32), dtype=torch.uint8, generator=gen(2)).to(DEVICE)
    want_codes, want_scales = codes.clone(), scales.clone()
    cache_write_ref.quantize_scatter_window(x, slots, want_codes, want_scales, pos, floor)
    cache_write_triton.quantize_scatter_window(x, slots, codes, scales, pos, floor)
    assert torch.equal(codes, want_codes), f"{int((codes != want_codes).sum())} code bytes differ"
    assert torch.equal(scales, want_scales), f"{int((scales != want_scales).sum())} scale bytes differ"


@pytest.mark.parametrize("fmt_name", ["global", "index"])
@pytest.mark.parametrize("rows", [1, 17])
def test_quantize_scatter_global_bit_exact(rows, fmt_name):
    fmt = INDEX_ROW if fmt_name == "index" else GLOBAL_ROW
    dim = DI if fmt_name == "index" else D
    x, slots, last_pos = scatter_case(rows, dim, 40, seed=rows + 100)
    kw = dict(fmt=fmt)
    codes = torch.randint(0, 256, (40, dim // 2), dtype=torch.uint8, generator=gen(3)).to(DEVICE)
    scales = torch.randint(0, 256, (40, dim // fmt.group), dtype=torch.uint8, generator=gen(4)).to(DEVICE)
    want_codes, want_scales = codes.clone(), scales.clone()
    cache_write_ref.quantize_scatter_global(x, slots, want_codes, want_scales, last_pos, 52, **kw)
    cache_write_triton.quantize_scatter_global(x, slots, codes, scales, last_pos, 52, **kw)
    assert torch.equal(codes, want_codes), f"{int((codes != want_codes).sum())} code bytes differ"
    assert torch.equal(scales, want_scales), f"{int((scales != want_scales).sum())} scale bytes differ"


# ---------------------------------------------------------------- launcher validation


def test_launchers_reject_bad_inputs():
    a = window_batch([3], [5], 4, [0], seed=1)
    with pytest.raises(ValueError, match="contiguous"):
        window_attention_triton.window_attention(**dict(a, q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)))
    with pytest.raises(ValueError, match="int32 or int64"):
        window_attention_triton.window_attention(**dict(a, q_pos=a["q_pos"].float()))
    with pytest.raises(ValueError, match="float32"):
        sparse_attention_triton.topk_select(torch.zeros(2, 3, dtype=torch.float64, device=DEVICE), 1)
    with pytest.raises(ValueError, match="int32"):
        sparse_attention_triton.sparse_attention(a["q"], a["k"], cu([3]), cu([5]),
                                                 torch.zeros(3, 2, dtype=torch.int64, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="float32"):
        merge_triton.merge_states(*(t.double() for t in (a["q"], a["q"][..., 0], a["q"], a["q"][..., 0])))
    codes = torch.zeros(4, D, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="scales"):
        cache_write_triton.quantize_scatter_window(a["k"], torch.zeros(5, dtype=torch.int64, device=DEVICE),
                                                   codes, codes, a["k_pos"], 0)
