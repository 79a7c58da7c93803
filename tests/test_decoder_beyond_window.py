"""``decoder_global_beyond_window``: the decoder source's global entries become selectable only once
their token has left the window (entry of position p from p + W on). Every path applies it alike
(the training forward, the reference model cold and incremental, the served runtime on the twins
and on the C++ kernels), and it binds: no decoder selection holds an in-window entry, and each
path's output differs from the same weights with the flag off (so a path that ignored it would
fail its comparison with the reference).

Tolerances as in test_training.py (training forward vs reference, float32), test_reference_model.py
(incremental vs whole sequence) and test_serving_bookkeeping.py (served vs reference, quantized).
"""

import dataclasses

import pytest
import torch

from cedar.backend import replay
from cedar.backend.cache import cache_for_hit, new_cache
from cedar.backend.geometries import cedar_tiny
from cedar.backend.model import CEDModel
from cedar.backend.model_io import random_model
from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet
from cedar.training.dense import DenseForward, Plan
from serving_harness import Harness

OFF = cedar_tiny()
ON = dataclasses.replace(OFF, decoder_global_beyond_window=True)
W = ON.sliding_window
E = ON.decoder_start
SERVED_ATOL = 2e-3  # quantized caches: a last-bit difference can flip an FP8/FP4 code


def float_model(cfg, seed=5):
    model = CEDModel(cfg, quantize=False)
    model.load_state_dict(random_model(cfg, seed).state_dict())
    return model.eval()


def ids(n, seed):
    return torch.randint(3, ON.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_lag_is_the_decoder_sources_only():
    assert ON.global_lag(E) == W and ON.global_lag(1) == 0
    assert OFF.global_lag(E) == 0
    assert ON.to_hf_dict()["decoder_global_beyond_window"] is True
    assert type(ON).from_hf_dict(ON.to_hf_dict()) == ON


@pytest.mark.parametrize("cfg", [ON, OFF], ids=["on", "off"])
def test_no_decoder_selection_holds_an_entry_its_window_reads(cfg):
    """With the flag every decoder top-k entry lies at or below the query's position - W; the
    encoder's selections are untouched. Off, the decoder does select in-window entries."""
    T = 512
    fwd = DenseForward(float_model(cfg))
    with torch.no_grad():
        (out,) = fwd.run_passes(ids(T, 1)[None], torch.zeros(1, T, dtype=torch.long), Plan())
    pos = torch.arange(T)
    in_window = {}
    for layer, (idx, valid) in out.selections.items():
        ent = out.entries[cfg.kv_source_of(layer)]
        gap = pos[:, None] - ent.pos[idx[0]]  # (T, k) query position - entry's last position
        assert bool((gap[valid[0]] >= 0).all()), f"layer {layer} selected a future entry"
        in_window[layer] = int((valid[0] & (gap < W)).sum())
        if layer >= E:
            # with the flag, no decoder row below W has anything to select
            assert bool(valid[0, :W].any()) == (cfg is OFF)
    decoder = [n for layer, n in in_window.items() if layer >= E]
    if cfg is ON:
        assert decoder == [0] * len(decoder), in_window
    else:
        assert all(n > 0 for n in decoder), in_window
    assert in_window[1] > 0  # the encoder source has no lag either way


def test_training_forward_equals_the_reference_cold_and_after_a_hit():
    ref, off = float_model(ON), float_model(OFF)
    T, H, P = 512, 256, 384
    x = ids(T, 2)[None]
    doc = torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad():
        cold, _ = DenseForward(ref).run(x, doc, Plan())
        full = ref.forward(x[0])
        torch.testing.assert_close(cold[0], full, atol=2e-5, rtol=1e-5)
        assert (full - off.forward(x[0])).abs().max() > 1e-3  # the flag changes the model
        hit, _ = DenseForward(ref).run(x, doc, Plan(hit=H, narrow_end=P))
        donor = new_cache(ON, False)
        replay.prefill(ref, donor, x[0, :H], replay.replay_span(0, W))
        cache = cache_for_hit(donor, ON, H, False)
        res = replay.prefill(ref, cache, x[0, :P], replay.replay_span(H, W), narrow=True)
        torch.testing.assert_close(hit[0, P - W:P], res.logits, atol=2e-5, rtol=1e-5)
        steps = torch.stack([replay.decode(ref, cache, int(x[0, t])) for t in range(P, P + 16)])
        torch.testing.assert_close(hit[0, P:P + 16], steps, atol=2e-5, rtol=1e-5)


def test_reference_incremental_equals_whole_sequence():
    model, prompt = float_model(ON), ids(333, 3)
    full = model(prompt)
    cache = new_cache(ON, False)
    res = replay.prefill(model, cache, prompt[:300], replay.replay_span(0, W), narrow=False, chunk=97)
    assert (res.logits - full[res.positions]).abs().max().item() <= 1e-4
    for j in range(300, 333):
        logits = replay.decode(model, cache, int(prompt[j]))
        assert (logits - full[j]).abs().max().item() <= 1e-4


@pytest.fixture(scope="module", params=["torch", pytest.param("fast", marks=pytest.mark.skipif(
    not cpu_ext.available(), reason="the C++ CPU kernels could not be built here"))])
def served_pair(request):
    """(flag on, flag off) with the same weights, on the twins or the C++ kernels."""
    return tuple(random_model(cfg, seed=6).eval().use_kernels(KernelSet(request.param)) for cfg in (ON, OFF))


def close(a, b):
    """a: the served rows SGLang scheduled; b: the reference's, whose last rows they are."""
    return (a - b[b.shape[0] - a.shape[0]:]).abs().max().item() <= SERVED_ATOL


def ref_prefill(model, prompt, hit_cache=None, hit=0):
    cache = hit_cache if hit_cache is not None else new_cache(model.cfg, True)
    return replay.prefill(model, cache, torch.tensor(prompt), replay.replay_span(hit, W), narrow=True), cache


def test_served_prefill_decode_hit_and_batch_equal_the_reference(served_pair):
    model, off = served_pair
    h = Harness(model)
    a_prompt = ids(420, 11).tolist()
    a = h.admit("a", 0, a_prompt)
    out, _ = h.step([(a, 420)])
    ref, a_cache = ref_prefill(model, a_prompt)
    assert close(out["a"], ref.logits)
    assert not close(out["a"], ref_prefill(off, a_prompt)[0].logits)  # a served path ignoring the flag fails
    for _ in range(3):  # decode: the native whole step on the C++ kernels
        tok = int(out["a"][-1].argmax())
        a.ids.append(tok)
        out, _ = h.step([(a, 1)])
        assert close(out["a"][-1], replay.decode(model, a_cache, tok))
    # a hit and a cold request in one batch with a's decode step
    H = 300
    b_prompt = a_prompt[:H] + ids(70, 12).tolist()
    b = h.admit("b", 1, b_prompt, hit_from=a, hit=H)
    c_prompt = ids(150, 13).tolist()
    c = h.admit("c", 2, c_prompt)
    tok = int(out["a"][-1].argmax())
    a.ids.append(tok)
    out, plan = h.step([(a, 1), (b, 70), (c, 150)])
    assert plan.requests[1].replayed == W
    assert close(out["a"][-1], replay.decode(model, a_cache, tok))
    _, donor = ref_prefill(model, a_prompt)
    assert close(out["b"], ref_prefill(model, b_prompt, cache_for_hit(donor, ON, H, True), H)[0].logits)
    assert close(out["c"], ref_prefill(model, c_prompt)[0].logits)
