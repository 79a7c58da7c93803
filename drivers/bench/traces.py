"""Request traces as token ids a small model can serve, and their theoretical prefix-hit rate.

Two formats:

- **Mooncake** (FAST'25 release, ``../shared/data/mooncake_fast25/``): one JSON object per line,
  ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, 512-token
  blocks; equal hash = identical block. Requests are independent (no sessions).
- **Cedar sessions** (JSONL, one request per line; documented in ``docs/bench/traces.md``):
  ``{"session": str, "parent": str | null, "input_length": n, "output_length": m,
  "hash_ids": [...], "block_size": b, "think_s": s}``. A session's requests come in file order;
  a session with a ``parent`` is a subagent, run as a child joined before the parent's next
  request. Each session's prompts start with a per-session marker, so two sessions never share
  cache by accident (as AgentX does); blocks shared inside a session (and with its subagents, which
take the root session's marker) are shared tokens.

Every block maps deterministically to ``tokens_per_block`` token ids drawn from its hash (a
partial last block to its share of them, at least one), so equal hashes give equal tokens and a
trace of 100k-token prompts fits a model with a 16k context.

The theoretical hit rate is what an infinite cache would serve: for each request, the longest
prefix of its token ids that an earlier request's prompt (in arrival order) already held,
page-aligned and at most ``len - 1`` tokens (SGLang always computes the last prompt token).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .common import FIRST_ID

MOONCAKE_BLOCK = 512


@dataclass(frozen=True)
class TraceRequest:
    input_length: int  # tokens in the trace (before mapping)
    output_length: int
    hash_ids: tuple[int, ...]
    block_size: int
    timestamp_ms: float = 0.0
    session: str | None = None
    parent: str | None = None
    think_s: float = 0.0


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake or Cedar-session JSONL trace (the format is told by its fields)."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"input_length", "output_length", "hash_ids"} - set(row)
            if missing:
                raise ValueError(f"{path}:{n + 1}: a trace request needs {sorted(missing)}")
            out.append(TraceRequest(int(row["input_length"]), int(row["output_length"]), tuple(row["hash_ids"]),
                                    int(row.get("block_size", MOONCAKE_BLOCK)), float(row.get("timestamp", 0.0)),
                                    row.get("session"), row.get("parent"), float(row.get("think_s", 0.0))))
    return out


@dataclass(frozen=True)
class TokenMap:
    """How trace blocks become token ids for a model with ``vocab_size`` tokens."""

    vocab_size: int
    tokens_per_block: int = 4
    marker_tokens: int = 2  # per-session marker (a page of the shipped models)
    seed: int = 0

    def block(self, hash_id: int, share: float = 1.0) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + hash_id)
        ids = [rng.randrange(FIRST_ID, self.vocab_size) for _ in range(self.tokens_per_block)]
        return ids[:max(1, round(share * self.tokens_per_block))]

    def marker(self, session: str) -> list[int]:
        rng = random.Random(f"{self.seed}:session:{session}")
        return [rng.randrange(FIRST_ID, self.vocab_size) for _ in range(self.marker_tokens)]

    def prompt(self, req: TraceRequest, root: str | None = None) -> list[int]:
        """The request's token ids: the marker of its root session (``root``, default its own
        session: a subagent shares its parent's marker, so it can share the parent's system
        prompt), then each block's tokens."""
        ids = self.marker(root or req.session) if req.session is not None else []
        for i, h in enumerate(req.hash_ids):
            rest = req.input_length - i * req.block_size
            ids += self.block(h, min(1.0, rest / req.block_size) if rest > 0 else 1.0 / req.block_size)
        return ids

    def output_len(self, req: TraceRequest) -> int:
        return max(1, round(req.output_length * self.tokens_per_block / req.block_size))


class PrefixTrie:
    def __init__(self) -> None:
        self.root: dict = {}

    def insert(self, ids: list[int]) -> None:
        node = self.root
        for t in ids:
            node = node.setdefault(t, {})

    def match(self, ids: list[int]) -> int:
        node, n = self.root, 0
        for t in ids:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n


def served_hit(trie: PrefixTrie, ids: list[int], page_size: int) -> int:
    """The prefix of ``ids`` a radix cache holding ``trie`` serves: page-aligned, at most
    ``len - 1`` (SGLang always computes the last prompt token)."""
    return max(0, min(trie.match(ids), len(ids) - 1)) // page_size * page_size


def theoretical_hits(prompts: list[list[int]], page_size: int) -> list[int]:
    """Per prompt (in arrival order), the tokens an infinite prefix cache serves."""
    trie, out = PrefixTrie(), []
    for ids in prompts:
        out.append(served_hit(trie, ids, page_size))
        trie.insert(ids)
    return out
