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
| FunctionCallParser.get_legacy_structural_tag | a forced call (`required`, named) is constrained by
  each function's schema whether or not the tool says `strict`: 0.5.23 gives a non-strict tool an
  empty schema unless `SGLANG_TOOL_STRICT_LEVEL` >= 2 (an environment variable a caller's own
  environment overrides), and free arguments are what let a model write markup in them |

All apply to any model: they change what the flag and the named choice already promise. The
tags' argument strings also never hold the raw pair `</` (`markup_free_strings`), so no
argument can close the call early; the parser that reads the calls is `tool_call_parser.py`,
registered from here.
"""

from __future__ import annotations

import json

from ..string_patterns import JSON_CHAR, TAG_CHAR, strings_as_patterns

P = "sglang.srt."
TARGETS = {
    "structural_tag": P + "constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_structural_tag",
    "json": P + "constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_json",
    "effective_tools": P + "entrypoints.openai.serving_chat.OpenAIServingChat._effective_tools",
    "legacy_tag": P + "function_call.function_call_parser.FunctionCallParser.get_legacy_structural_tag",
}
# xgrammar 0.2.7's rule for the characters of a JSON string (`Grammar.from_json_schema`, printed);
# `markup_free_strings` replaces it
_STRING_END = r' (=([ \n\r\t]* [,}\]:]))'
_ESCAPE = r'("\\" basic_escape basic_string_sub)'
STRING_RULE = r'basic_string_sub ::= (("\"") | ([^\0-\x1f\"\\\r\n] basic_string_sub) | ' + _ESCAPE + ")" + _STRING_END
# the same, where a raw `<` moves to a state in which a raw `/` may not follow
MARKUP_FREE_RULES = (
    r'basic_string_sub ::= (("\"") | ([^\0-\x1f\"\\\r\n<] basic_string_sub) | ("<" cedar_string_lt) | '
    + _ESCAPE + ")" + _STRING_END + "\n"
    r'cedar_string_lt ::= (("\"") | ([^\0-\x1f\"\\\r\n</] basic_string_sub) | ("<" cedar_string_lt) | '
    + _ESCAPE + ")" + _STRING_END)


class GrammarDriftError(Exception):
    """xgrammar no longer prints the rule a hook rewrites (not a RuntimeError: those are a bad
    schema's, which the hooks hand back to SGLang to report)."""


def close_string_gap(schema):
    """`schema` with every length-bounded string as a pattern of JSON's unescaped characters.

    NOTE: xgrammar 0.2.7 compiles a `maxLength` / `minLength` string to a rule that admits raw
    control characters (bytes 0x00-0x1f) and no escapes; JSON forbids the former, so a weak model's
    call then fails to parse (`Invalid control character`). The pattern is that rule's own language
    without the control characters. Returns a new object; the input is not changed.
    """
    return strings_as_patterns(schema, JSON_CHAR)


def markup_free_strings(grammar: str) -> str:
    """`grammar` (xgrammar's printed JSON grammar) with every unbounded JSON string unable to hold
    the raw pair `</`, so none can spell the closing markup `</tool_call>`.

    NOTE: why the pair and not the `<`: every string value stays writable (`<` and `/` alone
    are free, and the pair is JSON's own escape `<\\/`, the one HTML uses for `</script>`), and
    text a model learned with raw `<` (code, comparisons) is still what the grammar admits.
    Bounded strings are patterns, which admit no escapes, so they refuse `<` instead (`TAG_CHAR`).
    """
    if STRING_RULE not in grammar:
        if "basic_string_sub" in grammar:  # xgrammar changed its rule: fail loudly, never silently
            raise GrammarDriftError("xgrammar's JSON string rule changed: re-check tool_call_hooks.STRING_RULE")
        return grammar
    return grammar.replace(STRING_RULE, MARKUP_FREE_RULES)


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
    - every argument string: no raw `</` (`markup_free_strings`), no `<` in a bounded one.
    """
    from xgrammar import Grammar

    def content(schema: dict) -> dict:
        # NOTE: xgrammar's own JSON-schema converter, printed as EBNF: the same language as a
        # `json_schema` request (under the whitespace flag, `", "` / `": "` separators), with
        # the string rule replaced.
        grammar = str(Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace))
        return {"type": "grammar", "grammar": markup_free_strings(grammar)}

    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": content(strings_as_patterns(s.get("schema") or {}, TAG_CHAR))}
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


def around_legacy_tag(original, self, at_least_one: bool = False, *args, **kwargs):
    tag = original(self, at_least_one, *args, **kwargs)
    if at_least_one:  # NOTE: one structure per tool, in the order of self.tools (0.5.23)
        for structure, tool in zip(tag.structures, self.tools, strict=True):
            structure.schema_ = tool.function.parameters or {}
    return tag


HOOKS = {
    "structural_tag": (around_structural_tag, "around"),
    "json": (around_json, "around"),
    "effective_tools": (after_effective_tools, "after"),
    "legacy_tag": (around_legacy_tag, "around"),
}
