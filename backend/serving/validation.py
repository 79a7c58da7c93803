"""What Cedar refuses in a request before SGLang's scheduler sees it (a 400 with a message, raised
as ValueError by the tokenizer manager's validation hook). Pure: the hook reads the request's
fields off SGLang's ``GenerateReqInput`` and passes them here.

SGLang 0.5.23 does not check token ids (an id outside the vocabulary crashed the scheduler), nor
the fields that size a tensor in the scheduler (a ``top_logprobs_num`` above the vocabulary made
the sampler call ``topk`` out of range; a ``logprob_start_len`` below -1 failed an assertion in the
logprob processor); each killed the scheduler, and so every other request."""

from __future__ import annotations


def check_request(input_ids, top_logprobs_num, token_ids_logprob, logprob_start_len, sampling_params,
                  vocab_size: int) -> None:
    """Raise ValueError naming the first bad field. Fields may be per request (a list, for a batch
    of prompts) or one value; ``input_ids`` is None for a text prompt (tokenized later, in range)."""
    if input_ids is not None:
        if len(input_ids) == 0:
            raise ValueError("the prompt is empty: send at least one token")
        bad = [t for t in input_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {vocab_size})")
    for top in _each(top_logprobs_num):
        if top is not None and not (isinstance(top, int) and 0 <= top <= vocab_size):
            raise ValueError(f"top_logprobs_num must be an integer in [0, {vocab_size}], got {top!r}")
    for t in (i for group in token_ids_logprob or [] for i in _each(group)):
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            raise ValueError(f"token_ids_logprob: token id {t!r} is out of range [0, {vocab_size})")
    for start in _each(logprob_start_len):
        # NOTE: past the prompt SGLang answers a 400 itself
        if start is not None and not (isinstance(start, int) and start >= -1):
            raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position, got {start!r}")
    for sp in _each(sampling_params):
        n = sp.get("n") if isinstance(sp, dict) else None
        if n is not None and not (isinstance(n, int) and n >= 1):
            raise ValueError(f"sampling_params.n must be an integer >= 1, got {n!r}")


def _each(value) -> list:
    return value if isinstance(value, list) else [value]
