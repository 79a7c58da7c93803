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

Every method runs a fixed number of batched gathers and scatters over the forward's
:class:`BatchTables` (built once, in the constructor): no loop over requests in a layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compressor import Compressor
from ..config import CEDConfig
from ..key_source import GlobalView, KeySource, WindowKeys
from ..kv_codec import KVCodec
from ..modules import matmul_weight, rope_constants
from ..rows import DecoderRows, RowBatch
from cedar.kernels import cpu_ext
from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW
from cedar.kernels.plans import PoolPlan, RingPlan

from .batch_tables import BatchTables
from .planner import ServedForward
from .pools import RequestSlots, TokenPools


def rows_of_cut(h: Tensor, enc_out: Tensor, src: Tensor) -> Tensor:
    """The rows ``src`` of ``cat([h, enc_out])`` without building it: h (T, hidden) f32 this
    forward's layer-E inputs, enc_out (num_slots * W, hidden) f32 the kept ones, src (T',) int64
    (< T: a row of h; else row src - T of enc_out) -> (T', hidden) f32, the same values.

    NOTE: cat copied every request slot's kept rows each step (2 MB with 16 slots, the one large
    allocation of a decode step) to read the few the decoder takes; here both reads are gathers
    of T' rows and nothing depends on a value read back. ``cedar_cpu::decode_step`` composes the
    same ops."""
    T = h.shape[0]
    kept = enc_out[(src - T).clamp_min(0)]
    if T == 0:
        return kept
    return torch.where((src < T).unsqueeze(1), h[src.clamp_max(T - 1)], kept)


