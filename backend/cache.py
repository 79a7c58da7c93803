"""Explicit per-request caches of the reference model (SPEC section 2), in the stored formats.

- ``GlobalStore`` (one per KV source): FP4 global rows and index keys, one row per ``r``
  tokens, plus the fp32 compressor tail (the ``< r`` tokens not yet pooled). Shareable: a prefix
  hit copies the rows below the hit into a new request's cache.
- ``WindowRing`` (one per layer): the last ``W`` window rows in FP8, slot = position % W, each
  slot tagged with its position (-1 = empty), so a reader can never see a row from outside its
  window or from another occupant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def _empty(width: int | None, dtype: torch.dtype) -> Tensor | None:
    return None if width is None else torch.zeros(0, width, dtype=dtype)


@dataclass
class GlobalStore:
    ratio: int
    rows: Tensor  # (G, latent/2) uint8 FP4 codes, or (G, latent) f32 unquantized
    row_scales: Tensor | None  # (G, latent/16) uint8 E4M3, None unquantized
    index_rows: Tensor  # (G, index_dim/2) uint8, or (G, index_dim) f32
    index_scales: Tensor | None  # (G, index_dim/32) uint8 E8M0
    tail_kv: Tensor  # (t, latent) f32, t < ratio: rows of the incomplete group
    tail_gate: Tensor  # (t, latent) f32

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def truncated(self, num_rows: int) -> "GlobalStore":
        """A copy holding rows [0, num_rows) and no tail: what a prefix hit shares."""
        cut = lambda t: None if t is None else t[:num_rows].clone()  # noqa: E731
        return GlobalStore(self.ratio, cut(self.rows), cut(self.row_scales), cut(self.index_rows),
                           cut(self.index_scales), self.tail_kv[:0].clone(), self.tail_gate[:0].clone())


@dataclass
class WindowRing:
    rows: Tensor  # (W, D) uint8 FP8 codes, or (W, D) f32 unquantized
    scales: Tensor | None  # (W, D/32) uint8 E8M0
    pos: Tensor  # (W,) int64, -1 = empty


@dataclass
class SequenceCache:
    """Everything one request has cached. ``seq_len`` tokens are done; queries read window keys
    no lower than ``window_floor`` (the replay start of an encoder-side hit, else 0)."""

    seq_len: int
    window_floor: int
    sources: dict[int, GlobalStore] = field(default_factory=dict)
    rings: dict[int, WindowRing] = field(default_factory=dict)


def new_cache(cfg, quantize: bool) -> SequenceCache:
    """An empty cache for a request under config ``cfg`` (a CEDConfig)."""
    D, Di, W = cfg.kv_latent_dim, cfg.index_head_dim, cfg.sliding_window
    cache = SequenceCache(seq_len=0, window_floor=0)
    for s in cfg.kv_source_layer_ids:
        q = quantize
        cache.sources[s] = GlobalStore(
            ratio=cfg.compress_ratios[s],
            rows=torch.zeros(0, D // 2 if q else D, dtype=torch.uint8 if q else torch.float32),
            row_scales=_empty(D // 16 if q else None, torch.uint8),
            index_rows=torch.zeros(0, Di // 2 if q else Di, dtype=torch.uint8 if q else torch.float32),
            index_scales=_empty(Di // 32 if q else None, torch.uint8),
            tail_kv=torch.zeros(0, D), tail_gate=torch.zeros(0, D))
    for layer in range(cfg.num_hidden_layers):
        cache.rings[layer] = WindowRing(
            rows=torch.zeros(W, D, dtype=torch.uint8 if quantize else torch.float32),
            scales=torch.zeros(W, D // 32, dtype=torch.uint8) if quantize else None,
            pos=torch.full((W,), -1, dtype=torch.long))
    return cache


def cache_for_hit(donor: SequenceCache, cfg, hit_len: int, quantize: bool) -> SequenceCache:
    """A new request's cache after a prefix hit of ``hit_len`` tokens on ``donor``'s global KV:
    the global rows below the hit are shared, window rings start empty (SWA state is never
    prefix-cached). ``hit_len`` must be a multiple of every ratio and at most donor.seq_len."""
    if hit_len > donor.seq_len or any(hit_len % cfg.compress_ratios[s] for s in donor.sources):
        raise ValueError(f"hit of {hit_len} tokens is not aligned to the ratios or exceeds {donor.seq_len}")
    cache = new_cache(cfg, quantize)
    for s, store in donor.sources.items():
        cache.sources[s] = store.truncated(hit_len // store.ratio)
    cache.seq_len = hit_len
    return cache
