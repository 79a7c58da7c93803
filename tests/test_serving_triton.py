"""The served path (planner, BatchTables, PoolKeys over the token and request pools) on the Triton
kernels equals the same path on the pure-torch twins: a cold prefill, a prefix hit with bounded
replay, a restored-free next turn and decode steps, greedy tokens exact and logits within the
served tolerance. On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set by conftest),
on a GPU natively; a small case, since the interpreter is slow."""

import pytest
import torch

from cedar.backend.geometries import cedar_tiny
from cedar.backend.model_io import random_model
from cedar.kernels.dispatch import KernelSet

from serving_harness import Harness

CFG = cedar_tiny()
W = CFG.sliding_window
ATOL = 2e-3  # the served tolerance (test_serving_bookkeeping): quantized caches, last-bit code flips


def _ids(n, seed):
    return torch.randint(8, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(model, device="cpu"):
    """Cold prompt a (200 tokens), then b: a hit on a's first 160 tokens + 24 new (bounded replay
    of W rows), then 3 greedy decode steps of b; every forward's last-row logits."""
    h = Harness(model, device=device)
    a_prompt = _ids(200, 1)
    a = h.admit("a", 0, a_prompt)
    out, _ = h.step([(a, len(a_prompt))])
    logits = [out["a"][-1]]
    b_prompt = a_prompt[:160] + _ids(24, 2)
    b = h.admit("b", 1, b_prompt, hit_from=a, hit=160)
    out, plan = h.step([(b, len(b_prompt) - 160)])
    assert plan.requests[0].replayed == W
    logits.append(out["b"][-1])
    tokens = []
    for _ in range(3):
        tokens.append(int(logits[-1].argmax()))
        b.ids.append(tokens[-1])
        out, _ = h.step([(b, 1)])
        logits.append(out["b"][-1])
    return torch.stack(logits).cpu(), tokens


def test_served_path_on_triton_equals_twins():
    twins = random_model(CFG, seed=5).eval().use_kernels(KernelSet("torch"))
    triton = random_model(CFG, seed=5).eval().use_kernels(KernelSet("triton"))  # the same weights
    assert all(torch.equal(a, b) for a, b in zip(twins.state_dict().values(), triton.state_dict().values()))
    (lt, tt), (lx, tx) = _serve(twins), _serve(triton)
    assert tx == tt, (tx, tt)
    err = (lt - lx).abs().max().item()
    assert err <= ATOL, f"max |logit diff| {err}"


@pytest.mark.slow
def test_server_on_triton_kernels_equals_the_twins(tiny_model_dir):
    """`cedar serve --kernels triton` (interpreted on CPU): a cold request and a hit with bounded
    replay through the real server give the twins' greedy tokens, first logprob within tolerance."""
    from cedar.backend.model_io import load_model
    from cedar.backend.serving.planner import ServingFlags

    from conftest import start_server, wait_idle_and_check
    from server_helpers import assert_matches, generate, prompt, reference

    twins = load_model(tiny_model_dir).use_kernels(KernelSet("torch"))
    srv = start_server(tiny_model_dir, "--context-length", "1024", flags=ServingFlags(kernels="triton"))
    try:
        assert srv.cedar_state()["kernels"]["backend"] == "triton"
        donor = prompt(200, 31)
        assert_matches(generate(srv, donor, n=3), reference(twins, donor, n=3))
        hit = donor[:160] + prompt(24, 32)
        served = generate(srv, hit, n=3)
        assert served[2]["cached_tokens"] == 160 and served[2]["replayed_tokens"] == W
        assert_matches(served, reference(twins, hit, hit=160, donor_ids=donor, n=3))
        wait_idle_and_check(srv)
    finally:
        srv.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the native GPU served path needs one")
def test_served_path_on_the_gpu_equals_the_cpu_twins():
    """The served path with model and pools on the GPU (native Triton kernels) gives the CPU
    twins' greedy tokens and logits within the served tolerance."""
    twins = random_model(CFG, seed=5).eval().use_kernels(KernelSet("torch"))
    gpu = random_model(CFG, seed=5).eval().to("cuda").use_kernels(KernelSet.for_device("cuda"))
    (lt, tt), (lg, tg) = _serve(twins), _serve(gpu, device="cuda")
    assert tg == tt, (tg, tt)
    assert (lt - lg).abs().max().item() <= ATOL
