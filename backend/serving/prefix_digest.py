"""Digests of a request's prefix as (token slot, token id) pairs: equal digests mean the same
tokens in the very same token slots, i.e. the same shared global KV rows of the radix tree."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
from torch import Tensor

KEEP_BOUNDARIES = 4  # page boundaries a hasher remembers (overlap scheduling runs a step ahead)


def prefix_digest(token_slots: Tensor, token_ids: Tensor) -> str:
    """Digest of positions [0, n): token_slots (n,) int64, token_ids (n,) int64."""
    h = hashlib.blake2b(digest_size=16)
    h.update(torch.stack([token_slots.long(), token_ids.long()], 1).cpu().numpy().tobytes())
    return h.hexdigest()


class PrefixHasher:
    """Incremental digest of a request's (slot, token) pairs, remembering it at page boundaries.

    NOTE: :meth:`advance` runs in every forward's commit; it only gathers the new pages' pairs on
    their device (reading them back there would stall each step on the device). They are hashed
    when :attr:`boundaries` is read (a snapshot save, off the forward): the same bytes in the
    same order, gathered when the forward wrote them, so the same digests."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._h = hashlib.blake2b(digest_size=16)
        self.upto = 0  # pairs of positions [0, upto) are gathered; upto is page-aligned
        self._hashed = 0  # positions [0, _hashed) are hashed
        self._pending: list[Tensor] = []  # (n, 2) int64 (slot, token) pairs of [_hashed, upto), in order
        self._boundaries: OrderedDict[int, str] = OrderedDict()

    @property
    def boundaries(self) -> OrderedDict[int, str]:
        """The digest of [0, b) for the last KEEP_BOUNDARIES page boundaries b (hashes what is pending)."""
        if self._pending:
            pairs = torch.cat(self._pending).cpu()
            self._pending = []
            self._hash(pairs, self._hashed, self.upto)
        return self._boundaries

    def advance(self, token_slots: Tensor, token_ids_of_slot: Tensor, seq_len: int) -> None:
        """token_slots: (>= seq_len,) the request's slots; token_ids_of_slot: the pool's table."""
        end = seq_len - seq_len % self.page_size
        if end <= self.upto:
            return
        slots = token_slots[self.upto:end].long()
        self._pending.append(torch.stack([slots, token_ids_of_slot[slots].long()], 1))
        self.upto = end
        if len(self._pending) > 64:  # NOTE: bound the list, still on the device
            self._pending = [torch.cat(self._pending)]

    def _hash(self, pairs: Tensor, start: int, end: int) -> None:
        """pairs: (end - start, 2) of positions [start, end), on the host."""
        # NOTE: only the last KEEP_BOUNDARIES boundaries are kept: hash everything before them in
        # one update (the same bytes as page by page), then page by page.
        bulk = max(start, end - KEEP_BOUNDARIES * self.page_size)
        self._update(pairs[: bulk - start])
        pos = bulk
        while pos < end:
            nxt = pos + self.page_size
            self._update(pairs[pos - start:nxt - start])
            pos = nxt
            self._boundaries[nxt] = self._h.copy().hexdigest()
            while len(self._boundaries) > KEEP_BOUNDARIES:
                self._boundaries.popitem(last=False)
        self._hashed = end

    def _update(self, pairs: Tensor) -> None:
        if pairs.shape[0]:
            self._h.update(pairs.numpy().tobytes())
