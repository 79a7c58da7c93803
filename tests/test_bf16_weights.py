"""bf16 projection weights (``cedar serve --weights bf16``, ``native_step.round_to_bf16``): the
few-row linear over bf16 weights is the float32 one over the widened values, bit for bit; the
rounding touches exactly the projection weights, once; and how far the rounded shipped model's
greedy tokens move from the float32 model's is bounded (the README states the figure).
``--weights bf16-matmul`` also runs a prefill's matmuls (more than 8 rows) in bf16: the linear of
many rows over a bf16 weight is at::linear over the rows rounded to bf16, only the projection
weights get a bf16 copy, and its tokens are bounded the same way."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from cedar.backend.model_io import load_model
from cedar.backend.serving import native_step
from cedar.backend.serving.driver import Driver, Req
from cedar.backend.serving.planner import ServingFlags
from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="the C++ CPU kernels could not be built here")
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "cedar-agent"


@needs_ext
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 8, 13, 16])
@pytest.mark.parametrize("n, k", [(32, 64), (512, 256), (2048, 256), (7, 12)])
def test_bf16_linear_is_the_float32_linear_over_the_widened_weights(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 100 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen).to(torch.bfloat16)
    got = torch.ops.cedar_cpu.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.equal(got, torch.ops.cedar_cpu.linear(x, w.float()))
    assert not torch.equal(got, torch.ops.cedar_cpu.linear(x, torch.randn(n, k, generator=gen))) or rows == 0


@needs_ext
@pytest.mark.parametrize("rows", [17, 64, 300])
@pytest.mark.parametrize("n, k", [(32, 64), (512, 256), (7, 12)])
def test_bf16_linear_of_many_rows_is_a_bf16_matmul(rows, n, k):
    """More rows than a decode step's over a bf16 weight: the rows rounded to bf16, at::linear in
    bf16 (float32 sums), float32 out; within bf16's rounding of the float32 product, not equal to it."""
    gen = torch.Generator().manual_seed(rows * 100 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen).to(torch.bfloat16)
    got = torch.ops.cedar_cpu.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.equal(got, torch.nn.functional.linear(x.to(torch.bfloat16), w).float())
    exact = x @ w.float().T
    assert not torch.equal(got, exact)
    assert torch.allclose(got, exact, rtol=0, atol=0.05 * float(exact.abs().max()))


