"""BatchTables: every per-request fact of one served forward as index tensors, built once.

The planner (:mod:`planner`) decides what each request runs; this module turns those decisions
into the gather / scatter indices that :class:`~cedar.backend.serving.pool_keys.PoolKeys` and the
batched kernels use in every layer, so that no layer loops over requests or reads a tensor back
to the host. Built on the host in a handful of vectorised ops per forward; nothing in it assumes
a CPU: every table is created on the request slots' device (the pools' device).

NOTE (a decode step): every table a decode step's layers read is sized from host facts the
planner already has (batch size, each request's position and length), never from a device
tensor, and none is cut by a data-dependent mask: the device part of a decode step reads no
value back to the host (``tests/test_decode_step_sync_free.py``).

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
from ..rows import RowBatch, cu_seqlens
from .planner import ServedForward
from .pools import RequestSlots


@dataclass(frozen=True)
class RowSet:
    batch: RowBatch  # positions and rows per request
    first: Tensor  # (B,) int64 first position of each request's rows (its seq_len if none)
    lens: Tensor  # (B,) int64 rows per request
    cu: Tensor  # (B + 1,) int64 row offsets
    owner: Tensor  # (T,) int64 request of every row


def _row_set(first: Tensor, lens: list[int]) -> RowSet:
    """first: (B,) int64 on the tables' device; lens: rows per request, host ints."""
    n = torch.tensor(lens, dtype=torch.long, device=first.device)
    owner, offset = segments(n, sum(lens))
    cu = torch.cat([n.new_zeros(1), torch.cumsum(n, 0)])
    return RowSet(RowBatch(first[owner] + offset, tuple(lens)), first, n, cu, owner)


