"""Where a layer's keys come from during one forward.

The model's layer loop (``model.py``) asks a :class:`KeySource` for window keys, global entries
and the rows the decoder runs on. Three implementations:

- :class:`WholeSequenceKeys`: no cache; one request, every key computed in this forward.
- :class:`CachedKeys`: explicit per-request caches (:mod:`cache`) read and written under an
  :class:`ExtendPlan` (replay floors, write floor, narrowing): the incremental reference.
- ``cedar.backend.serving.pool_keys.PoolKeys``: SGLang's token slots and request slots.

All present keys exactly as a cache reader would see them (quantize -> dequantize when
quantization is on), so they agree up to floating-point reassociation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from cedar.kernels.plans import GlobalPlan, PoolPlan, RingPlan, WindowPlan

from .cache import SequenceCache
from .compressor import Compressor, split_groups
from .kv_codec import KVCodec
from .rows import DecoderRows, RowBatch, cu_seqlens


@dataclass(frozen=True)
class GlobalView:
    entries: Tensor | None  # (Nc, D) f32 dequantized global rows, request b in rows cu[b]:cu[b+1]
    index_keys: Tensor | None  # (Nc, Di) f32 dequantized index keys (None: read in place, PoolPlan)
    entry_pos: Tensor  # (Nc,) int64: position from which each entry is visible
    cu: Tensor  # (B + 1,) int32
    plan: GlobalPlan | PoolPlan | None = None  # how the batched kernels read it (served path)


@dataclass(frozen=True)
class WindowKeys:
    keys: Tensor  # (N, D) f32 window keys (= values), request b in rows cu[b]:cu[b+1]
    pos: Tensor  # (N,) int64 key positions
    cu: Tensor  # (B + 1,) int32
    plan: WindowPlan | RingPlan | None = None  # where each query block's keys sit (served path);
    # with a RingPlan the kernel reads the rings in place and keys / pos are empty


class KeySource:
    """Contract, per forward: ``write_global`` once per KV source before any layer reads it;
    ``window_keys`` once per layer (it stores the new rows, then returns every readable key);
    ``decoder_rows`` once, at the cut before layer E's attention (after E's global write and
    window store); ``window_floor`` gives each request's lowest readable window position for a
    layer (the decoder's is known once ``decoder_rows`` ran)."""

    def write_global(self, layer: int, comp: Compressor, x: Tensor, batch: RowBatch) -> None:
        raise NotImplementedError

    def global_view(self, source: int) -> GlobalView:
        raise NotImplementedError

    def window_keys(self, layer: int, kv: Tensor, batch: RowBatch) -> WindowKeys:
        raise NotImplementedError

    def decoder_rows(self, h: Tensor, batch: RowBatch) -> DecoderRows | None:
        raise NotImplementedError

    def window_floor(self, layer: int) -> Tensor:  # (B,) int64
        raise NotImplementedError

    def attend_in_place(self, layer, p, batch: RowBatch, selections: dict[int, Tensor], store: bool) -> Tensor | None:
        """A layer's whole attention in one call where this source can (a served decode step on
        the C++ kernels): store ``p.kv`` (when ``store``), attend, and keep the layer's top-k in
        ``selections``; returns o (T, H, D) f32, or None: the model runs the per-kernel path."""
        return None


def entry_positions(num: int, ratio: int, lag: int = 0) -> Tensor:
    """(num,) int64: entry g becomes visible at its group's last position g*r + r - 1, plus the
    source's ``lag`` (:meth:`CEDConfig.global_lag`)."""
    return (torch.arange(num, dtype=torch.long) + 1) * ratio - 1 + lag


class WholeSequenceKeys(KeySource):
    """Cold, whole-sequence forward of one request: rows at positions 0..T-1, nothing cached."""

    def __init__(self, codec: KVCodec, global_lag: Callable[[int], int]) -> None:
        self.codec, self.global_lag = codec, global_lag  # global_lag: CEDConfig.global_lag
        self.views: dict[int, GlobalView] = {}

    def write_global(self, layer, comp, x, batch):
        G = x.shape[0] // comp.ratio
        kv, gate = comp.project(x[: G * comp.ratio])
        rows, index = comp.pool(kv, gate, torch.arange(G, dtype=torch.long) * comp.ratio)
        self.views[layer] = GlobalView(self.codec.roundtrip("global", rows), self.codec.roundtrip("index", index),
                                       entry_positions(G, comp.ratio, self.global_lag(layer)), cu_seqlens([G]))

    def global_view(self, source):
        return self.views[source]

    def window_keys(self, layer, kv, batch):
        return WindowKeys(self.codec.roundtrip("window", kv), batch.pos, cu_seqlens([kv.shape[0]]))

    def decoder_rows(self, h, batch):
        return DecoderRows(h, batch, torch.arange(h.shape[0]))

    def window_floor(self, layer):
        return torch.zeros(1, dtype=torch.long)


@dataclass(frozen=True)
class ExtendPlan:
    """What one incremental forward of one request may read and write (SPEC section 3).

    window_floor: lowest window-key position any query reads (encoder replay start, else 0).
    write_floor: global / index rows of groups whose last position is below it are never
        written (they are the shared prefix); a group straddling it is written.
    narrow: a forward of more than W rows runs layer E's attention and the layers after it on
        its last W rows only, whose decoder windows read nothing below the first of them.
    skip_decoder: a non-final prefill chunk: stop after layer E's global KV and window write.
    """

    window_floor: int = 0
    write_floor: int = 0
    narrow: bool = True
    skip_decoder: bool = False


class CachedKeys(KeySource):
    """One request over a :class:`SequenceCache`."""

    def __init__(self, cache: SequenceCache, codec: KVCodec, plan: ExtendPlan, window: int,
                 decoder_start: int, global_lag: Callable[[int], int]) -> None:
        self.cache, self.codec, self.plan, self.window, self.E = cache, codec, plan, window, decoder_start
        self.global_lag = global_lag  # CEDConfig.global_lag
        self.decoder_floor = plan.window_floor

    def write_global(self, layer, comp, x, batch):
        store, r = self.cache.sources[layer], comp.ratio
        kv, gate = comp.project(x)
        split = split_groups(kv, gate, store.tail_kv, store.tail_gate if gate is not None else None,
                             int(batch.pos[0]), r, self.plan.write_floor)
        store.tail_kv = split.tail_kv.clone()
        store.tail_gate = split.tail_gate.clone() if gate is not None else store.tail_kv[:0]
        if split.skipped_first_pos.numel() and int(split.skipped_first_pos.max()) // r >= store.num_rows:
            raise ValueError(f"layer {layer}: replayed group below the write floor is not cached")
        if not split.first_pos.numel():
            return
        if int(split.first_pos[0]) // r != store.num_rows:
            raise ValueError(f"layer {layer}: writing group {int(split.first_pos[0]) // r} but the store "
                             f"holds {store.num_rows} rows")
        rows, index = comp.pool(split.kv, split.gate, split.first_pos)
        store.append(*self.codec.encode("global", rows), *self.codec.encode("index", index))

    def global_view(self, source):
        s = self.cache.sources[source]
        return GlobalView(self.codec.decode("global", s.rows, s.row_scales),
                          self.codec.decode("index", s.index_rows, s.index_scales),
                          entry_positions(s.num_rows, s.ratio, self.global_lag(source)), cu_seqlens([s.num_rows]))

    def window_keys(self, layer, kv, batch):
        ring = self.cache.rings[layer]
        first = int(batch.pos[0])
        old = (ring.pos >= 0) & (ring.pos < first)  # rows this request wrote before this forward
        codes, scales = self.codec.encode("window", kv)
        keys = torch.cat([self.codec.decode("window", ring.rows[old], None if ring.scales is None else ring.scales[old]),
                          self.codec.decode("window", codes, scales)])
        key_pos = torch.cat([ring.pos[old], batch.pos])
        ring.store(codes, scales, batch.pos)
        return WindowKeys(keys, key_pos, cu_seqlens([keys.shape[0]]))

    def decoder_rows(self, h, batch):
        if self.plan.skip_decoder:
            return None
        n = h.shape[0]
        if self.plan.narrow and n > self.window:
            # NOTE: decoder-side bounded replay: rows below the tail never reach the decoder, so
            # the layers after E must not look below the tail either (layer E reads its ring).
            keep = torch.arange(n - self.window, n)
            self.decoder_floor = max(self.plan.window_floor, int(batch.pos[keep[0]]))
            return DecoderRows(h[keep], RowBatch(batch.pos[keep], (self.window,)), keep)
        return DecoderRows(h, batch, torch.arange(n))

    def window_floor(self, layer):
        floor = self.decoder_floor if layer > self.E else self.plan.window_floor
        return torch.tensor([floor], dtype=torch.long)
