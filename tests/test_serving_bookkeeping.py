"""The served path's bookkeeping (planner, PoolKeys, token/request-slot pools) against the
reference model, in process (tests/serving_harness.py stands in for SGLang's slot tables).

Tolerance: the served path runs the same layer code over differently shaped ragged batches,
so logits agree to float32 reassociation (ATOL); global rows shared through the tree are
compared byte for byte.
"""


import pytest
import torch

from cedar.backend.cache import cache_for_hit, new_cache
from cedar.backend.geometries import cedar_tiny
from cedar.backend.model_io import random_model
from cedar.backend.replay import decode, prefill, replay_span
from cedar.backend.serving.planner import RequestInfo, ServingFlags
from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet
from serving_harness import Harness

CFG = cedar_tiny()
W = CFG.sliding_window
ATOL = 2e-3  # quantized caches: a last-bit difference can flip an FP8/FP4 code (seen: 3e-4)


@pytest.fixture(scope="module", params=["torch", pytest.param("fast", marks=pytest.mark.skipif(
    not cpu_ext.available(), reason="the C++ CPU kernels could not be built here (their batched-torch "
    "fallback is held to the twins in test_kernels_fast.py)"))])
def model(request):
    """The served path against the reference, both on the twins and both on the fast CPU backend
    (C++ kernels, tested against the twins in test_kernels_fast.py): every test holds for each."""
    return random_model(CFG, seed=2).eval().use_kernels(KernelSet(request.param))


def ids(n, seed):
    return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ref_prefill(model, prompt, hit_cache=None, hit=0, narrow=True):
    cache = hit_cache if hit_cache is not None else new_cache(CFG, True)
    res = prefill(model, cache, torch.tensor(prompt), replay_span(hit, W), narrow=narrow)
    return res, cache


def close(a, b):
    """a: served logits of the rows SGLang scheduled; b: the reference's, which may hold more rows
    in front (a narrowed decoder's replayed or carried-over rows): a's rows are b's last."""
    assert a.shape[0] <= b.shape[0], (a.shape, b.shape)
    return (a - b[b.shape[0] - a.shape[0]:]).abs().max().item() <= ATOL


@pytest.mark.parametrize("n", [50, W, W + 1, 300])
def test_cold_prefill_and_decode_equal_reference(model, n):
    h = Harness(model)
    prompt = ids(n, n)
    req = h.admit("a", 0, prompt)
    out, plan = h.step([(req, n)])
    ref, cache = ref_prefill(model, prompt)
    assert plan.requests[0].decoder == ("all" if n <= W else "tail")
    assert out["a"].shape == ref.logits.shape and close(out["a"], ref.logits)
    for step in range(3):
        tok = int(out["a"][-1].argmax())
        req.ids.append(tok)
        out, plan = h.step([(req, 1)])
        assert close(out["a"][-1], decode(model, cache, tok))


@pytest.mark.parametrize("chunk", [64, W - 1, W, W + 1, 200])
def test_chunked_prefill_equals_unchunked(model, chunk):
    """SGLang picks the chunks (no final-chunk rule needed): earlier chunks skip the decoder and
    the final chunk's decoder tail carries rows over from them."""
    prompt = ids(400, 7)
    ref, _ = ref_prefill(model, prompt)
    h = Harness(model)
    req = h.admit("a", 1, prompt)
    done = 0
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        final = done + n == len(prompt)
        out, plan = h.step([(req, n)], [RequestInfo(final_chunk=final)])
        assert plan.requests[0].decoder == ("skip" if not final else plan.requests[0].decoder)
        done += n
    # NOTE: SGLang sees the rows it scheduled (the final chunk's); the reference's narrowed
    # decoder ran the last W, carried-over rows included
    assert out["a"].shape[0] == min(n, W) and close(out["a"], ref.logits)


