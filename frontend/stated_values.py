"""Arguments narrowed to the values a conversation states (PICARD / GENRE-style constrained
decoding, an opt-in mode: `gen_call(..., stated=StatedValues.of(texts))`).

A tool call's schema admits any string up to its length bound and any number in its range, so a
model that cannot yet copy writes a plausible value that was never said ("user says 21, model
writes 8"). This mode builds, from the conversation's texts (the user's messages and the tool
results, not the system prompt with its schemas), the set of values they state, and narrows each
free leaf of the arguments' schema to them:

- an ``integer`` to the integer literals stated within its range (an ``enum``), a ``number`` to
  every numeric literal within it (a literal is whole: 5 is not taken from -5, 15, 5.3 or x5; a
  decimal one becomes a one-point range, ``minimum`` = ``maximum``, as xgrammar writes an enum's
  decimals to 17 digits, 49.86 as 49.859999999999999, and a one-point range as stated);
- a ``string`` to the stated spans that fit its bounds (length, ``pattern``): every double-quoted
  span, and every run of 1 to :data:`MAX_WORDS` consecutive words not broken by punctuation (a
  word: a run of non-space, its outer punctuation stripped), printable ASCII without ``"`` and
  ``\\`` (what the grammar's strings admit, `schema.grammar_schema`), never holding ``</``
  (closing markup, which the server's argument strings refuse);
- arrays through their items, objects through their properties, ``anyOf`` / ``oneOf`` through
  each branch.

A leaf that already has an ``enum`` or ``const``, a boolean, or a leaf for which the conversation
states no admissible value keeps its schema: the mode never makes a call impossible. The model still
chooses which stated value goes where (the wrong span is still a wrong value), but it can no longer
make one up. NOTE: where a right value is not stated verbatim (a unit converted, a date
normalised), the mode cannot write it; report its figures apart from the plain constrained ones
(`cedar evaluate --stated-values`), as PICARD's are.

Candidates are the most recent first and at most :data:`MAX_CANDIDATES` per leaf (a long tool
result must not make a grammar of thousands of alternatives).

Over the OpenAI API (`/v1/chat/completions`, the `openai` client): :func:`narrow_tools` gives a
request's ``tools`` narrowed to what its ``messages`` state (the user and ``tool`` messages), each
marked ``strict``, so the server constrains every call it parses by the narrowed schema, with
``tool_choice`` ``auto`` as well as ``required`` (SGLang compiles strict tools' schemas into the
call's grammar). A client narrows anew before each request, as the conversation grows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_WORDS = 4  # the longest run of words a string candidate spans
MAX_CANDIDATES = 256  # per leaf, the most recent first
MAX_CHARS = 200  # the longest string candidate

_NUMBER = re.compile(r"(?<![0-9A-Za-z.\-])-?\d+(?:\.\d+)?(?![0-9A-Za-z]|\.[0-9])")
_QUOTED = re.compile(r'"([^"\\\n]{1,%d})"' % MAX_CHARS)
_WORD = re.compile(r"\S+")
_OUTER = "\"'`([{<.,;:!?)]}>"
_GRAMMAR_CHARS = re.compile(r"[ !#-\[\]-~]+")  # printable ASCII without '"' and '\\' (schema.grammar_schema)


@dataclass(frozen=True)
class StatedValues:
    """The values a conversation states, the most recent first: ``numbers`` as JSON numbers (int
    for an integer literal, float for a decimal one) and ``strings`` (quoted spans and word runs)."""

    numbers: tuple[int | float, ...]
    strings: tuple[str, ...]

    @classmethod
    def of(cls, texts: list[str]) -> "StatedValues":
        """The values stated in ``texts`` (in conversation order: the last is the most recent)."""
        numbers, strings = {}, {}
        for text in reversed(texts):
            for m in reversed(list(_NUMBER.finditer(text))):
                lit = m.group()
                numbers.setdefault(lit, float(lit) if "." in lit else int(lit))
            for s in reversed(_spans(text)):
                strings.setdefault(s, None)
        return cls(tuple(numbers.values()), tuple(strings))

    def narrow(self, schema):
        """``schema`` (a JSON schema; not changed) with each free leaf narrowed to the stated
        values it admits (see the module doc)."""
        if isinstance(schema, list):
            return [self.narrow(s) for s in schema]
        if not isinstance(schema, dict) or {"enum", "const"} & schema.keys():
            return schema
        out = dict(schema)
        for key in ("anyOf", "oneOf"):
            if key in out:
                out[key] = [self.narrow(s) for s in out[key]]
        if "properties" in out:
            out["properties"] = {k: self.narrow(v) for k, v in out["properties"].items()}
        if isinstance(out.get("items"), dict):
            out["items"] = self.narrow(out["items"])
        kind = out.get("type")
        if kind in ("integer", "number", "string"):
            found = self._admitted(out, kind)[:MAX_CANDIDATES]
            whole = [x for x in found if not isinstance(x, float)]
            if found and len(whole) == len(found):
                return {"type": kind, "enum": found, **_annotations(out)}
            if found:  # NOTE: a decimal as a one-point range: xgrammar writes an enum's 49.86 as 49.859999999999999
                points = [{"type": "number", "minimum": x, "maximum": x} for x in found if isinstance(x, float)]
                return {"anyOf": ([{"type": "number", "enum": whole}] if whole else []) + points, **_annotations(out)}
        return out

    def _admitted(self, schema: dict, kind: str) -> list:
        if kind == "string":
            lo, hi = schema.get("minLength", 0), schema.get("maxLength")
            pattern = re.compile(schema["pattern"]) if "pattern" in schema else None
            return [s for s in self.strings if len(s) >= lo and (hi is None or len(s) <= hi)
                    and (pattern is None or pattern.search(s))]
        seen, out = set(), []
        for x in self.numbers:  # NOTE: 3 and 3.0 are one JSON value: the most recent literal stays
            if (kind == "number" or isinstance(x, int)) and _in_range(x, schema) and x not in seen:
                seen.add(x)
                out.append(x)
        return out


def said_texts(messages: list[dict]) -> list[str]:
    """The texts an OpenAI-style chat states values in, in order: the ``user`` and ``tool``
    messages' contents (a string, or the text parts of a list); not the system prompt, whose tool
    schemas and instructions state no request's values, nor the assistant's own messages."""
    out = []
    for m in messages:
        if m.get("role") not in ("user", "tool"):
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)]
    return out


def narrow_tools(tools: list[dict], messages: list[dict]) -> list[dict]:
    """OpenAI-style ``tools`` for the next request of the chat ``messages``: each function's
    ``parameters`` narrowed to the values the chat states (:func:`said_texts`,
    `StatedValues.narrow`) and ``strict`` set, so that the server constrains the calls by them.
    ``tools`` is not changed. A function without parameters keeps none."""
    stated = StatedValues.of(said_texts(messages))
    out = []
    for i, spec in enumerate(tools):
        if not isinstance(spec, dict) or not isinstance(spec.get("function"), dict):
            raise ValueError(f"tools[{i}] is not an OpenAI function tool ({{'type': 'function', 'function': {{...}}}})")
        fn = dict(spec["function"])
        if "parameters" in fn:
            fn["parameters"] = stated.narrow(fn["parameters"])
        fn["strict"] = True
        out.append({**spec, "function": fn})
    return out


def admitted(leaf: dict) -> list | None:
    """The values a leaf `StatedValues.narrow` wrote admits (None for a leaf it did not narrow)."""
    if "enum" in leaf:
        return list(leaf["enum"])
    if "anyOf" in leaf and all("enum" in b or ("minimum" in b and b["minimum"] == b.get("maximum"))
                                   for b in leaf["anyOf"]):
        return [x for b in leaf["anyOf"] for x in (b["enum"] if "enum" in b else [b["minimum"]])]
    return None


def _annotations(schema: dict) -> dict:
    """The keys that describe a leaf without constraining it (kept on a narrowed leaf)."""
    return {k: schema[k] for k in ("title", "description") if k in schema}


def _in_range(x, schema: dict) -> bool:
    """x within the leaf's bounds (and a whole multiple of an integer ``multipleOf``)."""
    step = schema.get("multipleOf")
    return not (("minimum" in schema and x < schema["minimum"]) or ("maximum" in schema and x > schema["maximum"])
                or ("exclusiveMinimum" in schema and x <= schema["exclusiveMinimum"])
                or ("exclusiveMaximum" in schema and x >= schema["exclusiveMaximum"])
                or (isinstance(step, int) and (not isinstance(x, int) or x % step)))


