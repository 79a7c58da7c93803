"""Two fixes to SGLang 0.5.23's OpenAI tool calling, through its ``HookRegistry`` (installed by
``sglang_hooks.install``, pinned to the same version and checked by ``tests/test_sglang_hooks.py``).

| target | why |
|---|---|
| XGrammarGrammarBackend.dispatch_structural_tag | (1) a forced call (`required` / named) is one
  call and nothing else, so generation ends with it (see `rewrite_legacy_tag`); (2)
  `--constrained-json-disable-any-whitespace` reaches
  `json_schema` requests but not the structural tags that constrain `tool_choice="required"` /
  named calls (xgrammar compiles a tag's JSON schema with free whitespace and has no switch for
  it): a weak model then fills its whole `max_tokens` with spaces inside the call and no call
  comes back. With the flag set, each tag's schema is compiled to a whitespace-free grammar
  (xgrammar's own `Grammar.from_json_schema(any_whitespace=False)`: `", "` and `": "` between
  items, as `json.dumps` writes them) |
| XGrammarGrammarBackend.dispatch_json | the same string fix (`close_string_gap`) for `json_schema`
  requests (`sgl.gen(json_schema=...)`, `response_format`) |
| OpenAIServingChat._effective_tools | a named `tool_choice` must constrain (and parse) the named
  function only; 0.5.23 builds the call's grammar from every tool in the request, so a call to
  another function passes the grammar |

All apply to any model: they change what the flag and the named choice already promise.
"""

from __future__ import annotations

import json

P = "sglang.srt."
TARGETS = {
    "structural_tag": P + "constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_structural_tag",
    "json": P + "constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_json",
    "effective_tools": P + "entrypoints.openai.serving_chat.OpenAIServingChat._effective_tools",
}


def close_string_gap(schema):
    """`schema` with a pattern added to every length-bounded string that has none.

    NOTE: xgrammar 0.2.7 compiles a `maxLength` / `minLength` string to a rule that admits raw
    control characters (bytes 0x00-0x1f) and no escapes; JSON forbids the former, so a weak model's
    call then fails to parse (`Invalid control character`). The pattern is that rule's own language
    without the control characters. Returns a new object; the input is not changed.
    """
    if isinstance(schema, list):
        return [close_string_gap(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_string_gap(v) for k, v in schema.items()}
    bounded = "maxLength" in out or "minLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        # NOTE: xgrammar takes a pattern or length bounds, not both: the pattern carries both
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = "^[^\\x00-\\x1f\"\\\\]{%d,%s}$" % (lo, "" if hi is None else int(hi))
    return out


def rewrite_legacy_tag(legacy: dict, any_whitespace: bool) -> dict:
    """A legacy structural tag (``{"structures": [{begin, schema, end}], "triggers", "at_least_one"}``,
    what SGLang builds for tool calls) in xgrammar's current format.

    - ``any_whitespace=False``: each schema becomes a whitespace-free grammar.
    - ``at_least_one`` (``tool_choice`` required or named): exactly one tagged call and no text
      around it (``tags_with_separator``, stop after the first), so the grammar ends with the call
      and generation stops there. Free text is what 0.5.23 allows after a forced call; a weak
      model fills it to ``max_tokens``, and streaming then reports it as content while the
      non-streamed response drops it.
    - otherwise (``auto`` with strict tools): free text until a trigger, as before.
    """
    from xgrammar import Grammar

    def content(schema: dict) -> dict:
        if any_whitespace:
            return {"type": "json_schema", "json_schema": schema}
        # NOTE: xgrammar's own JSON-schema converter, printed as EBNF: the same language as a
        # `json_schema` request under the flag, with `", "` / `": "` separators.
        return {"type": "grammar", "grammar": str(Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))}

    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": content(close_string_gap(s.get("schema") or {}))}
            for s in legacy["structures"]]
    if legacy.get("at_least_one"):
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
               "stop_after_first": True}
    else:
        fmt = {"type": "triggered_tags", "triggers": legacy["triggers"], "tags": tags}
    return {"type": "structural_tag", "format": fmt}


def around_structural_tag(original, self, key_string: str):
    from sglang.srt.constrained.utils import is_legacy_structural_tag

    try:
        tag = json.loads(key_string)
    except json.JSONDecodeError:
        tag = None  # the original reports it
    if isinstance(tag, dict) and is_legacy_structural_tag(tag):
        try:
            key_string = json.dumps(rewrite_legacy_tag(tag, self.any_whitespace))
        except (RuntimeError, ValueError, KeyError, TypeError):
            pass  # an invalid schema: the original rejects it with its own message
    return original(self, key_string)


def around_json(original, self, key_string: str):
    try:
        schema = json.loads(key_string)
    except json.JSONDecodeError:
        schema = None  # the original reports it
    if isinstance(schema, dict):
        fixed = close_string_gap(schema)
        if fixed != schema:
            key_string = json.dumps(fixed)
    return original(self, key_string)


def after_effective_tools(tools, self, request):
    from sglang.srt.entrypoints.openai.protocol import ToolChoice

    choice = getattr(request, "tool_choice", None)
    if isinstance(choice, ToolChoice) and choice.function is not None:
        named = [t for t in tools if t.function.name == choice.function.name]
        return named or tools  # an unknown name is rejected by SGLang's own validation
    return tools


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS["structural_tag"], around_structural_tag, HookType.AROUND)
    HookRegistry.register(TARGETS["json"], around_json, HookType.AROUND)
    HookRegistry.register(TARGETS["effective_tools"], after_effective_tools, HookType.AFTER)
