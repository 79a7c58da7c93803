"""Fixes to SGLang 0.5.23's constrained tool calling and to xgrammar 0.2.7's strings, through
SGLang's ``HookRegistry`` (installed by ``sglang_hooks.install``, pinned to the same version and
checked by ``tests/test_sglang_hooks.py``).

| target | why |
|---|---|
| XGrammarGrammarBackend.dispatch_structural_tag | the tags that constrain `tool_choice` required /
  named calls (`rewrite_legacy_tag`): (1) a forced call is one call and nothing else, so
  generation ends with it; (2) `--constrained-json-disable-any-whitespace` reaches `json_schema`
  requests but not these tags (xgrammar compiles a tag's schema with free whitespace and has no
  switch for it), so a weak model filled its whole `max_tokens` with spaces inside the call; with
  the flag, each schema is compiled whitespace-free; (3) `close_string_gap` |
| XGrammarGrammarBackend.dispatch_json | `close_string_gap` for `json_schema` requests
  (`sgl.gen(json_schema=...)`, `response_format`) |
| OpenAIServingChat._effective_tools | a named `tool_choice` must constrain (and parse) the named
  function only; 0.5.23 builds the call's grammar from every tool in the request, so a call to
  another function passes the grammar |

All apply to any model: they change what the flag and the named choice already promise.
"""

from __future__ import annotations

import json

from ..string_patterns import JSON_CHAR, strings_as_patterns

P = "sglang.srt."
TARGETS = {
    "structural_tag": P + "constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_structural_tag",
    "json": P + "constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_json",
    "effective_tools": P + "entrypoints.openai.serving_chat.OpenAIServingChat._effective_tools",
}


def close_string_gap(schema):
    """`schema` with every length-bounded string as a pattern of JSON's unescaped characters.

    NOTE: xgrammar 0.2.7 compiles a `maxLength` / `minLength` string to a rule that admits raw
    control characters (bytes 0x00-0x1f) and no escapes; JSON forbids the former, so a weak model's
    call then fails to parse (`Invalid control character`). The pattern is that rule's own language
    without the control characters. Returns a new object; the input is not changed.
    """
    return strings_as_patterns(schema, JSON_CHAR)


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