def test_hit_shares_global_rows_bit_for_bit_and_equals_reference_replay(model):
    h = Harness(model)
    a_prompt = ids(420, 11)
    a = h.admit("a", 0, a_prompt)
    h.step([(a, 420)])
    snapshot = {s: (p.rows.clone(), p.index_rows.clone()) for s, p in h.pools.sources.items()}
    H = 300
    b_prompt = a_prompt[:H] + ids(70, 12)
    b = h.admit("b", 1, b_prompt, hit_from=a, hit=H)
    out, plan = h.step([(b, len(b_prompt) - H)])
    assert plan.requests[0].replayed == W and plan.requests[0].row_start == H - W
    for s, p in h.pools.sources.items():
        shared = torch.tensor(a.token_slots[:H:p.ratio]) // p.ratio
        assert torch.equal(p.rows[shared], snapshot[s][0][shared]), f"source {s}: shared rows rewritten"
        assert torch.equal(p.index_rows[shared], snapshot[s][1][shared])
    # the reference's bounded replay of the same hit
    _, donor = ref_prefill(model, a_prompt)
    ref, _ = ref_prefill(model, b_prompt, cache_for_hit(donor, CFG, H, True), H)
    assert close(out["b"], ref.logits)


def test_short_hit_is_exact(model):
    h = Harness(model)
    a_prompt = ids(150, 13)
    a = h.admit("a", 0, a_prompt)
    h.step([(a, 150)])
    b_prompt = a_prompt[:100] + ids(30, 14)
    b = h.admit("b", 1, b_prompt, hit_from=a, hit=100)
    out, plan = h.step([(b, 30)])
    assert plan.requests[0].replayed == 100 and plan.requests[0].row_start == 0
    cold, _ = ref_prefill(model, b_prompt)
    assert close(out["b"], cold.logits[-out["b"].shape[0]:])


def test_reused_slot_never_reads_the_previous_owner(model):
    """Request slots are reused at once: a new owner of a slot, even with a hit, is reset and
    replays; the previous occupant's rings would give a different (wrong) answer."""
    h = Harness(model)
    a_prompt = ids(300, 15)
    a = h.admit("a", 0, a_prompt)
    h.step([(a, 300)])
    b_prompt = a_prompt[:256] + ids(20, 16)
    b = h.admit("b", 0, b_prompt, hit_from=a, hit=256)  # same request slot as a
    out, plan = h.step([(b, 20)])
    assert plan.requests[0].replayed == W
    _, donor = ref_prefill(model, a_prompt)
    ref, _ = ref_prefill(model, b_prompt, cache_for_hit(donor, CFG, 256, True), 256)
    assert close(out["b"], ref.logits)
    assert h.slots.owners[0].rid == "b"


def test_mixed_batch_equals_requests_alone(model):
    h = Harness(model)
    a = h.admit("a", 0, ids(200, 17))
    h.step([(a, 200)])
    a.ids.append(5)
    c_prompt = a.ids[:198] + ids(9, 18)
    c = h.admit("c", 2, c_prompt, hit_from=a, hit=198)
    d = h.admit("d", 3, ids(77, 19))
    together, _ = h.step([(a, 1), (c, 9), (d, 77)])

    alone = Harness(model)
    a2 = alone.admit("a", 0, a.ids[:200])
    alone.step([(a2, 200)])
    a2.ids.append(5)
    assert close(together["a"], alone.step([(a2, 1)])[0]["a"])
    c2 = alone.admit("c", 2, c_prompt, hit_from=a2, hit=198)
    assert close(together["c"], alone.step([(c2, 9)])[0]["c"])
    d2 = alone.admit("d", 3, d.ids)
    assert close(together["d"], alone.step([(d2, 77)])[0]["d"])


def test_replay_per_request_equals_in_forward_replay(model):
    """The benchmark switch computes the same thing in a separate forward per request."""
    outs, replayed = [], []
    for flags in (ServingFlags(), ServingFlags(replay_per_request=True)):
        h = Harness(model, flags)
        a_prompt = ids(400, 20)
        a = h.admit("a", 0, a_prompt)
        h.step([(a, 400)])
        b = h.admit("b", 1, a_prompt[:300] + ids(40, 21), hit_from=a, hit=300)
        c = h.admit("c", 2, a_prompt[:100] + ids(10, 22), hit_from=a, hit=100)
        out, plan = h.step([(b, 40), (c, 10)])
        outs.append(out)
        replayed.append([h.slots.owners[i].replayed_tokens for i in (1, 2)])
        assert [r.replayed for r in plan.requests] == ([W, 100] if not flags.replay_per_request else [0, 0])
    assert replayed[0] == replayed[1] == [W, 100]
    assert close(outs[0]["b"], outs[1]["b"]) and close(outs[0]["c"], outs[1]["c"])