def _spans(text: str) -> list[str]:
    """A text's string candidates in text order: its double-quoted spans, then every run of 1 to
    MAX_WORDS consecutive words (outer punctuation stripped; a run does not cross punctuation
    between its words: "Oslo, Bergen" gives "Oslo" and "Bergen", not the pair), the grammar's
    characters only."""
    words = []  # (start, end, punctuation stripped before, after)
    for m in _WORD.finditer(text):
        a, b = m.start(), m.end()
        while a < b and text[a] in _OUTER:
            a += 1
        while b > a and text[b - 1] in _OUTER:
            b -= 1
        if a < b:
            words.append((a, b, a > m.start(), b < m.end()))
    spans = [m.group(1).strip() for m in _QUOTED.finditer(text)]
    for i in range(len(words)):
        for j in range(i, min(i + MAX_WORDS, len(words))):
            if j > i and (words[j - 1][3] or words[j][2]):
                break
            spans.append(text[words[i][0]:words[j][1]])
    # NOTE: no `</`: a call's argument never spells closing markup (the server's strings refuse it,
    # `tool_call_hooks.markup_free_strings`); a candidate is a literal the grammar would let through
    return [s for s in spans if s and len(s) <= MAX_CHARS and _GRAMMAR_CHARS.fullmatch(s) and "</" not in s]


__all__ = ["StatedValues", "admitted", "narrow_tools", "said_texts", "MAX_WORDS", "MAX_CANDIDATES"]
