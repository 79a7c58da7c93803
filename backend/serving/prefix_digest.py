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
    h.update(torch.stack([token_slots.long(), token_ids.long()], 1).numpy().tobytes())
    return h.hexdigest()


class PrefixHasher:
    """Incremental digest of a request's (slot, token) pairs, remembering it at page boundaries."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._h = hashlib.blake2b(digest_size=16)
        self.upto = 0  # positions [0, upto) are hashed; upto is page-aligned
        self.boundaries: OrderedDict[int, str] = OrderedDict()

    def advance(self, token_slots: Tensor, token_ids_of_slot: Tensor, seq_len: int) -> None:
        """token_slots: (>= seq_len,) the request's slots; token_ids_of_slot: the pool's table."""
        end = seq_len - seq_len % self.page_size
        if end <= self.upto:
            return
        # NOTE: only the last KEEP_BOUNDARIES boundaries are kept: hash everything before them in
        # one update (the same bytes as page by page), then page by page.
        bulk = max(self.upto, end - KEEP_BOUNDARIES * self.page_size)
        self._update(token_slots, token_ids_of_slot, self.upto, bulk)
        self.upto = bulk
        while self.upto < end:
            nxt = self.upto + self.page_size
            self._update(token_slots, token_ids_of_slot, self.upto, nxt)
            self.upto = nxt
            self.boundaries[nxt] = self._h.copy().hexdigest()
            while len(self.boundaries) > KEEP_BOUNDARIES:
                self.boundaries.popitem(last=False)

    def _update(self, token_slots: Tensor, token_ids_of_slot: Tensor, start: int, stop: int) -> None:
        if stop > start:
            slots = token_slots[start:stop].long()
            self._h.update(torch.stack([slots, token_ids_of_slot[slots].long()], 1).numpy().tobytes())