def test_exact_mode_replays_everything_and_equals_cold(model):
    h = Harness(model, ServingFlags(replay="exact"))
    a_prompt = ids(300, 22)
    a = h.admit("a", 0, a_prompt)
    h.step([(a, 300)])
    b_prompt = a_prompt[:260] + ids(30, 23)
    b = h.admit("b", 1, b_prompt, hit_from=a, hit=260)
    out, plan = h.step([(b, 30)])
    assert plan.requests[0].replayed == 260 and plan.requests[0].decoder == "all"
    cold, _ = ref_prefill(model, b_prompt, narrow=False)
    assert close(out["b"][-1], cold.logits[-1])


def test_unaligned_stale_hit_is_a_clear_error(model):
    h = Harness(model)
    a = h.admit("a", 0, ids(100, 24))
    h.step([(a, 100)])
    b = h.admit("b", 1, a.ids[:51] + [7], hit_from=a, hit=51)
    with pytest.raises(ValueError, match="not aligned"):
        h.step([(b, 1)])


def test_snapshot_continues_a_session_exactly(model):
    """Turn 2 = turn 1's prompt + output + new text: the finished turn's state is restored at the
    hit and nothing is replayed; the result equals continuing the reference's own cache."""
    from cedar.backend.replay import continue_prefill, greedy
    from cedar.backend.serving.snapshots import SnapshotStore

    store = SnapshotStore(2**26)
    h = Harness(model)
    p1 = ids(300, 30)
    t1 = h.admit("t1", 0, p1)
    out, _ = h.step([(t1, 300)])
    for _ in range(5):  # decode 5 tokens; the last one is never fed (as in SGLang)
        t1.ids.append(int(out["t1"][-1].argmax()))
        out, _ = h.step([(t1, 1)])
    t1.ids.append(int(out["t1"][-1].argmax()))
    assert store.save(h.slots, 0, h.slots.owners[0].hasher)
    # reference: the same session in one cache
    cache = new_cache(CFG, True)
    res = prefill(model, cache, torch.tensor(p1), replay_span(0, W))
    gen = greedy(model, cache, res.logits[-1], 6)
    assert gen == t1.ids[300:]
    new = ids(40, 31)
    H = len(t1.ids) - 1 - (len(t1.ids) - 1) % CFG.page_size  # what the tree matches
    t2 = h.admit("t2", 3, t1.ids + new, hit_from=t1, hit=H)
    plan_out, plan = h.step([(t2, len(t2.ids) - H)], snapshots=store)
    r = plan.requests[0]
    assert (r.replayed, r.row_start) == (0, H) and h.slots.owners[3].restored_tokens == H
    ref = continue_prefill(model, cache, torch.tensor([t1.ids[-1]] + new))
    assert close(plan_out["t2"][-1], ref.logits[-1])
    # without the snapshot the same turn replays W rows and moves away from the exact state
    h2 = Harness(model)
    t1b = h2.admit("t1", 0, t1.ids[:-1])
    h2.step([(t1b, len(t1b.ids))])
    t2b = h2.admit("t2", 3, t1.ids + new, hit_from=t1b, hit=H)
    out_b, plan_b = h2.step([(t2b, len(t2b.ids) - H)])
    assert plan_b.requests[0].replayed == W


