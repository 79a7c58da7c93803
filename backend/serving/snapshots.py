"""Exact continuation (SPEC section 3): when a request finishes, its slot's private state (window
rings, compressor tails, encoder outputs) may be kept, so that the next turn of a multi-turn
session (new prompt = old prompt + old output + new text) restores it and replays nothing.

A snapshot is keyed by a digest of the (token slot, token id) pairs of the prefix it continues,
at each of its last few page boundaries: a later request whose prefix hit ends at one of them,
over the very same token slots and tokens, restores it. The digest makes restoring stale state
impossible: a prefix that was evicted and recomputed lives in other token slots. Snapshots are
kept LRU within a byte budget; when the budget is exhausted the oldest are dropped (a later hit
then falls back to bounded replay).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from .prefix_digest import PrefixHasher, prefix_digest
from .pools import RequestSlots, SlotOwner


@dataclass
class Snapshot:
    owner: SlotOwner
    tensors: dict[str, Tensor]  # name -> the slot's row of each private tensor
    nbytes: int


class SnapshotStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._by_key: dict[tuple[int, str], int] = {}  # (boundary position, digest) -> snapshot id
        self._snaps: OrderedDict[int, tuple[Snapshot, list[tuple[int, str]]]] = OrderedDict()
        self._by_rid: dict[str, int] = {}  # the snapshot a finished request left, until re-keyed
        self._next_id = 0
        self.saved = self.restored = self.dropped = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def save(self, slots: RequestSlots, slot: int, hasher: PrefixHasher) -> bool:
        """Copy ``slot``'s private state, restorable at each boundary ``hasher`` remembers."""
        keys = list(hasher.boundaries.items())
        tensors = {name: t[slot].clone() for name, t in slots.slot_tensors().items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if not keys or nbytes > self.budget_bytes:
            return False
        while self.used_bytes + nbytes > self.budget_bytes:
            self._drop_oldest()
        owner = slots.owners[slot]
        snap = Snapshot(SlotOwner(owner.rid, owner.next_pos, owner.decoder_pos, owner.window_floor,
                                  hasher=None), tensors, nbytes)
        sid, self._next_id = self._next_id, self._next_id + 1
        self._snaps[sid] = (snap, keys)
        for key in keys:
            self._by_key[key] = sid
        self._by_rid[owner.rid] = sid
        while len(self._by_rid) > 256:  # requests whose tree insert never came (aborted)
            self._by_rid.pop(next(iter(self._by_rid)))
        self.used_bytes += nbytes
        self.saved += 1
        return True

    def rekey(self, rid: str, tree_slots: Tensor, token_ids_of_slot: Tensor) -> None:
        """Key ``rid``'s snapshot by the token slots the radix tree kept for its prefix.

        tree_slots: (n,) the slots the tree holds for the request's first n tokens (its own, or
        an earlier copy's); token_ids_of_slot: the pool's token-id table.

        NOTE: when two requests computed the same tokens at the same positions concurrently, the
        tree keeps the first copy and frees the other's slots, so the second request's next turn
        hits over the first one's slots and its snapshot (keyed by its own slots) would never be
        restored. Boundaries beyond what the tree kept are dropped, so keys over freed slots can
        never match.
        """
        sid = self._by_rid.pop(rid, None)
        if sid is None or sid not in self._snaps:
            return
        snap, keys = self._snaps[sid]
        for key in keys:
            if self._by_key.get(key) == sid:
                del self._by_key[key]
        slots = tree_slots.long()
        new_keys = [(b, prefix_digest(slots[:b], token_ids_of_slot[slots[:b]]))
                    for b, _ in keys if b <= slots.numel()]
        for key in new_keys:
            self._by_key[key] = sid
        self._snaps[sid] = (snap, new_keys)

    def contains(self, hit: int, digest: str) -> bool:
        """Whether :meth:`restore` at ``hit`` over a prefix of this digest would succeed now."""
        return self.donor(hit, digest) is not None

    def donor(self, hit: int, digest: str) -> str | None:
        """The request whose finished state a restore at (hit, digest) would load, if any."""
        sid = self._by_key.get((hit, digest))
        return None if sid is None else self._snaps[sid][0].owner.rid

    def restore(self, slots: RequestSlots, slot: int, rid: str, hit: int, digest: str) -> bool:
        """If a snapshot continues exactly at ``hit`` over the same prefix, load it into ``slot``
        (its owner becomes ``rid`` at position ``hit``) and return True."""
        sid = self._by_key.get((hit, digest))
        if sid is None:
            return False
        snap, _ = self._snaps[sid]
        self._snaps.move_to_end(sid)
        for name, t in slots.slot_tensors().items():
            t[slot] = snap.tensors[name]
        # NOTE: the finished request's rows at positions >= hit are not the new request's: their
        # tags are cleared (readers only read tagged positions), and the compressor tail of a
        # page-aligned position is empty.
        for pos in (*slots.ring_pos.values(), slots.enc_pos):
            pos[slot].masked_fill_(pos[slot] >= hit, -1)
        for s in slots.tail_len:
            slots.tail_len[s][slot] = 0
        slots.owners[slot] = SlotOwner(rid=rid, next_pos=hit, decoder_pos=min(hit, snap.owner.decoder_pos),
                                       window_floor=snap.owner.window_floor, cached_tokens=hit,
                                       restored_tokens=hit, hasher=PrefixHasher(slots.cfg.page_size))
        self.restored += 1
        return True

    def _drop_oldest(self) -> None:
        sid, (snap, keys) = self._snaps.popitem(last=False)
        for key in keys:
            if self._by_key.get(key) == sid:
                del self._by_key[key]
        self.used_bytes -= snap.nbytes
        self.dropped += 1

    def check(self) -> list[str]:
        """Broken invariants of the store (empty: all hold)."""
        bad = []
        used = sum(snap.nbytes for snap, _ in self._snaps.values())
        if used != self.used_bytes or used > self.budget_bytes:
            bad.append(f"snapshot bytes {used} (counted {self.used_bytes}) against a budget of {self.budget_bytes}")
        stale = [key for key, sid in self._by_key.items() if sid not in self._snaps]
        if stale:
            bad.append(f"{len(stale)} snapshot keys name dropped snapshots")
        return bad

    def stats(self) -> dict:
        return {"snapshots": len(self), "snapshot_bytes": self.used_bytes, "snapshot_budget_bytes": self.budget_bytes,
                "saved": self.saved, "restored": self.restored, "dropped": self.dropped}