class PoolKeys(KeySource):
    def __init__(self, cfg: CEDConfig, codec: KVCodec, pools: TokenPools, slots: RequestSlots,
                 plan: ServedForward) -> None:
        self.cfg, self.codec, self.pools, self.slots, self.plan = cfg, codec, pools, slots, plan
        self.tables = BatchTables.build(cfg, plan, slots)
        self.views: dict[int, GlobalView] = {}
        self.row_floors: dict[bool, Tensor] = {}  # decoder? -> (T,) int64 window floor of each row
        # NOTE: a decode step (one row per request, decoder on it) reads rings and pools in place
        # through the C++ kernels; every other forward runs the batched torch plans.
        self.cpp = codec.quantize and codec.kernels.backend_of("window_attention") == "fast" \
            and pools.device.type == "cpu" and cpu_ext.available()
        self.in_place = self.cpp and self.tables.single_row

    ONE_CALL = True  # NOTE: the tests switch the one-call decode path off to compare it with the other
    NATIVE_WINDOW = True  # NOTE: and the one-call window keys of other forwards

    def one_call(self) -> bool:
        """A decode step on the C++ kernels, no autograd: a layer's attention and a source's
        compressor each run as one C++ call (the same ops as the per-kernel path)."""
        return self.ONE_CALL and self.in_place and not torch.is_grad_enabled()

    # ------------------------------------------------------------------ global KV
    def write_global(self, layer: int, comp: Compressor, x: Tensor, batch: RowBatch) -> None:
        r, src = comp.ratio, self.pools.sources[layer]
        tails = r > 1
        w = self.tables.groups(r, self.slots.tail_len[layer] if tails else None)
        if self.one_call():  # NOTE: a decode step: the same ops as below in one C++ call
            freqs, partner = rope_constants(comp.wkv.weight.shape[0], comp.rope_dim, comp.rope_theta, x.device)
            tail = (w.tail_src, w.tail_dst, self.slots.tail_kv[layer], self.slots.tail_gate[layer],
                    self.slots.tail_len[layer], self.tables.slots, w.tail_len) if tails else (None,) * 7
            T = x.shape[0]  # NOTE: its weights as a per-layer forward of T rows reads them (matmul_weight)
            torch.ops.cedar_cpu.compress_decode(
                x, comp.norm.weight, comp.norm.eps, matmul_weight(comp.wkv.weight, T),
                matmul_weight(comp.wgate.weight, T) if tails else None, comp.kv_norm.weight,
                matmul_weight(comp.wk_index.weight, T), comp.index_norm.weight, r, freqs, partner, w.src, w.first_pos,
                w.dst, *tail, src.rows, src.row_scales, src.index_rows, src.index_scales, GLOBAL_ROW.group,
                GLOBAL_ROW.scale == "e4m3", INDEX_ROW.group, INDEX_ROW.scale == "e4m3")
            self.views.pop(layer, None)
            return
        kv, gate = comp.project(x)  # (T, D) f32 each
        if w.first_pos.numel():
            if tails:  # NOTE: a group begun in an earlier forward reads its first rows from the tail
                kv_all = torch.cat([kv, self.slots.tail_kv[layer].view(-1, kv.shape[1])])
                gate_all = torch.cat([gate, self.slots.tail_gate[layer].view(-1, kv.shape[1])])
            else:
                kv_all, gate_all = kv, gate
            pooled, index = comp.pool(kv_all[w.src], gate_all[w.src] if gate is not None else None, w.first_pos)
            src.rows[w.dst], src.row_scales[w.dst] = self.codec.encode("global", pooled)
            src.index_rows[w.dst], src.index_scales[w.dst] = self.codec.encode("index", index)
        if tails:
            self.slots.tail_kv[layer].view(-1, kv.shape[1])[w.tail_dst] = kv[w.tail_src]
            self.slots.tail_gate[layer].view(-1, kv.shape[1])[w.tail_dst] = gate[w.tail_src]
            self.slots.tail_len[layer][self.tables.slots] = w.tail_len
        self.views.pop(layer, None)

    def global_view(self, source: int) -> GlobalView:
        if source not in self.views:
            src = self.pools.sources[source]
            ent = self.tables.entries(src.ratio, self.cfg.global_lag(source))
            idx = ent.rows
            if self.cpp:  # NOTE: global rows are read in place (only the selected ones), index keys
                # too: the indexer lays a request's keys out from the pool once per chunk of rows
                rows = self.tables.dec if source >= self.cfg.decoder_start else self.tables.enc
                # NOTE: dequantize every entry once where the queries select more rows than there are
                entries = self.codec.decode("global", src.rows[idx], src.row_scales[idx]) \
                    if rows.batch.num_rows * self.cfg.index_topk > idx.numel() and not self.in_place else None
                self.views[source] = GlobalView(entries, None, ent.entry_pos, ent.cu, PoolPlan(
                    src.rows, src.row_scales, src.index_rows, src.index_scales, idx, ent.cu.long(), rows.owner,
                    src.ratio))
                return self.views[source]
            self.views[source] = GlobalView(
                self.codec.decode("global", src.rows[idx], src.row_scales[idx]),
                self.codec.decode("index", src.index_rows[idx], src.index_scales[idx]),
                ent.entry_pos, ent.cu, self.tables.global_plan(source >= self.cfg.decoder_start, src.ratio))
        return self.views[source]

    # ------------------------------------------------------------------ window KV
    def window_keys(self, layer: int, kv: Tensor, batch: RowBatch) -> WindowKeys:
        E = self.cfg.decoder_start
        decoder = layer > E  # NOTE: layer E's keys are the encoder rows, its queries the decoder's
        rows, ring_s, ring_p = self.slots.ring_rows[layer], self.slots.ring_scales[layer], self.slots.ring_pos[layer]
        S = ring_p.shape[1]
        if self.in_place:  # NOTE: one new row per request: storing it first overwrites no key it reads
            torch.ops.cedar_cpu.fp8_ring_store(kv.contiguous(), self.tables.slots, batch.pos, rows, ring_s, ring_p)
            return WindowKeys(kv[:0], batch.pos[:0], batch.cu, RingPlan(rows, ring_s, ring_p, self.tables.slots,
                                                                       self.tables.enc.owner))
        lay = self.tables.ring(decoder, S)
        plan = self.tables.window_plan(layer >= E, decoder, S)
        if self.cpp and self.NATIVE_WINDOW:  # NOTE: the same codes, keys and ring writes as below, one C++ call
            keys, key_pos = torch.ops.cedar_cpu.fp8_window_keys(
                kv.float().contiguous(), lay.ring_src, lay.ring_first, lay.perm, lay.write_src, lay.write_dst,
                batch.pos, rows.view(-1, rows.shape[-1]), ring_s.view(-1, ring_s.shape[-1]), ring_p.view(-1))
            return WindowKeys(keys, key_pos, lay.cu, plan)
        codes, scales = self.codec.encode("window", kv)
        new = self.codec.decode("window", codes, scales)
        flat_rows, flat_scales, flat_pos = rows.view(-1, rows.shape[-1]), ring_s.view(-1, ring_s.shape[-1]), ring_p.view(-1)
        old_pos = flat_pos[lay.ring_src]
        old_pos = torch.where(old_pos < lay.ring_first, old_pos, -1)  # only rows written before this forward
        old = self.codec.decode("window", flat_rows[lay.ring_src], flat_scales[lay.ring_src])
        keys = torch.cat([new, old])[lay.perm]
        key_pos = torch.cat([batch.pos, old_pos])[lay.perm]
        flat_rows[lay.write_dst] = codes[lay.write_src]  # NOTE: after the ring was read
        flat_scales[lay.write_dst] = scales[lay.write_src]
        flat_pos[lay.write_dst] = batch.pos[lay.write_src]
        return WindowKeys(keys, key_pos, lay.cu, plan)

    def window_floor(self, layer: int) -> Tensor:
        return self.tables.dec_floor if layer > self.cfg.decoder_start else self.tables.enc_floor

    def attend_in_place(self, layer, p, batch: RowBatch, selections: dict[int, Tensor], store: bool) -> Tensor | None:
        """A decode step's layer attention in one C++ call (``cedar_cpu::decode_attention``): the
        same kernels on the same inputs as ``window_keys`` + the model's per-kernel attention."""
        if not self.one_call():
            return None
        cfg, i = self.cfg, layer.layer_id
        t = self.tables
        decoder = i > cfg.decoder_start
        if decoder not in self.row_floors:  # NOTE: per request -> per row, once a forward
            self.row_floors[decoder] = self.window_floor(i).long()[t.enc.owner]
        source = cfg.kv_source_of(i)
        g = [None] * 8
        if source is not None:
            view = self.global_view(source)
            v = view.plan
            g = [v.rows, v.row_scales, v.index_rows, v.index_scales, v.entry_rows, v.cu_c, v.row_req, view.entry_pos]
        idx = source is not None and layer.has_indexer
        o, sel = torch.ops.cedar_cpu.decode_attention(
            p.q, p.kv if store else None, self.slots.ring_rows[i], self.slots.ring_scales[i], self.slots.ring_pos[i],
            t.slots, batch.pos, self.row_floors[decoder], layer.sink, cfg.sliding_window, layer.scale, *g,
            p.iq if idx else None, p.iw if idx else None, cfg.index_topk,
            selections[cfg.topk_source_of(i)] if source is not None and not idx else None)
        if idx:
            selections[i] = sel
        return o

    # ------------------------------------------------------------------ the cut
    def decoder_rows(self, h: Tensor, batch: RowBatch) -> DecoderRows | None:
        t = self.tables
        enc_out = self.slots.enc_out.view(-1, h.shape[1])
        hidden = rows_of_cut(h, enc_out, t.dec_src)  # NOTE: read before this forward's outputs are kept
        enc_out[t.enc_out_dst] = h[t.enc_out_src]
        self.slots.enc_pos.view(-1)[t.enc_out_dst] = batch.pos[t.enc_out_src]
        return DecoderRows(hidden, t.dec.batch, t.dec_source_row)

    def commit(self) -> None:
        """After the forward: each owner's state now reaches its sequence end."""
        for req in self.plan.requests:
            owner = self.slots.owners[req.slot]
            owner.next_pos = req.seq_len
            owner.replayed_tokens += req.replayed
            owner.hasher.advance(req.token_slots, self.pools.token_ids, req.seq_len)
            if req.decoder != "skip":
                owner.decoder_pos = req.seq_len
