"""A request's ``seed`` makes its sampling repeatable at any temperature, through SGLang's
``HookRegistry`` (installed by ``sglang_hooks.install``, pinned to the same version and checked by
``tests/test_sglang_hooks.py``). Any model.

SGLang 0.5.23 maps the OpenAI ``seed`` to ``sampling_params.sampling_seed``, and its samplers
(the torch ones CPU serving uses included) draw from a per-row hash of (seed, position) when a
batch carries a seed tensor; but ``SamplingBatchInfo.from_schedule_batch`` builds that tensor only
under ``--enable-deterministic-inference`` (batch-invariant kernels besides), so otherwise ``seed``
is ignored and two identical seeded requests differ.

| target | why |
|---|---|
| SamplingBatchInfo.from_schedule_batch | build the seed tensor whenever a request in the batch has a
  seed: its own seed; every unseeded request a fresh random one, so it stays random |
| SamplingBatchInfo.merge_batch | merging a batch with seeds and one without: drop both (0.5.23
  concatenates only when both have them and would keep a tensor of the wrong length) |
| layers.sampler.multinomial_with_seed | on CPU tensors, the same Gumbel-max draw with the hash in
  torch (`murmur_hash32`): 0.5.23 calls `sgl_kernel.murmur_hash32_cpu`, which Cedar's CPU stand-in
  for `sgl_kernel` lacks (a seeded request killed the scheduler) |

NOTE: a batch that holds a ``min_p`` request is sampled without seeds (0.5.23's seeded sampler
refuses ``min_p``); its seeded requests are then not repeatable.
"""

from __future__ import annotations

import secrets

P = "sglang.srt."
TARGETS = {
    "seed_batch": P + "sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
    "seed_merge": P + "sampling.sampling_batch_info.SamplingBatchInfo.merge_batch",
    "seeded_draw": P + "layers.sampler.multinomial_with_seed",
}
_U32 = 0xFFFFFFFF


def _mix(h, k):
    """One MurmurHash3 block (32-bit values held in int64 tensors; products wrap, low bits hold)."""
    k = (k * 0xCC9E2D51) & _U32
    k = ((k << 15) | (k >> 17)) & _U32
    h = h ^ ((k * 0x1B873593) & _U32)
    h = ((h << 13) | (h >> 19)) & _U32
    return (h * 5 + 0xE6546B64) & _U32


def murmur_hash32(seed, positions, cols):
    """SGLang's per-(seed, position, column) hash (`sglang.kernels.ops.sampling.murmur_hash`):
    seed low and high words, position, column, length 16, final mix; an (n, m) int64 tensor."""
    import torch

    seed = seed.to(torch.int64)
    h = torch.zeros(seed.shape[0], 1, dtype=torch.int64, device=seed.device)
    for k in ((seed & _U32), (seed >> 32) & _U32, positions.to(torch.int64) & _U32):
        h = _mix(h, k.view(-1, 1))
    h = _mix(h, cols.to(torch.int64).view(1, -1) & _U32) ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _U32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _U32
    return h ^ (h >> 16)


def around_seeded_draw(original, logprobs, seed, positions):
    """0.5.23's ``multinomial_with_seed`` (Gumbel-max over the hash) with the hash above on CPU."""
    if logprobs.device.type != "cpu":
        return original(logprobs, seed, positions)
    import torch

    x = murmur_hash32(seed, positions, torch.arange(logprobs.shape[1])).to(torch.float64) / _U32
    x.log_().clamp_(min=torch.finfo(x.dtype).min, max=-(2.0**-32)).neg_()
    x.log_().neg_()  # gumbel noise
    return torch.argmax(x.add_(logprobs.to(torch.float64)), dim=1, keepdim=True)


def request_seeds(seeds: list[int | None], min_ps: list[float]) -> list[int] | None:
    """Per-request sampling seeds for a batch: each request's own, a fresh random one where it has
    none; None when no request has a seed or one samples with ``min_p``."""
    if all(s is None for s in seeds) or any(m > 0 for m in min_ps):
        return None
    return [s if s is not None else secrets.randbits(62) for s in seeds]


def after_from_schedule_batch(info, cls, batch, *args, **kwargs):
    if info.sampling_seed is not None:  # deterministic inference: SGLang's own seeds
        return info
    params = [r.sampling_params for r in batch.reqs]
    seeds = request_seeds([p.sampling_seed for p in params], [p.min_p for p in params])
    if seeds is not None:
        import torch

        info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(info.temperatures.device)
    return info


def before_merge(self, other, *args, **kwargs):
    if (self.sampling_seed is None) != (other.sampling_seed is None):
        self.sampling_seed = other.sampling_seed = None
    return None


HOOKS = {
    "seed_batch": (after_from_schedule_batch, "after"),
    "seed_merge": (before_merge, "before"),
    "seeded_draw": (around_seeded_draw, "around"),
}
