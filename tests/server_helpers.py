"""What the tests of the real server share: prompts, a greedy /generate with logprobs, the
reference's answer for it (cold or bounded replay after a hit; the ``ref`` fixture is in conftest).

Outputs are compared as greedy token ids (exact) and their log-probabilities (LOGPROB_ATOL:
the served batch runs the same layer code over differently shaped batches; quantized caches).
"""

import torch

from cedar.backend.replay import reference_greedy

W = 128
NEW = 6
LOGPROB_ATOL = 2e-3


def prompt(n, seed):
    return torch.randint(8, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(server, ids, n=NEW, **extra):
    status, out = server.post("/generate", {
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}})
    assert status == 200, out
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], logprobs, out["meta_info"]


def reference(ref, ids, hit=0, donor_ids=None, n=NEW):
    """Greedy continuation of the reference model, cold or after a hit of ``hit`` tokens on the
    global KV a cold run of ``donor_ids`` produced: (tokens, log-probability of the first)."""
    toks, logits = reference_greedy(ref, ids, n, hit, donor_ids)
    return toks, float(torch.log_softmax(logits, -1)[toks[0]])


def assert_matches(served, expected):
    (ids, lps, _), (ref_ids, ref_lp) = served, expected
    assert ids == ref_ids
    assert abs(lps[0] - ref_lp) <= LOGPROB_ATOL, (lps[0], ref_lp)
