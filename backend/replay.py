"""Driving the reference model through a request's life under SPEC section 3's rules: cold or
hit prefill (encoder-side bounded replay), chunked prefill (final chunk >= W rows), decode.

These functions are the ground truth the served path is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import SequenceCache, cache_for_hit, new_cache
from .key_source import ExtendPlan
from .model import CEDModel, ExtendResult


@dataclass(frozen=True)
class ReplaySpan:
    """The rows the first extend of a request feeds: [replay_start, prompt_len)."""

    hit_len: int  # H: tokens whose global KV is cached (aligned to ratios and pages)
    replay_len: int  # R = min(W, H): rows recomputed for the window only

    @property
    def replay_start(self) -> int:
        return self.hit_len - self.replay_len


def replay_span(hit_len: int, window: int, exact: bool = False) -> ReplaySpan:
    """R = min(W, H); ``exact`` replays the whole prefix (the no-approximation reference)."""
    if hit_len < 0:
        raise ValueError(f"negative hit length {hit_len}")
    return ReplaySpan(hit_len, hit_len if exact else min(window, hit_len))


def chunk_spans(prompt_len: int, start: int, chunk: int, window: int) -> list[tuple[int, int]]:
    """Split rows [start, prompt_len) into chunks of at most ``chunk`` rows whose last chunk holds
    at least ``window`` rows (or everything): a chunk that would leave 0 < rest < W is shortened."""
    if chunk <= 0:
        raise ValueError("chunk size must be positive")
    spans, s = [], start
    while s < prompt_len:
        e = min(s + chunk, prompt_len)
        if 0 < prompt_len - e < window:
            e = max(s + 1, prompt_len - window) if prompt_len - s > window else prompt_len
        spans.append((s, e))
        s = e
    return spans


def prefill(model: CEDModel, cache: SequenceCache, prompt: Tensor, span: ReplaySpan,
            narrow: bool = True, chunk: int | None = None) -> ExtendResult:
    """Prefill ``prompt`` (P,) over ``cache`` (which holds the hit's global rows, or nothing).

    Rows [H - R, P) run; the window floor is H - R; rows below H write no global KV. With
    ``chunk``, earlier chunks skip the layers after E and the final chunk holds >= W rows."""
    W = model.cfg.sliding_window
    spans = chunk_spans(prompt.shape[0], span.replay_start, chunk or prompt.shape[0], W)
    result = None
    for s, e in spans:
        last = e == prompt.shape[0]
        plan = ExtendPlan(window_floor=span.replay_start, write_floor=span.hit_len,
                          narrow=narrow, skip_decoder=narrow and not last)
        result = model.extend(cache, prompt[s:e], s, plan)
    return result


def decode(model: CEDModel, cache: SequenceCache, token: int) -> Tensor:
    """One decode step (one row: never trimmed) -> logits (vocab,) f32."""
    return continue_prefill(model, cache, torch.tensor([token])).logits[-1]


def greedy(model: CEDModel, cache: SequenceCache, first_logits: Tensor, num_tokens: int) -> list[int]:
    """Greedy continuation: argmax of ``first_logits`` (vocab,), then decode ``num_tokens - 1``."""
    out = [int(first_logits.argmax())]
    while len(out) < num_tokens:
        out.append(int(decode(model, cache, out[-1]).argmax()))
    return out


def continue_prefill(model: CEDModel, cache: SequenceCache, new_ids: Tensor, narrow: bool = True) -> ExtendResult:
    """Extend a request's exact state with new rows (the next turn of a session continued from
    its own cache: what a restored snapshot computes)."""
    plan = ExtendPlan(window_floor=cache.window_floor, write_floor=cache.seq_len, narrow=narrow)
    return model.extend(cache, new_ids, cache.seq_len, plan)


def reference_greedy(model: CEDModel, ids: list[int], num_tokens: int, hit: int = 0,
                     donor_ids: list[int] | None = None) -> tuple[list[int], Tensor]:
    """What a served request must answer, greedy: ``ids`` prefilled cold (``hit`` = 0) or with
    bounded replay after a prefix hit of ``hit`` tokens on the global KV a cold run of
    ``donor_ids`` wrote. Returns (tokens, logits (vocab,) f32 of the prompt's last row)."""
    W, quantize = model.cfg.sliding_window, model.codec.quantize
    cache = new_cache(model.cfg, quantize)
    if hit:
        donor = new_cache(model.cfg, quantize)
        prefill(model, donor, torch.tensor(donor_ids), replay_span(0, W))
        cache = cache_for_hit(donor, model.cfg, hit, quantize)
    res = prefill(model, cache, torch.tensor(ids), replay_span(hit, W))
    return greedy(model, cache, res.logits[-1], num_tokens), res.logits[-1]
