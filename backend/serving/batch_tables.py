"""BatchTables: every per-request fact of one served forward as index tensors, built once.

The planner (:mod:`planner`) decides what each request runs; this module turns those decisions
into the gather / scatter indices that :class:`~cedar.backend.serving.pool_keys.PoolKeys` and the
batched kernels use in every layer, so that no layer loops over requests or reads a tensor back
to the host. Built on the host in a handful of vectorised ops per forward; nothing in it assumes
a CPU (the same tables can live on a GPU).

Row sets: the *encoder rows* are the forward's rows (each request's replay rows, then its
scheduled rows); the *decoder rows* are what the layers after the cut run on (all of a request's
rows, its last-W tail, carried-over rows included, or none). Each is consecutive positions per
request, so a row's place follows from its request's first position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from cedar.kernels.plans import GlobalPlan, WindowPlan, global_plan, segments, window_plan

from ..config import CEDConfig
from ..rows import RowBatch
from .planner import ServedForward
from .pools import RequestSlots


@dataclass(frozen=True)
class RowSet:
    batch: RowBatch  # positions and rows per request
    first: Tensor  # (B,) int64 first position of each request's rows (its seq_len if none)
    lens: Tensor  # (B,) int64 rows per request
    cu: Tensor  # (B + 1,) int64 row offsets
    owner: Tensor  # (T,) int64 request of every row


def _row_set(first: Tensor, lens: Tensor) -> RowSet:
    owner, offset = segments(lens)
    cu = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    return RowSet(RowBatch(first[owner] + offset, tuple(lens.tolist())), first, lens, cu, owner)


@dataclass(frozen=True)
class GroupWrites:
    """One compression ratio's global-row writes. Rows are gathered from ``cat(kv (T, D),
    pending tails (num_slots * (r - 1), D))``: a group that started in an earlier forward reads
    its first rows from the slot's tail."""

    src: Tensor  # (G * r,) int64 source row of each group member, group-major
    first_pos: Tensor  # (G,) int64 group start positions
    dst: Tensor  # (G,) int64 pool row (token slot // r) of each group
    tail_src: Tensor  # (n,) int64 kv row kept pending (the incomplete last group)
    tail_dst: Tensor  # (n,) int64 flat tail index slot * (r - 1) + pos % r
    tail_len: Tensor  # (B,) int64 pending rows per request after the forward


@dataclass(frozen=True)
class EntryLayout:
    """Each request's global entries of one ratio, ragged: request b's in rows cu[b]:cu[b+1]."""

    rows: Tensor  # (Nc,) int64 pool row of every entry
    entry_pos: Tensor  # (Nc,) int64 position from which it is visible
    cu: Tensor  # (B + 1,) int32


@dataclass(frozen=True)
class RingLayout:
    """One row set's window keys for rings of ``S`` rows: request b's ragged keys are its S ring
    rows (read before this forward writes), then its new rows."""

    ring_src: Tensor  # (B * S,) int64 flat ring row (slot * S + i) read for each request
    ring_first: Tensor  # (B * S,) int64 the request's first new position (older ring rows only)
    perm: Tensor  # (N,) int64 ragged key row -> row of cat(new rows (T), ring rows (B * S))
    cu: Tensor  # (B + 1,) int32 ragged key offsets
    write_src: Tensor  # (n,) int64 new row stored in the ring (each request's last S rows)
    write_dst: Tensor  # (n,) int64 flat ring row slot * S + pos % S


