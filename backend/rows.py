"""RowBatch: the rows one forward runs, as a ragged batch of requests (FlashInfer-style)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .modules import Rope


def cu_seqlens(lens, device: torch.device | str | None = None) -> Tensor:
    """(B,) counts (host ints) -> (B + 1,) int32 offsets on ``device``: request b owns rows cu[b]:cu[b + 1]."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


@dataclass(frozen=True)
class RowBatch:
    pos: Tensor  # (T,) int64 position of every row
    lens: tuple[int, ...]  # rows per request, len B; request b owns rows cu[b]:cu[b+1]

    @property
    def num_reqs(self) -> int:
        return len(self.lens)

    @property
    def num_rows(self) -> int:
        return int(self.pos.shape[0])

    @cached_property  # NOTE: read by every layer of a forward
    def cu(self) -> Tensor:  # (B + 1,) int32, on the rows' device
        return cu_seqlens(self.lens, self.pos.device)

    def rope(self, dim: int, rope_dim: int, theta: float, fast: bool = False) -> Rope:
        """The rows' RoPE tables, computed on first use and kept for every layer of the forward."""
        cache = self.__dict__.setdefault("_rope", {})
        key = (dim, rope_dim, theta, fast)
        if key not in cache:
            cache[key] = Rope.of(self.pos, dim, rope_dim, theta, fast)
        return cache[key]

    def bounds(self, b: int) -> tuple[int, int]:
        s = sum(self.lens[:b])
        return s, s + self.lens[b]

    @classmethod
    def single(cls, start: int, n: int) -> "RowBatch":
        return cls(torch.arange(start, start + n, dtype=torch.long), (n,))


@dataclass(frozen=True)
class DecoderRows:
    """Rows the layers from E's attention on run. ``hidden``: (T', hidden) encoder outputs;
    ``batch``: their positions per request (same requests, possibly 0 rows each);
    ``source_row``: (T',) int64 index of each row in this forward's rows, -1 for a row carried
    over from an earlier forward (a chunked prefill's decoder tail)."""

    hidden: Tensor
    batch: RowBatch
    source_row: Tensor
