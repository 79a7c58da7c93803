"""Bounded JSON schemas for constrained tool calls.

A constrained call must end inside its `max_tokens`, whatever the model: a weak model given an
unbounded string or number never closes it and runs out of tokens mid-call (the call then fails
to parse). Two functions:

- `grammar_schema(schema)`: the copy of a tool's parameter schema that is sent to the grammar
  backend. Every string becomes printable ASCII without `"` and `\\` (so one character is at most
  one token and no escape sequences are needed), length-bounded through a `pattern` (xgrammar
  takes a pattern or length bounds, not both, and its length-bounded strings admit raw control
  characters that JSON forbids). Everything else is kept as it is.
- `max_json_chars(schema)`: an upper bound on the characters of any JSON text the grammar admits
  for `schema` (the whitespace-free form SGLang writes under
  `--constrained-json-disable-any-whitespace`: `", "` and `": "` between items). Raises
  `UnboundedSchemaError` where no bound exists (a string without `maxLength`, a number without a
  range, an array without `maxItems`, free additional properties): those are the schemas that let
  a call run out of tokens, and the tool registry refuses them.

Since every admitted character is ASCII (enum and const values excepted, counted in UTF-8 bytes),
the bound in characters is also a bound in tokens (a byte-level BPE token covers >= 1 byte).
"""

from __future__ import annotations

import json

from cedar.backend.string_patterns import ASCII_CHAR, pattern_max_len, strings_as_patterns

# NOTE: xgrammar prints a bounded number with at most this many fraction digits (seen on 0.2.7:
# 123.456789012345 is refused in [-1000, 1000]); a generous figure keeps the bound safe.
NUMBER_FRACTION_CHARS = 16
OBJECT_SEPARATOR, KEY_SEPARATOR = ", ", ": "
DEFAULT_MAX_STR = 64
DEFAULT_NUMBER_RANGE = (-1_000_000, 1_000_000)
DEFAULT_MAX_ITEMS = 4


class UnboundedSchemaError(ValueError):
    """A schema whose JSON texts have no length bound."""


def grammar_schema(schema: dict) -> dict:
    """`schema` with every bounded string restricted to printable ASCII (see the module doc)."""
    return strings_as_patterns(schema, ASCII_CHAR)


def with_default_bounds(schema: dict) -> dict:
    """`schema` with the default bounds added where it has none (strings, numbers, arrays,
    objects' additional properties): for tool schemas that come from elsewhere (OpenAI tool
    lists, task files), so that `max_json_chars` exists for them."""
    if isinstance(schema, list):
        return [with_default_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (with_default_bounds(v) if k in ("items", "anyOf", "oneOf") else v) for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: with_default_bounds(v) for k, v in out["properties"].items()}
    kind = out.get("type")
    fixed = {"enum", "const"} & out.keys()
    if kind == "string" and not fixed and not {"maxLength", "pattern"} & out.keys():
        out["maxLength"] = DEFAULT_MAX_STR
    elif kind in ("integer", "number") and not fixed:
        out.setdefault("minimum", DEFAULT_NUMBER_RANGE[0])
        out.setdefault("maximum", DEFAULT_NUMBER_RANGE[1])
    elif kind == "array":
        out.setdefault("maxItems", DEFAULT_MAX_ITEMS)
    elif kind == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out


def max_json_chars(schema: dict, where: str = "#") -> int:
    """Upper bound on the length of any whitespace-free JSON text admitted for `schema`."""
    if "const" in schema:
        return _json_len(schema["const"])
    if "enum" in schema:
        return max(_json_len(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return max(max_json_chars(s, f"{where}/{key}/{i}") for i, s in enumerate(schema[key]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return max(max_json_chars({**schema, "type": k}, where) for k in kind)
    if kind == "string":
        return 2 + _string_chars(schema, where)
    if kind in ("integer", "number"):
        return _number_chars(schema, kind, where)
    if kind == "boolean":
        return len("false")
    if kind == "null":
        return len("null")
    if kind == "array":
        return _array_chars(schema, where)
    if kind == "object" or "properties" in schema:
        return _object_chars(schema, where)
    raise UnboundedSchemaError(f"{where}: no bound for a value of type {kind!r}")


def _json_len(value) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())


def _string_chars(schema: dict, where: str) -> int:
    if "maxLength" in schema:
        return int(schema["maxLength"])
    hi = pattern_max_len(schema.get("pattern", ""), ASCII_CHAR)
    if hi is None:
        raise UnboundedSchemaError(f"{where}: a string needs maxLength")
    return hi


def _number_chars(schema: dict, kind: str, where: str) -> int:
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum", schema.get("exclusiveMaximum"))
    if lo is None or hi is None:
        raise UnboundedSchemaError(f"{where}: {kind} needs minimum and maximum")
    digits = max(len(str(int(abs(lo)))), len(str(int(abs(hi))))) + (1 if lo < 0 else 0)
    return digits if kind == "integer" else digits + 1 + NUMBER_FRACTION_CHARS


def _array_chars(schema: dict, where: str) -> int:
    if "maxItems" not in schema:
        raise UnboundedSchemaError(f"{where}: an array needs maxItems")
    n = int(schema["maxItems"])
    item = max_json_chars(schema.get("items", {}), f"{where}/items") if n else 0
    return 2 + n * item + max(n - 1, 0) * len(OBJECT_SEPARATOR)


def _object_chars(schema: dict, where: str) -> int:
    # NOTE: xgrammar compiles in strict mode: an absent additionalProperties means false
    if schema.get("additionalProperties", False) not in (False, None):
        raise UnboundedSchemaError(f"{where}: an object with free additional properties")
    props = schema.get("properties", {})
    items = [_json_len(k) + len(KEY_SEPARATOR) + max_json_chars(s, f"{where}/properties/{k}")
             for k, s in props.items()]
    return 2 + sum(items) + max(len(items) - 1, 0) * len(OBJECT_SEPARATOR)