@dataclass
class BatchTables:
    cfg: CEDConfig
    slots: Tensor  # (B,) int64 request slot of each request
    seq_len: Tensor  # (B,) int64
    prefix_len: Tensor  # (B,) int64 cached prefix H: the global write floor
    enc: RowSet
    dec: RowSet
    enc_floor: Tensor  # (B,) int64 lowest readable window position, encoder layers and E
    dec_floor: Tensor  # (B,) int64 the same for the layers after E
    dec_src: Tensor  # (T',) int64 decoder row -> row of cat(h (T), enc_out (num_slots * W))
    dec_source_row: Tensor  # (T',) int64 row in this forward, -1 for a carried-over row
    enc_out_src: Tensor  # (n,) int64 encoder row kept for a later chunk's decoder tail
    enc_out_dst: Tensor  # (n,) int64 flat slot * W + pos % W
    token_slot_flat: Tensor  # (sum seq_len,) int64 every request's token slots, request-major
    token_slot_start: Tensor  # (B,) int64 where each request's slots start in it
    _groups: dict = field(default_factory=dict)
    _entries: dict = field(default_factory=dict)
    _rings: dict = field(default_factory=dict)
    _window_plans: dict = field(default_factory=dict)
    _global_plans: dict = field(default_factory=dict)
    single_row: bool = False  # a decode step: every request runs one row, the decoder on it

    @classmethod
    def build(cls, cfg: CEDConfig, plan: ServedForward, slots: RequestSlots) -> "BatchTables":
        reqs, W = plan.requests, cfg.sliding_window
        long = dict(dtype=torch.long)
        slot = torch.tensor([r.slot for r in reqs], **long)
        seq = torch.tensor([r.seq_len for r in reqs], **long)
        first = torch.tensor([r.row_start for r in reqs], **long)
        floor = torch.tensor([r.window_floor for r in reqs], **long)
        prefix = torch.tensor([r.prefix_len for r in reqs], **long)
        if all(r.num_rows == 1 and r.decoder == "all" for r in reqs):
            return cls._decode(cfg, reqs, slot, seq, prefix, first, floor)
        enc = _row_set(first, seq - first)
        # NOTE: a tail starts at the last W positions, or where the slot's decoder state ends (a
        # restored snapshot's decoder continues from it, reading its rings); only a tail that cut
        # rows the decoder never ran reads nothing below its first row.
        keep = torch.tensor([r.row_start if r.decoder == "all" else
                             max(r.window_floor, r.seq_len - W, r.decoder_pos) if r.decoder == "tail" else r.seq_len
                             for r in reqs], **long)
        dec = _row_set(keep, seq - keep)
        cut = torch.tensor([r.decoder == "tail" and r.seq_len - W > r.decoder_pos for r in reqs])
        T, owner, p = enc.batch.num_rows, dec.owner, dec.batch.pos
        own = p >= first[owner]
        dec_src = torch.where(own, enc.cu[:-1][owner] + p - first[owner], T + slot[owner] * W + p % W)
        carried = ~own
        if carried.any() and not torch.equal(slots.enc_pos.view(-1)[(dec_src - T)[carried]], p[carried]):
            bad = reqs[int(owner[carried][0])].rid
            raise RuntimeError(f"request {bad}: encoder outputs for its decoder tail are missing")
        kept = enc.batch.pos >= seq[enc.owner] - W  # each request's last W encoder outputs
        return cls(cfg, slot, seq, prefix, enc, dec, floor, torch.where(cut, keep, floor), dec_src,
                   torch.where(own, dec_src, -1), torch.nonzero(kept).view(-1),
                   slot[enc.owner][kept] * W + enc.batch.pos[kept] % W,
                   torch.cat([r.token_slots for r in reqs]), torch.cumsum(seq, 0) - seq)

    @classmethod
    def _decode(cls, cfg: CEDConfig, reqs, slot: Tensor, seq: Tensor, prefix: Tensor, first: Tensor,
                floor: Tensor) -> "BatchTables":
        """A decode step (one row per request, the decoder on it): the same tables, written down
        directly (NOTE: the encoder and decoder rows are one row set, so RoPE tables are shared)."""
        B, W = len(reqs), cfg.sliding_window
        rows = torch.arange(B)
        ones = torch.ones(B, dtype=torch.long)
        enc = RowSet(RowBatch(first, (1,) * B), first, ones, torch.arange(B + 1), rows)
        return cls(cfg, slot, seq, prefix, enc, enc, floor, floor, rows, rows, rows, slot * W + first % W,
                   torch.cat([r.token_slots for r in reqs]), torch.cumsum(seq, 0) - seq, single_row=True)

    # ------------------------------------------------------------------ global KV
    def groups(self, ratio: int, tail_len: Tensor | None) -> GroupWrites:
        """Groups of ``ratio`` each request completes in this forward and writes (those ending at
        or above its prefix, the write floor), and its pending tail after it.
        tail_len: (num_slots,) int64 pending rows per slot (ratio > 1), checked against the rows."""
        if ratio in self._groups:
            return self._groups[ratio]
        if self.single_row:
            self._groups[ratio] = self._decode_groups(ratio, tail_len)
            return self._groups[ratio]
        r, enc, T = ratio, self.enc, self.enc.batch.num_rows
        t = enc.first % r
        self._check_tails(r, tail_len, t)
        start = enc.first - t  # (B,) the first group this forward completes starts here
        req, g = segments((self.seq_len - start) // r)
        g_first = start[req] + r * g
        keep = g_first + (r - 1) >= self.prefix_len[req]
        req, g_first = req[keep], g_first[keep]
        member = g_first[:, None] + torch.arange(r)  # (G, r) positions
        from_rows = enc.cu[:-1][req][:, None] + member - enc.first[req][:, None]
        from_tail = T + self.slots[req][:, None] * max(r - 1, 1) + member % r
        src = torch.where(member >= enc.first[req][:, None], from_rows, from_tail).reshape(-1)
        dst = self.token_slot_flat[self.token_slot_start[req] + g_first] // r
        pending = enc.batch.pos >= (self.seq_len - self.seq_len % r)[enc.owner]
        tail_src = torch.nonzero(pending).view(-1)
        tail_dst = self.slots[enc.owner][pending] * max(r - 1, 1) + enc.batch.pos[pending] % r
        out = GroupWrites(src, g_first, dst, tail_src, tail_dst, self.seq_len % r)
        self._groups[ratio] = out
        return out

    def _decode_groups(self, r: int, tail_len: Tensor | None) -> GroupWrites:
        """One row per request at position p: its group completes iff (p + 1) % r == 0, its first
        r - 1 members pending in the slot's tail; else the row joins the tail."""
        p, B = self.enc.first, self.slots.numel()
        self._check_tails(r, tail_len, p % r)
        done = (p + 1) % r == 0
        req = torch.nonzero(done).view(-1)
        j = torch.arange(r)
        src = torch.where(j == r - 1, req[:, None], B + self.slots[req][:, None] * max(r - 1, 1) + j).reshape(-1)
        g_first = p[req] - (r - 1)
        dst = self.token_slot_flat[self.token_slot_start[req] + g_first] // r
        pending = torch.nonzero(~done).view(-1)
        return GroupWrites(src, g_first, dst, pending, self.slots[pending] * max(r - 1, 1) + p[pending] % r,
                           self.seq_len % r)

    def _check_tails(self, r: int, tail_len: Tensor | None, expected: Tensor) -> None:
        if r > 1 and not torch.equal(tail_len[self.slots], expected):
            raise RuntimeError(f"compressor tails disagree with the request positions (ratio {r})")

    def entries(self, ratio: int) -> EntryLayout:
        if ratio not in self._entries:
            counts = self.seq_len // ratio
            req, g = segments(counts)
            cu = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
            rows = self.token_slot_flat[self.token_slot_start[req] + g * ratio] // ratio
            self._entries[ratio] = EntryLayout(rows, (g + 1) * ratio - 1, cu.int())
        return self._entries[ratio]

    def global_plan(self, decoder: bool, ratio: int) -> GlobalPlan:
        key = (decoder, ratio)
        if key not in self._global_plans:
            rows = self.dec if decoder else self.enc
            self._global_plans[key] = global_plan(rows.cu, self.entries(ratio).cu)
        return self._global_plans[key]

    # ------------------------------------------------------------------ window KV
    def ring(self, decoder: bool, S: int) -> RingLayout:
        key = (decoder, S)
        if key not in self._rings:
            rows = self.dec if decoder else self.enc
            T = rows.batch.num_rows
            ring_src = (self.slots[:, None] * S + torch.arange(S)).view(-1)
            n = S + rows.lens
            cu = torch.cat([n.new_zeros(1), torch.cumsum(n, 0)])
            req, off = segments(n)  # off: offset in the request's keys
            perm = torch.where(off < S, T + req * S + off, rows.cu[:-1][req] + off - S)
            kept = rows.batch.pos >= (self.seq_len - S)[rows.owner]
            self._rings[key] = RingLayout(ring_src, rows.first.repeat_interleave(S), perm, cu.int(),
                                          torch.nonzero(kept).view(-1),
                                          self.slots[rows.owner][kept] * S + rows.batch.pos[kept] % S)
        return self._rings[key]

    def window_plan(self, queries_decoder: bool, keys_decoder: bool, S: int) -> WindowPlan:
        key = (queries_decoder, keys_decoder, S)
        if key not in self._window_plans:
            q, k = (self.dec if queries_decoder else self.enc), (self.dec if keys_decoder else self.enc)
            floor = self.dec_floor if keys_decoder else self.enc_floor
            block = max(1, min(self.cfg.sliding_window, int(q.lens.max()) if q.lens.numel() else 1))
            self._window_plans[key] = window_plan(q.cu, q.first, self.ring(keys_decoder, S).cu, k.first, S,
                                                  floor, self.cfg.sliding_window, block)
        return self._window_plans[key]