def test_matmul_weight_hands_the_mlps_bf16_copy_to_many_rows_only():
    """bf16-matmul: the MLP's weights give matmuls of more than LINEAR_ROWS rows their bf16 copy
    (the same values); every other weight, and every weight of a plain bf16 model, is itself
    there. A few-row matmul reads the packed copy of the rounded weight (packed before the
    rounding, which writes through .data and leaves the version counters: packed again)."""
    from cedar.backend.modules import BF16_MATMUL, LINEAR_ROWS, matmul_weight, pack_rows

    for matmul in (False, True):
        model = load_model(SHIPPED, kernels=KernelSet.for_device("cpu"))
        native_step.round_to_bf16(model, matmul=matmul)
        for layer in model.layers:
            mlp = (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
            others = (layer.wq, layer.wkv, layer.wo) + ((layer.wq_index, layer.w_index) if layer.has_indexer else ()) \
                + ((layer.compressor.wkv, layer.compressor.wk_index) if layer.compressor is not None else ())
            for lin in mlp + others:
                assert torch.equal(matmul_weight(lin.weight, LINEAR_ROWS), pack_rows(lin.weight))
                many = matmul_weight(lin.weight, LINEAR_ROWS + 1)
                if matmul and lin in mlp:
                    assert many.dtype == torch.bfloat16 and torch.equal(many.float(), lin.weight)
                else:
                    assert many is lin.weight
            assert not hasattr(layer.attn_norm.weight, BF16_MATMUL)
        assert not hasattr(model.embed_tokens.weight, BF16_MATMUL)


def test_rounding_touches_the_projection_weights_only_and_once():
    model = load_model(SHIPPED, kernels=KernelSet.for_device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Driver(model, ServingFlags(weights="bf16"), num_slots=512, num_reqs=2)  # rounds at allocation
    after = model.state_dict()
    projections = {k for k in before if k.endswith(("wq.weight", "wkv.weight", "wq_index.weight", "w_index.weight",
                                                    "wo.weight", "proj.weight", "wgate.weight", "wk_index.weight"))}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= projections
    assert not any("norm" in k or "embed" in k or "lm_head" in k or k.endswith("sink") for k in changed)
    for k in changed:  # each the nearest bf16 value, stored as float32
        assert after[k].dtype == torch.float32 and torch.equal(after[k], before[k].to(torch.bfloat16).float())
    snapshot = {k: v.clone() for k, v in after.items()}
    native_step.round_to_bf16(model)
    assert all(torch.equal(snapshot[k], v) for k, v in model.state_dict().items())


def _next_token_logps(model, flags: ServingFlags, ids: list[int], follow: list[int] | int) -> list[torch.Tensor]:
    """Served in process: prefill ``ids``, then decode one token a step: the tokens ``follow``
    (teacher-forced) or, given a count, that many greedy tokens. Returns the next-token
    log-probabilities after the prompt and after each decoded token but the last."""
    d = Driver(model, flags, num_slots=4096, num_reqs=2)
    req = Req("r", 0, list(ids))
    out, logps = d.run([(req, len(ids))]), []
    for i in range(follow if isinstance(follow, int) else len(follow)):
        logps.append(torch.log_softmax(d.model.lm_head(out.hidden[-1:]).float()[0], -1))
        req.ids.append(int(logps[-1].argmax()) if isinstance(follow, int) else follow[i])
        out = d.run([(req, 1)])
    return logps


@pytest.mark.parametrize("weights", ["bf16", "bf16-matmul"])
def test_the_rounded_shipped_model_stays_close_to_the_float32_one(weights):
    """Three text prompts (the tokenizer's built-in corpus: prose, tool calls, JSON; 60 to 700
    tokens, past the window), then the float32 model's 40 greedy tokens fed to both models: the
    bf16 model's next token is the float32 model's on at least 93% of the steps, and the mean KL
    of the next-token distributions is below 4e-3 (the README's figures come from this test;
    earlier models measured 2.0e-3 for both modes and 5.9e-3 / 6.5e-3 (the bound was 1e-2 then),
    the one shipped now 9.1e-4 / 1.3e-3: how far bf16 moves a model is the model's own, so the
    README states each figure)."""
    from tokenizers import Tokenizer

    from cedar.backend.tokenizer import builtin_corpus

    f32 = load_model(SHIPPED, kernels=KernelSet.for_device("cpu"))
    bf16 = copy.deepcopy(f32)
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    corpus = builtin_corpus()
    agree, steps, kls = 0, 0, []
    for first, n in ((0, 60), (200, 250), (400, 700)):
        ids = tok.encode("\n".join(corpus[first:first + 400])).ids[:n]
        want = _next_token_logps(f32, ServingFlags(), ids, 40)
        follow = [int(w.argmax()) for w in want]
        got = _next_token_logps(bf16, ServingFlags(weights=weights), ids, follow)
        agree += sum(int(a.argmax()) == b for a, b in zip(got, follow))
        steps += len(follow)
        kls += [float((a.exp() * (a - b)).sum()) for a, b in zip(want, got)]
    print(f"{weights} vs float32: next token agrees {agree}/{steps}, mean KL {sum(kls) / len(kls):.2e}, max {max(kls):.2e}")
    assert agree / steps >= 0.93, (agree, steps)
    assert sum(kls) / len(kls) < 4e-3, max(kls)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bf16", "bf16-matmul"])
def test_a_bf16_server_serves_the_rounded_model(tiny_model_dir, weights):
    """A real ``cedar serve --weights bf16`` (and ``bf16-matmul``): the reference model with the
    same rounding gives its tokens (cold, inside and past the window) and first log-probability."""
    from conftest import start_server
    from server_helpers import assert_matches, generate, prompt, reference

    ref = load_model(tiny_model_dir).use_kernels(KernelSet.for_device("cpu"))
    native_step.round_to_bf16(ref, matmul=weights == "bf16-matmul")
    srv = start_server(tiny_model_dir, "--context-length", "4096", flags=ServingFlags(weights=weights))
    try:
        assert srv.cedar_state()["flags"]["weights"] == weights
        for n, seed in ((40, 51), (300, 52)):
            ids = prompt(n, seed)
            assert_matches(generate(srv, ids), reference(ref, ids))
    finally:
        srv.stop()
