"""Where a layer's keys come from during one forward of one request.

The model's layer loop (``model.py``) asks a :class:`KeySource` for window keys and global
entries; two implementations give the two ways to run the reference model:

- :class:`WholeSequenceKeys`: no cache; every key is computed in this forward (cold, untrimmed).
- :class:`CachedKeys`: explicit caches (:mod:`cache`) read and written under an
  :class:`ExtendPlan` (replay floors, write floor), i.e. the incremental forward.

Both present keys exactly as a cache reader would see them (quantize -> dequantize when
quantization is on), so the two agree up to floating-point reassociation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import SequenceCache
from .compressor import Compressor
from .kv_codec import KVCodec


@dataclass(frozen=True)
class GlobalView:
    entries: Tensor  # (Nc, D) f32 dequantized global rows
    index_keys: Tensor  # (Nc, Di) f32 dequantized index keys
    entry_pos: Tensor  # (Nc,) int64: position from which each entry is visible


class KeySource:
    """Contract: ``write_global`` is called once per KV source before any layer reads that source
    in this forward; ``window_keys`` once per layer and forward (it also stores the new rows)."""

    def write_global(self, layer: int, comp: Compressor, x: Tensor, pos: Tensor) -> None:
        raise NotImplementedError

    def global_view(self, source: int) -> GlobalView:
        raise NotImplementedError

    def window_keys(self, layer: int, kv: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """kv: (T, D) f32 new rows at positions pos (T,) -> keys (N, D) f32, key positions (N,)."""
        raise NotImplementedError

    def window_floor(self, layer: int) -> int:
        raise NotImplementedError


def _entry_positions(num: int, ratio: int, first: int = 0) -> Tensor:
    return (torch.arange(first, first + num, dtype=torch.long) + 1) * ratio - 1


class WholeSequenceKeys(KeySource):
    """Cold, whole-sequence forward: all rows at positions 0..T-1, nothing cached."""

    def __init__(self, codec: KVCodec) -> None:
        self.codec = codec
        self.views: dict[int, GlobalView] = {}

    def write_global(self, layer, comp, x, pos):
        G = x.shape[0] // comp.ratio
        kv, gate = comp.project(x[: G * comp.ratio])
        rows, index = comp.pool(kv, gate, torch.arange(G, dtype=torch.long) * comp.ratio)
        self.views[layer] = GlobalView(self.codec.roundtrip("global", rows),
                                       self.codec.roundtrip("index", index),
                                       _entry_positions(G, comp.ratio))

    def global_view(self, source):
        return self.views[source]

    def window_keys(self, layer, kv, pos):
        return self.codec.roundtrip("window", kv), pos

    def window_floor(self, layer):
        return 0


@dataclass(frozen=True)
class ExtendPlan:
    """What one incremental forward of one request may read and write (SPEC section 3).

    window_floor: lowest window-key position any query reads (encoder replay start, else 0).
    write_floor: global / index rows of groups whose last position is below it are never
        written (they are the shared prefix); a group straddling it is written.
    narrow: run the layers after E on the last min(W, rows) rows only (decoder-side replay).
    skip_decoder: a non-final prefill chunk: stop after layer E (its global KV is written).
    """

    window_floor: int = 0
    write_floor: int = 0
    narrow: bool = True
    skip_decoder: bool = False


class CachedKeys(KeySource):
    def __init__(self, cache: SequenceCache, codec: KVCodec, plan: ExtendPlan, window: int) -> None:
        self.cache, self.codec, self.plan, self.window = cache, codec, plan, window
        self.decoder_floor: int | None = None  # set by the model when it narrows

    def write_global(self, layer, comp, x, pos):
        store, r = self.cache.sources[layer], comp.ratio
        kv, gate = comp.project(x)
        kv = torch.cat([store.tail_kv, kv])
        gate = torch.cat([store.tail_gate, gate]) if gate is not None else None
        first = int(pos[0]) - store.tail_kv.shape[0]  # position of the first pending row
        if first % r:
            raise ValueError(f"layer {layer}: compressor tail starts at {first}, not a multiple of {r}")
        G = kv.shape[0] // r
        done = G * r
        store.tail_kv = kv[done:].clone()
        store.tail_gate = gate[done:].clone() if gate is not None else store.tail_kv[:0]
        groups = torch.arange(first // r, first // r + G, dtype=torch.long)
        # NOTE: the write floor keeps the shared prefix bit-identical: rows of groups that end
        # below it are read from the cache, never recomputed or rewritten.
        keep = (groups + 1) * r - 1 >= self.plan.write_floor
        if (~keep).any() and int(groups[~keep].max()) >= store.num_rows:
            raise ValueError(f"layer {layer}: replayed group below the write floor is not cached")
        if not keep.any():
            return
        g0 = int(groups[keep][0])
        if g0 != store.num_rows:
            raise ValueError(f"layer {layer}: writing group {g0} but the store holds {store.num_rows} rows")
        sel = keep.repeat_interleave(r)
        rows, index = comp.pool(kv[:done][sel], gate[:done][sel] if gate is not None else None,
                                groups[keep] * r)
        codes, scales = self.codec.encode("global", rows)
        icodes, iscales = self.codec.encode("index", index)
        store.rows = torch.cat([store.rows, codes])
        store.index_rows = torch.cat([store.index_rows, icodes])
        if scales is not None:
            store.row_scales = torch.cat([store.row_scales, scales])
            store.index_scales = torch.cat([store.index_scales, iscales])

    def global_view(self, source):
        s = self.cache.sources[source]
        return GlobalView(self.codec.decode("global", s.rows, s.row_scales),
                          self.codec.decode("index", s.index_rows, s.index_scales),
                          _entry_positions(s.num_rows, s.ratio))

    def window_keys(self, layer, kv, pos):
        ring, W = self.cache.rings[layer], self.window
        old = ring.pos < int(pos[0])  # rows this request wrote before this forward
        old_rows = self.codec.decode("window", ring.rows[old], None if ring.scales is None else ring.scales[old])
        codes, scales = self.codec.encode("window", kv)
        keys = torch.cat([old_rows, self.codec.decode("window", codes, scales)])
        key_pos = torch.cat([ring.pos[old], pos])
        last = slice(max(0, kv.shape[0] - W), kv.shape[0])  # only the last W rows stay
        slots = pos[last] % W
        ring.rows[slots] = codes[last]
        if scales is not None:
            ring.scales[slots] = scales[last]
        ring.pos[slots] = pos[last]
        return keys, key_pos

    def window_floor(self, layer):
        if self.decoder_floor is not None:
            return max(self.plan.window_floor, self.decoder_floor)
        return self.plan.window_floor
