"""Explicit per-request caches of the reference model (SPEC section 2), in the stored formats.

- ``GlobalStore`` (one per KV source): FP4 global rows and index keys, one row per ``r``
  tokens, plus the fp32 compressor tail (the ``< r`` tokens not yet pooled). Shareable: a prefix
  hit copies the rows below the hit into a new request's cache.
- ``WindowRing`` (one per layer): the last ``W`` window rows in FP8 (2W for layer E), slot = position % size, each
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

    def append(self, rows: Tensor, row_scales: Tensor | None, index_rows: Tensor,
               index_scales: Tensor | None) -> None:
        self.rows = torch.cat([self.rows, rows])
        self.index_rows = torch.cat([self.index_rows, index_rows])
        if row_scales is not None:
            self.row_scales = torch.cat([self.row_scales, row_scales])
            self.index_scales = torch.cat([self.index_scales, index_scales])

    def truncated(self, num_rows: int) -> "GlobalStore":
        """A copy holding rows [0, num_rows) and no tail: what a prefix hit shares."""
        cut = lambda t: None if t is None else t[:num_rows].clone()  # noqa: E731
        return GlobalStore(self.ratio, cut(self.rows), cut(self.row_scales), cut(self.index_rows),
                           cut(self.index_scales), self.tail_kv[:0].clone(), self.tail_gate[:0].clone())


@dataclass
class WindowRing:
    rows: Tensor  # (W, D) uint8 FP8 codes, or (W, D) f32 unquantized
    scales: Tensor | None  # (W, D/32) uint8 E8M0
    pos: Tensor  # (S,) int64, -1 = empty

    def store(self, codes: Tensor, scales: Tensor | None, pos: Tensor) -> None:
        """Keep the last S of the new rows, at slot = position % S."""
        S = self.pos.shape[0]
        last = slice(max(0, pos.shape[0] - S), pos.shape[0])
        slots = pos[last] % S
        self.rows[slots] = codes[last]
        if scales is not None:
            self.scales[slots] = scales[last]
        self.pos[slots] = pos[last]


@dataclass
class SequenceCache:
    """Everything one request has cached. ``seq_len`` tokens are done; queries read window keys
    no lower than ``window_floor`` (the replay start of an encoder-side hit, else 0)."""

    seq_len: int
    window_floor: int
    sources: dict[int, GlobalStore] = field(default_factory=dict)
    rings: dict[int, WindowRing] = field(default_factory=dict)


def ring_size(cfg, layer: int) -> int:
    """W rows per layer; layer E keeps 2W: a decoder tail of W rows carried over from an
    earlier chunk reads E's window W - 1 rows further back (see serving/pool_keys.py)."""
    return 2 * cfg.sliding_window if layer == cfg.decoder_start else cfg.sliding_window


def new_cache(cfg, quantize: bool) -> SequenceCache:
    """An empty cache for a request under config ``cfg`` (a CEDConfig)."""
    D, Di = cfg.kv_latent_dim, cfg.index_head_dim
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
        S = ring_size(cfg, layer)
        cache.rings[layer] = WindowRing(
            rows=torch.zeros(S, D, dtype=torch.uint8 if quantize else torch.float32),
            scales=torch.zeros(S, D // 32, dtype=torch.uint8) if quantize else None,
            pos=torch.full((S,), -1, dtype=torch.long))
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