def _last_rows(rows: RowSet, n: int) -> Tensor:
    """(sum_b min(len_b, n),) int64 each request's last ``n`` rows, ascending (every row set ends
    at its request's last position), sized from the host lengths (no mask read back)."""
    k = rows.lens.clamp_max(n)
    req, off = segments(k, sum(min(m, n) for m in rows.batch.lens))
    return rows.cu[1:][req] - k[req] + off


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
    requests: tuple = ()  # the plan's ServedRequests: host facts that size the tables
    _groups: dict = field(default_factory=dict)
    _entries: dict = field(default_factory=dict)
    _rings: dict = field(default_factory=dict)
    _window_plans: dict = field(default_factory=dict)
    _global_plans: dict = field(default_factory=dict)
    single_row: bool = False  # a decode step: every request runs one row, the decoder on it

    @classmethod
    def build(cls, cfg: CEDConfig, plan: ServedForward, slots: RequestSlots) -> "BatchTables":
        reqs, W, dev = plan.requests, cfg.sliding_window, slots.device
        long = dict(dtype=torch.long, device=dev)
        # NOTE: one host -> device copy for the per-request facts
        facts = torch.tensor([[r.slot, r.seq_len, r.row_start, r.window_floor, r.prefix_len] for r in reqs],
                             dtype=torch.long).view(-1, 5).T.contiguous().to(dev)
        slot, seq, first, floor, prefix = facts.unbind(0)
        if all(r.num_rows == 1 and r.decoder == "all" for r in reqs):
            return cls._decode(cfg, reqs, plan.batch, slot, seq, prefix, floor)
        enc = _row_set(first, [r.seq_len - r.row_start for r in reqs])
        # NOTE: a tail starts at the last W positions, or where the slot's decoder state ends (a
        # restored snapshot's decoder continues from it, reading its rings); only a tail that cut
        # rows the decoder never ran reads nothing below its first row.
        keep_h = [r.row_start if r.decoder == "all" else
                  max(r.window_floor, r.seq_len - W, r.decoder_pos) if r.decoder == "tail" else r.seq_len
                  for r in reqs]
        keep = torch.tensor(keep_h, **long)
        dec = _row_set(keep, [r.seq_len - k for r, k in zip(reqs, keep_h)])
        cut = torch.tensor([r.decoder == "tail" and r.seq_len - W > r.decoder_pos for r in reqs], device=dev)
        T, owner, p = enc.batch.num_rows, dec.owner, dec.batch.pos
        own = p >= first[owner]
        dec_src = torch.where(own, enc.cu[:-1][owner] + p - first[owner], T + slot[owner] * W + p % W)
        carried = ~own
        if carried.any() and not torch.equal(slots.enc_pos.view(-1)[(dec_src - T)[carried]], p[carried]):
            bad = reqs[int(owner[carried][0])].rid
            raise RuntimeError(f"request {bad}: encoder outputs for its decoder tail are missing")
        kept = _last_rows(enc, W)  # each request's last W encoder outputs
        return cls(cfg, slot, seq, prefix, enc, dec, floor, torch.where(cut, keep, floor), dec_src,
                   torch.where(own, dec_src, -1), kept, slot[enc.owner[kept]] * W + enc.batch.pos[kept] % W,
                   torch.cat([r.token_slots for r in reqs]), torch.cumsum(seq, 0) - seq, tuple(reqs))

    @classmethod
    def _decode(cls, cfg: CEDConfig, reqs, batch: RowBatch, slot: Tensor, seq: Tensor, prefix: Tensor,
                floor: Tensor) -> "BatchTables":
        """A decode step (one row per request, the decoder on it): the same tables, written down
        directly. batch: the plan's rows, one a request at its first (only) position.
        NOTE: the encoder and decoder rows are one row set over the plan's own RowBatch, so every
        RoPE table of the step is computed once."""
        B, W, dev = len(reqs), cfg.sliding_window, slot.device
        rows = torch.arange(B, device=dev)
        ones = torch.ones(B, dtype=torch.long, device=dev)
        first = batch.pos
        enc = RowSet(batch, first, ones, torch.arange(B + 1, device=dev), rows)
        return cls(cfg, slot, seq, prefix, enc, enc, floor, floor, rows, rows, rows, slot * W + first % W,
                   torch.cat([r.token_slots for r in reqs]), torch.cumsum(seq, 0) - seq, tuple(reqs),
                   single_row=True)

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
        member = g_first[:, None] + torch.arange(r, device=g_first.device)  # (G, r) positions
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
        r - 1 members pending in the slot's tail; else the row joins the tail.

        NOTE: which requests complete a group is known on the host (the planner's positions), so
        every index is written down there and copied once: no mask is read back from the device.
        (Computing every request's group, complete or not, would fix the shapes at B rows but
        changes the pooled rows' last bits: a GEMM's row results depend on its row count.)"""
        reqs, t = self.requests, max(r - 1, 1)
        self._check_tails(r, tail_len, self.enc.first % r)
        done, pending, flat, start = [], [], [], 0  # flat: token_slot_flat index of a group's first position
        for b, q in enumerate(reqs):
            if (q.row_start + 1) % r == 0:
                done.append(b)
                flat.append(start + q.row_start - (r - 1))
            else:
                pending.append(b)
            start += q.seq_len
        src = [len(reqs) + reqs[b].slot * t + j if j < r - 1 else b for b in done for j in range(r)]
        first_pos = [reqs[b].row_start - (r - 1) for b in done]
        tail_dst = [reqs[b].slot * t + reqs[b].row_start % r for b in pending]
        # NOTE: one host -> device copy for the five index lists
        cut = torch.tensor(src + first_pos + flat + pending + tail_dst, dtype=torch.long).to(self.slots.device)
        src_t, first_t, flat_t, pending_t, tail_t = cut.split([len(src), len(done), len(done), len(pending),
                                                               len(pending)])
        return GroupWrites(src_t, first_t, self.token_slot_flat[flat_t] // r, pending_t, tail_t, self.seq_len % r)

    def _check_tails(self, r: int, tail_len: Tensor | None, expected: Tensor) -> None:
        """NOTE: checked on the device (an asynchronous assert there; it raises at once on CPU)."""
        if r > 1:
            torch._assert_async(torch.all(tail_len[self.slots] == expected),
                                f"compressor tails disagree with the request positions (ratio {r})")

    def entries(self, ratio: int, lag: int = 0) -> EntryLayout:
        """Every request's entries of one ratio; ``lag``: the source's :meth:`CEDConfig.global_lag`."""
        if (ratio, lag) in self._entries:
            return self._entries[ratio, lag]
        if self.single_row:
            self._entries[ratio, lag] = self._decode_entries(ratio, lag)
        else:
            counts = self.seq_len // ratio
            req, g = segments(counts, sum(r.seq_len // ratio for r in self.requests))
            cu = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
            rows = self.token_slot_flat[self.token_slot_start[req] + g * ratio] // ratio
            self._entries[ratio, lag] = EntryLayout(rows, (g + 1) * ratio - 1 + lag, cu.int())
        return self._entries[ratio, lag]

    def _decode_entries(self, ratio: int, lag: int) -> EntryLayout:
        """:meth:`entries` of a decode step from the host facts: a request's entry rows are every
        ``ratio``-th of its token slots (a strided view), its entry positions a prefix of one
        arange (NOTE: the same values as the general path in a third of the ops)."""
        counts = [r.seq_len // ratio for r in self.requests]
        rows = torch.cat([r.token_slots[:c * ratio:ratio] for r, c in zip(self.requests, counts)]) // ratio
        g = torch.arange(max(counts, default=0), device=self.slots.device)
        g = torch.cat([g[:c] for c in counts]) if len(counts) > 1 else g
        cu = cu_seqlens(counts, self.slots.device)
        return EntryLayout(rows, (g + 1) * ratio - 1 + lag, cu)

    def global_plan(self, decoder: bool, ratio: int) -> GlobalPlan:
        key = (decoder, ratio)
        if key not in self._global_plans:
            rows = self.dec if decoder else self.enc
            lag = self.cfg.global_lag(self.cfg.decoder_start) if decoder else 0  # NOTE: the layout it reads
            self._global_plans[key] = global_plan(rows.cu, self.entries(ratio, lag).cu, rows.batch.lens,
                                                  max((r.seq_len // ratio for r in self.requests), default=0))
        return self._global_plans[key]

    # ------------------------------------------------------------------ window KV
    def ring(self, decoder: bool, S: int) -> RingLayout:
        key = (decoder, S)
        if key not in self._rings:
            rows = self.dec if decoder else self.enc
            T = rows.batch.num_rows
            ring_src = (self.slots[:, None] * S + torch.arange(S, device=self.slots.device)).view(-1)
            n = S + rows.lens
            cu = torch.cat([n.new_zeros(1), torch.cumsum(n, 0)])
            req, off = segments(n, S * len(rows.batch.lens) + T)  # off: offset in the request's keys
            perm = torch.where(off < S, T + req * S + off, rows.cu[:-1][req] + off - S)
            kept = _last_rows(rows, S)  # the rows each request's ring keeps
            self._rings[key] = RingLayout(ring_src, rows.first.repeat_interleave(S), perm, cu.int(), kept,
                                          self.slots[rows.owner[kept]] * S + rows.batch.pos[kept] % S)
        return self._rings[key]

    def window_plan(self, queries_decoder: bool, keys_decoder: bool, S: int) -> WindowPlan:
        key = (queries_decoder, keys_decoder, S)
        if key not in self._window_plans:
            q, k = (self.dec if queries_decoder else self.enc), (self.dec if keys_decoder else self.enc)
            floor = self.dec_floor if keys_decoder else self.enc_floor
            block = max(1, min(self.cfg.sliding_window, max(q.batch.lens, default=1)))
            self._window_plans[key] = window_plan(q.cu, q.first, self.ring(keys_decoder, S).cu, k.first, S,
                                                  floor, self.cfg.sliding_window, block, q.batch.lens)
        return self._window_plans[key]
