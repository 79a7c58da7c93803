"""An AgentX-shaped session trace, generated from a seed (no recorded AgentX trace is public
here): coding-agent sessions whose every turn re-sends the whole conversation, with subagents.

The shape follows ``../shared/notes/workloads.md`` (AgentX, from InferenceX's published figures):
a long system prompt with the tools' documentation, then per turn about 727 new tokens (tool
results, the user) and an output of about 250, the next turn's prompt being the last prompt plus
that output plus the new tokens; 64-token block hashes; think time between turns; now and then a
subagent that starts from the parent's system prompt, runs a few turns of its own, and is joined
before the parent's next turn. Sizes are lognormal around those medians. The rows are the Cedar
session format (``docs/bench/traces.md``), so ``cedar bench trace`` and ``cedar bench agents``
replay them like any recorded trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

BLOCK = 64


@dataclass(frozen=True)
class AgentShape:
    sessions: int = 12
    turns_median: int = 10
    turns_max: int = 20
    system_tokens: int = 16_000  # system prompt + tool documentation
    new_tokens_median: int = 727  # per turn, uncached: tool results and user messages
    output_median: int = 250
    subagent_share: float = 0.12  # chance that a turn spawns a subagent
    subagent_turns: int = 3
    think_s_median: float = 2.0


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int) -> int:
    return max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))


def agentx_like_rows(shape: AgentShape = AgentShape(), seed: int = 0) -> list[dict]:
    """The trace's rows (one request each), sessions one after another, each subagent's rows
    right after the parent turn that spawned it."""
    rng = random.Random(seed)
    next_hash = [0]

    def blocks(tokens: int) -> list[int]:
        n = max(1, math.ceil(tokens / BLOCK))
        next_hash[0] += n
        return list(range(next_hash[0] - n, next_hash[0]))

    def turns(name: str, parent: str | None, context: list[int], count: int) -> list[dict]:
        out_rows = []
        for t in range(count):
            context = context + blocks(_lognormal(rng, shape.new_tokens_median, 0.8, 16))
            out_len = _lognormal(rng, shape.output_median, 0.6, 8)
            think = 0.0 if t == 0 and parent is not None else round(rng.expovariate(1 / shape.think_s_median), 3)
            out_rows.append({"session": name, "parent": parent, "input_length": BLOCK * len(context),
                             "output_length": out_len, "hash_ids": list(context), "block_size": BLOCK,
                             "think_s": think})
            context = context + blocks(out_len)  # the output is part of the next prompt
            if parent is None and t + 1 < count and rng.random() < shape.subagent_share:
                out_rows += turns(f"{name}.sub{t}", name, system, shape.subagent_turns)
        return out_rows

    rows = []
    for s in range(shape.sessions):
        system = blocks(shape.system_tokens)
        n = min(shape.turns_max, _lognormal(rng, shape.turns_median, 0.5, 4))
        rows += turns(f"s{s}", None, system, n)
    return rows


def write_agentx_like(path: Path, shape: AgentShape = AgentShape(), seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in agentx_like_rows(shape, seed)))
    return path
