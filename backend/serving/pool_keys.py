"""PoolKeys: the :class:`~cedar.backend.key_source.KeySource` of a served forward, over SGLang's
token slots (:class:`TokenPools`) and request slots (:class:`RequestSlots`).

Invariants (each is what a test checks):
- Global and index rows of groups ending below a request's prefix ``H`` are never written: the
  radix tree shares them, and replayed rows recompute the window only.
- A window ring row is read only by its slot's current owner (the planner resets stale slots) and
  only at positions below the forward's first row for that request (the rest come from this
  forward), never below the request's window floor.
- A decoder tail carried over from earlier chunks reads the encoder outputs stored for its
  positions; decoder windows read nothing below the tail's first position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compressor import Compressor, split_groups
from ..config import CEDConfig
from ..key_source import GlobalView, KeySource, WindowKeys, entry_positions
from ..kv_codec import KVCodec
from ..rows import DecoderRows, RowBatch, cu_seqlens
from .planner import ServedForward
from .pools import RequestSlots, TokenPools


class PoolKeys(KeySource):
    def __init__(self, cfg: CEDConfig, codec: KVCodec, pools: TokenPools, slots: RequestSlots,
                 plan: ServedForward) -> None:
        self.cfg, self.codec, self.pools, self.slots, self.plan = cfg, codec, pools, slots, plan
        self.views: dict[int, GlobalView] = {}
        self.enc_floor = torch.tensor([r.window_floor for r in plan.requests], dtype=torch.long)
        self.dec_floor = self.enc_floor.clone()

    # ------------------------------------------------------------------ global KV
    def write_global(self, layer: int, comp: Compressor, x: Tensor, batch: RowBatch) -> None:
        r, src = comp.ratio, self.pools.sources[layer]
        kv, gate = comp.project(x)  # (T, D) f32 each
        seg_kv, seg_gate, firsts, rows = [], [], [], []
        empty = kv[:0]
        for b, req in enumerate(self.plan.requests):
            s, e = batch.bounds(b)
            t = int(self.slots.tail_len[layer][req.slot]) if r > 1 else 0
            split = split_groups(kv[s:e], gate[s:e] if gate is not None else None,
                                 self.slots.tail_kv[layer][req.slot, :t] if r > 1 else empty,
                                 self.slots.tail_gate[layer][req.slot, :t] if r > 1 else None,
                                 req.row_start, r, req.prefix_len)  # the write floor is the prefix
            if r > 1:
                rest = split.tail_kv.shape[0]
                self.slots.tail_kv[layer][req.slot, :rest] = split.tail_kv
                self.slots.tail_gate[layer][req.slot, :rest] = split.tail_gate
                self.slots.tail_len[layer][req.slot] = rest
            if split.first_pos.numel():
                seg_kv.append(split.kv)
                seg_gate.append(split.gate)
                firsts.append(split.first_pos)
                rows.append(req.token_slots[split.first_pos] // r)
        if rows:
            pooled, index = comp.pool(torch.cat(seg_kv), torch.cat(seg_gate) if gate is not None else None,
                                      torch.cat(firsts))
            idx = torch.cat(rows)
            src.rows[idx], src.row_scales[idx] = self.codec.encode("global", pooled)
            src.index_rows[idx], src.index_scales[idx] = self.codec.encode("index", index)
        self.views.pop(layer, None)

    def global_view(self, source: int) -> GlobalView:
        if source not in self.views:
            src = self.pools.sources[source]
            r, idx, lens = src.ratio, [], []
            for req in self.plan.requests:
                G = req.seq_len // r
                idx.append(req.token_slots[0: G * r: r] // r)
                lens.append(G)
            idx = torch.cat(idx)
            self.views[source] = GlobalView(
                self.codec.decode("global", src.rows[idx], src.row_scales[idx]),
                self.codec.decode("index", src.index_rows[idx], src.index_scales[idx]),
                torch.cat([entry_positions(n, r) for n in lens]), cu_seqlens(lens))
        return self.views[source]

    # ------------------------------------------------------------------ window KV
    def window_keys(self, layer: int, kv: Tensor, batch: RowBatch) -> WindowKeys:
        codes, scales = self.codec.encode("window", kv)
        new = self.codec.decode("window", codes, scales)
        rows, ring_s, ring_p = self.slots.ring_rows[layer], self.slots.ring_scales[layer], self.slots.ring_pos[layer]
        S = ring_p.shape[1]
        keys, key_pos, lens = [], [], []
        for b, req in enumerate(self.plan.requests):
            s, e = batch.bounds(b)
            if e == s:
                lens.append(0)
                continue
            first = int(batch.pos[s])
            old = (ring_p[req.slot] >= 0) & (ring_p[req.slot] < first)  # (S,)
            keys += [self.codec.decode("window", rows[req.slot][old], ring_s[req.slot][old]), new[s:e]]
            key_pos += [ring_p[req.slot][old], batch.pos[s:e]]
            lens.append(int(old.sum()) + e - s)
            last = slice(max(s, e - S), e)
            slot_idx = batch.pos[last] % S
            rows[req.slot, slot_idx] = codes[last]
            ring_s[req.slot, slot_idx] = scales[last]
            ring_p[req.slot, slot_idx] = batch.pos[last]
        D = kv.shape[1]
        return WindowKeys(torch.cat(keys) if keys else kv.new_zeros(0, D),
                          torch.cat(key_pos) if key_pos else batch.pos[:0], cu_seqlens(lens))

    def window_floor(self, layer: int) -> Tensor:
        return self.dec_floor if layer > self.cfg.decoder_start else self.enc_floor

    # ------------------------------------------------------------------ the cut
    def decoder_rows(self, h: Tensor, batch: RowBatch) -> DecoderRows | None:
        W = self.cfg.sliding_window
        hidden, pos, src_rows, lens = [], [], [], []
        for b, req in enumerate(self.plan.requests):
            s, e = batch.bounds(b)
            first = int(batch.pos[s]) if e > s else req.seq_len
            if req.decoder == "all":
                keep_from = first
            elif req.decoder == "tail":
                keep_from = max(req.window_floor, req.seq_len - W)
                self.dec_floor[b] = keep_from
            else:
                keep_from = req.seq_len
            carried = torch.arange(keep_from, max(keep_from, min(first, req.seq_len)), dtype=torch.long)
            if carried.numel():
                slot_idx = carried % W
                if not torch.equal(self.slots.enc_pos[req.slot, slot_idx], carried):
                    raise RuntimeError(f"request {req.rid}: encoder outputs for its decoder tail are missing")
                hidden.append(self.slots.enc_out[req.slot, slot_idx])
                src_rows.append(torch.full((carried.numel(),), -1, dtype=torch.long))
            own = torch.arange(max(s, s + keep_from - first), e, dtype=torch.long)
            hidden.append(h[own])
            src_rows.append(own)
            pos.append(torch.arange(keep_from, req.seq_len, dtype=torch.long))
            lens.append(req.seq_len - keep_from)
            last = slice(max(s, e - W), e)  # keep this forward's last W encoder outputs
            self.slots.enc_out[req.slot, batch.pos[last] % W] = h[last]
            self.slots.enc_pos[req.slot, batch.pos[last] % W] = batch.pos[last]
        return DecoderRows(torch.cat(hidden), RowBatch(torch.cat(pos), tuple(lens)), torch.cat(src_rows))

    def commit(self) -> None:
        """After the forward: each owner's state now reaches its sequence end."""
        for req in self.plan.requests:
            owner = self.slots.owners[req.slot]
            owner.next_pos = req.seq_len
            owner.replayed_tokens += req.replayed
            owner.hasher.advance(req.token_slots, self.pools.token_ids, req.seq_len)
            if req.decoder != "skip":
                owner.decoder_pos = req.seq_len