def test_snapshot_budget_drops_oldest_and_never_restores_stale_state(model):
    from cedar.backend.serving.prefix_digest import prefix_digest
    from cedar.backend.serving.snapshots import SnapshotStore

    h = Harness(model)
    reqs = []
    for i in range(3):
        r = h.admit(f"r{i}", i, ids(64, 40 + i))
        h.step([(r, 64)])
        reqs.append(r)
    one = sum(t[0].numel() * t.element_size() for t in h.slots.slot_tensors().values())
    store = SnapshotStore(2 * one)  # room for two
    for i, r in enumerate(reqs):
        assert store.save(h.slots, i, h.slots.owners[i].hasher)
    assert len(store) == 2 and store.dropped == 1 and store.used_bytes <= store.budget_bytes

    def digest(r, n):
        s = torch.tensor(r.token_slots[:n])
        return prefix_digest(s, h.pools.token_ids[s])

    assert not store.restore(h.slots, 5, "x", 64, digest(reqs[0], 64))  # dropped: falls back
    assert store.restore(h.slots, 5, "y", 64, digest(reqs[2], 64))
    # same tokens in other token slots (a recomputed prefix) never match
    other = torch.tensor(reqs[2].token_slots[:64]) + 2
    assert not store.restore(h.slots, 6, "z", 64, prefix_digest(other, h.pools.token_ids[torch.tensor(reqs[2].token_slots[:64])]))


def test_admission_charges_the_replay_rows_a_hit_will_run(model):
    """What SGLang's prefill budget is told (the PrefillAdder._replay_len hook): min(W, H) rows
    for a stale hit, H in exact mode, none where a snapshot continues the request exactly."""
    from cedar.backend.serving.planner import admission_replay_rows
    from cedar.backend.serving.snapshots import SnapshotStore

    h = Harness(model)
    a = h.admit("a", 0, ids(300, 60))
    h.step([(a, 300)])
    slots = torch.tensor(a.token_slots)
    store = SnapshotStore(2**26)
    bounded, exact = ServingFlags(), ServingFlags(replay="exact")
    assert admission_replay_rows(CFG, bounded, h.pools, store, 0, slots[:0]) == 0
    assert admission_replay_rows(CFG, bounded, h.pools, store, 100, slots[:100]) == 100
    assert admission_replay_rows(CFG, bounded, h.pools, store, 298, slots[:298]) == W
    assert admission_replay_rows(CFG, exact, h.pools, store, 298, slots[:298]) == 298
    assert store.save(h.slots, 0, h.slots.owners[0].hasher)
    assert admission_replay_rows(CFG, bounded, h.pools, store, 298, slots[:298]) == 0  # restores
    assert admission_replay_rows(CFG, bounded, h.pools, store, 298, None) == W  # slots unknown
    assert admission_replay_rows(CFG, ServingFlags(snapshots=False), h.pools, store, 298, slots[:298]) == W
    # the same snapshot is restored by the planner: the admission figure is what the forward runs
    b = h.admit("b", 3, a.ids + ids(10, 61), hit_from=a, hit=298)
    _, plan = h.step([(b, len(b.ids) - 298)], snapshots=store)
    assert plan.requests[0].replayed == 0


def test_restored_session_chunked_by_the_scheduler_equals_its_exact_continuation(model):
    """A restored turn whose few new rows SGLang splits into chunks (the budget shared with other
    requests): the decoder continues from the snapshot's decoder state, as the unchunked turn
    does, instead of re-running the restored rows with a cut window (found by the property test)."""
    from cedar.backend.serving.snapshots import SnapshotStore

    results = []
    for chunks in ([3], [2, 1]):
        h, store = Harness(model), SnapshotStore(2**26)
        a = h.admit("a", 0, ids(132, 70))
        out, _ = h.step([(a, 132)])
        a.ids.append(int(out["a"][-1].argmax()))
        out, _ = h.step([(a, 1)])
        assert store.save(h.slots, 0, h.slots.owners[0].hasher)
        b = h.admit("b", 1, a.ids[:132] + ids(3, 71), hit_from=a, hit=132)
        for i, n in enumerate(chunks):
            out, plan = h.step([(b, n)], [RequestInfo(final_chunk=i == len(chunks) - 1)], snapshots=store)
            assert plan.requests[0].replayed == 0
        assert h.slots.owners[1].restored_tokens == 132
        results.append(out["b"][-1])
    assert close(results[0], results[1])
