"""Length-bounded JSON-schema strings rewritten as patterns, for grammar backends.

xgrammar (0.2.7) takes a string's length bounds or a pattern, not both, and compiles length
bounds to a rule that admits raw control characters (which JSON forbids) and no escapes. A
pattern `^C{lo,hi}$` over a chosen character class `C` says the same bounds without that gap.
Used by the server's grammar hooks (`serving/tool_call_hooks.py`: `JSON_CHAR` for `json_schema`
requests, `TAG_CHAR` inside tool calls) and by the frontend's bounded tool schemas
(`cedar.frontend.schema`, printable ASCII).

NOTE: xgrammar 0.2.7 admits no escapes in a patterned string (the pattern reads raw characters),
so a class is all a bounded string can hold.
"""

from __future__ import annotations

JSON_CHAR = '[^\\x00-\\x1f"\\\\]'  # any character a JSON string holds unescaped
# JSON_CHAR without '<': inside a tool call no bounded argument can spell the closing markup
# (`</tool_call>`). A pattern counts single characters, so the pair `</` cannot be refused under a
# length bound (unbounded strings refuse only the pair: `tool_call_hooks.markup_free_strings`).
TAG_CHAR = '[^\\x00-\\x1f"\\\\<]'
ASCII_CHAR = '[ !#-\\[\\]-~]'  # printable ASCII without '"' (0x22) and '\\' (0x5c)


def strings_as_patterns(schema, char_class: str):
    """`schema` (a new object; the input is not changed) with every string that has length bounds
    and no pattern, format, enum or const restricted to `^{char_class}{lo,hi}$` instead."""
    if isinstance(schema, list):
        return [strings_as_patterns(s, char_class) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strings_as_patterns(v, char_class) for k, v in schema.items()}
    bounded = "maxLength" in out or "minLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = "^%s{%d,%s}$" % (char_class, lo, "" if hi is None else int(hi))
    return out


def pattern_max_len(pattern: str, char_class: str) -> int | None:
    """The upper length bound of a pattern `strings_as_patterns` wrote, else None."""
    head = f"^{char_class}{{"
    if pattern.startswith(head) and pattern.endswith("}$"):
        hi = pattern[len(head):-2].split(",")[-1]
        return int(hi) if hi else None
    return None
