"""Does a copied value tokenize the same where it is stated and where it is copied?

A model copies a value token for token only when the tokens are the same in both places: " 21"
(after a space) and "21" (after a quote or a colon) are different tokens, and then the model must
translate, not copy. This measures it on rendered sessions, with a real tokenizer, cutting each
session as the training corpus and the endpoint cut it (`build.encode_session`).

The values checked are a session's random ``values`` (what its task drew: entity names, numbers,
codes, string arguments), or, for a session without them, every leaf of a call's arguments (a
string, or a number as JSON writes it). For each value inside a call's arguments that was stated
before the call in a user or tool message, the *statement* is the last such occurrence before
the call; the value is **same** when the token ids overlapping the value's characters are equal
at the statement and at the copy. (A key such as "capital of X" is not itself random: its words
come from a small fixed pool; the entity X in it is.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from cedar.backend.chat_template import CALL_MID, CALL_TAIL
from cedar.backend.tokenizer import END, ROLE_MARKERS

from .build import encode_session, value_at

ARGS = re.compile(re.escape(CALL_MID) + "(.*?)" + re.escape(CALL_TAIL), re.S)
STATED_IN = (ROLE_MARKERS["user"], ROLE_MARKERS["tool"])


@dataclass
class CopyStats:
    copies: int = 0
    same: int = 0
    examples: list = field(default_factory=list)  # a few (value, statement tokens, copy tokens) that differ

    @property
    def share(self) -> float:
        return round(self.same / self.copies, 4) if self.copies else 0.0

    def to_json(self) -> dict:
        return {"copies": self.copies, "same": self.same, "share": self.share, "examples": self.examples}


def _leaves(value) -> list[str]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, bool) or value is None:
        return []
    return [value if isinstance(value, str) else json.dumps(value)]


def _stated_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the bodies of user and tool messages."""
    out = []
    for marker in STATED_IN:
        for m in re.finditer(re.escape(marker), text):
            end = text.find(END, m.end())
            out.append((m.end(), end if end >= 0 else len(text)))
    return sorted(out)


def _tokens(ids, offsets, a: int, b: int) -> tuple[int, ...]:
    return tuple(i for i, (x, y) in zip(ids, offsets) if x < b and y > a)


def copy_stats(sessions: list[dict], tok, stats: CopyStats | None = None, keep: int = 5) -> CopyStats:
    """Accumulate the copy figures of `sessions` ({"kind", "text"}) into `stats`."""
    stats = stats or CopyStats()
    for s in sessions:
        text = s["text"]
        ids, offsets = encode_session(tok, s)
        spans = _stated_spans(text)
        for m in ARGS.finditer(text):
            try:
                args = json.loads(m.group(1))
            except json.JSONDecodeError:  # the tools block's example call
                continue
            for value in s.get("values") or _leaves(args):
                at = value_at(text, value, m.start(1))
                if at < 0 or at + len(value) > m.end(1):
                    continue
                stated = [p for a, b in spans if b <= m.start() for p in _all_at(text, value, a, b)]
                if not stated:
                    continue
                first = stated[-1]
                got = _tokens(ids, offsets, first, first + len(value)) == _tokens(ids, offsets, at, at + len(value))
                stats.copies += 1
                stats.same += got
                if not got and len(stats.examples) < keep:
                    stats.examples.append({"value": value, "stated": tok.decode(list(
                        _tokens(ids, offsets, first, first + len(value))), skip_special_tokens=False)[:40],
                        "stated_tokens": len(_tokens(ids, offsets, first, first + len(value))),
                        "copied_tokens": len(_tokens(ids, offsets, at, at + len(value)))})
    return stats


def _all_at(text: str, value: str, a: int, b: int) -> list[int]:
    out, at = [], value_at(text, value, a)
    while 0 <= at and at + len(value) <= b:
        out.append(at)
        at = value_at(text, value, at + 1)
    return out
