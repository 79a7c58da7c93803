"""Tool registry and bounded schemas (no server): typed functions become JSON-schema tools, every
schema sent to the grammar is bounded, the bound really holds for xgrammar's grammar, and every
tool failure comes back as an observation. Also the grammar fixes of tool_call_hooks."""

import json
import time
from typing import Annotated, Literal

import pytest
from pydantic import AfterValidator, Field

from cedar.backend.serving.tool_call_hooks import close_string_gap, rewrite_legacy_tag
from cedar.frontend.schema import UnboundedSchemaError, grammar_schema, max_json_chars, with_default_bounds
from cedar.frontend.schema import DEFAULT_MAX_STR
from cedar.frontend.signatures import parse_docstring
from cedar.frontend.tools import ToolRegistry, schema_tool


def even(n: int) -> int:
    if n % 2:
        raise ValueError("must be even")
    return n


def make_registry() -> ToolRegistry:
    r = ToolRegistry()

    @r.tool(timeout_s=0.3)
    def get_weather(city: Annotated[str, Field(max_length=12)], days: int = 1,
                    unit: Literal["c", "f"] = "c", tags: list[str] = []) -> str:
        """Weather in a city.

        More text that is not the description.

        Args:
            city: the city name
            days: how many days
                ahead of today
        """
        if city == "boom":
            raise RuntimeError("kaput")
        if city == "slow":
            time.sleep(2)
        return {"city": city, "days": days}

    @r.tool
    def halve(n: Annotated[int, AfterValidator(even)]) -> int:
        """Halve an even number."""
        return n // 2
    return r


def test_function_becomes_openai_tool():
    spec = make_registry()["get_weather"].openai()["function"]
    assert spec["name"] == "get_weather" and spec["description"] == "Weather in a city."
    props = spec["parameters"]["properties"]
    assert list(props) == ["city", "days", "unit", "tags"]
    assert props["city"] == {"description": "the city name", "maxLength": 12, "type": "string"}
    assert props["days"]["description"] == "how many days ahead of today"
    assert props["days"]["minimum"] == -1_000_000 and props["days"]["maximum"] == 1_000_000
    assert props["unit"]["enum"] == ["c", "f"]
    assert props["tags"]["maxItems"] == 4 and props["tags"]["items"]["maxLength"] == DEFAULT_MAX_STR
    assert spec["parameters"]["required"] == ["city"] and spec["parameters"]["additionalProperties"] is False
    assert "title" not in json.dumps(spec)


def test_docstring_parsing():
    desc, args = parse_docstring("Do a thing.\nStill the summary.\n\nBody.\n\nArgs:\n    x (int): the x\n    y: why\n")
    assert desc == "Do a thing. Still the summary." and args == {"x": "the x", "y": "why"}


def test_unbounded_parameters_are_refused():
    r = ToolRegistry()

    def free(blob: dict) -> str:
        """Anything."""
        return ""
    with pytest.raises(UnboundedSchemaError):
        r.add(free)
    with pytest.raises(UnboundedSchemaError, match="maxItems"):
        max_json_chars({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}})
    with pytest.raises(UnboundedSchemaError, match="minimum and maximum"):
        max_json_chars({"type": "number"})


def test_tool_failures_are_observations():
    r = make_registry()
    assert r.call("get_weather", {"city": "Paris"}).ok
    assert json.loads(r.call("get_weather", '{"city": "Nice", "days": 3}').text) == {"city": "Nice", "days": 3}
    cases = {
        "raises": (("get_weather", {"city": "boom"}), "raised RuntimeError: kaput"),
        "hangs": (("get_weather", {"city": "slow"}), "timed out after 0.3 s"),
        "too long": (("get_weather", {"city": "x" * 13}), "city: String should have at most 12"),
        "not json": (("get_weather", '{"city'), "arguments are not JSON"),
        "extra key": (("get_weather", {"city": "a", "zzz": 1}), "zzz: Extra inputs"),
        "validator": (("halve", {"n": 3}), "must be even"),
        "unknown": (("nope", {}), "unknown tool 'nope'"),
    }
    for what, ((name, args), message) in cases.items():
        obs = r.call(name, args)
        assert not obs.ok and obs.text.startswith("error: ") and message in obs.text, (what, obs)


def _compile(schema: dict):
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _accepts(grammar, text: str) -> bool:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    return xgr.GrammarMatcher(compiled).accept_string(text)


def test_bound_holds_at_the_extremes():
    """The longest arguments the grammar admits fit in max_json_chars; one char more is refused."""
    tool = make_registry()["get_weather"]
    g = _compile(tool.grammar_parameters)
    longest = {"city": "x" * 12, "days": -1_000_000, "unit": "c", "tags": ["y" * DEFAULT_MAX_STR] * 4}
    text = json.dumps(longest)
    assert _accepts(g, text)
    assert len(text) <= max_json_chars(tool.grammar_parameters) < tool.max_tokens
    assert not _accepts(g, json.dumps({**longest, "city": "x" * 13}))
    assert not _accepts(g, json.dumps({**longest, "tags": ["y"] * 5}))


def test_grammar_strings_are_plain_ascii():
    g = _compile(grammar_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}},
                                 "required": ["s"]}))
    assert _accepts(g, '{"s": "abc def"}')
    for bad in ('{"s": "a\x12b"}', '{"s": "caf\u00e9"}', '{"s": "a\\"b"}', '{"s":"abc"}', '{ "s": "abc"}'):
        assert not _accepts(g, bad), bad


def test_default_bounds_for_foreign_schemas():
    schema = {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "number"},
                                               "xs": {"type": "array", "items": {"type": "integer"}}}}
    bounded = with_default_bounds(schema)
    assert max_json_chars(grammar_schema(bounded)) > 0
    assert bounded["additionalProperties"] is False and bounded["properties"]["xs"]["maxItems"] == 4
    tool = schema_tool({"type": "function", "function": {"name": "f", "parameters": schema}})
    with pytest.raises(ValueError, match="f: q"):
        tool.validate({"q": "x" * 100})


def test_close_string_gap_refuses_control_characters():
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 5}},
              "required": ["s"]}
    assert _accepts(_compile(schema), '{"s": "a\x12b"}')  # xgrammar 0.2.7's gap, which the hook closes
    fixed = _compile(close_string_gap(schema))
    assert _accepts(fixed, '{"s": "ab"}') and not _accepts(fixed, '{"s": "a\x12b"}')
    assert not _accepts(fixed, '{"s": ""}') and not _accepts(fixed, '{"s": "abcdef"}')
    assert schema["properties"]["s"] == {"type": "string", "minLength": 1, "maxLength": 5}  # input untouched


def _tag_accepts(tag: dict, text: str) -> bool:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_structural_tag(json.dumps(tag))
    return xgr.GrammarMatcher(compiled).accept_string(text)


LEGACY = {"type": "structural_tag", "triggers": ["<tool_call>"], "at_least_one": True, "structures": [
    {"begin": '<tool_call>{"name":"f", "arguments":', "end": "}</tool_call>",
     "schema": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}}]}


def test_forced_call_is_one_call_without_whitespace():
    tag = rewrite_legacy_tag(LEGACY, any_whitespace=False)
    call = '<tool_call>{"name":"f", "arguments":{"s": "ab"}}</tool_call>'
    assert _tag_accepts(tag, call)
    assert not _tag_accepts(tag, call + "more text")
    assert not _tag_accepts(tag, call + call)
    assert not _tag_accepts(tag, '<tool_call>{"name":"f", "arguments":{ "s": "ab"}}</tool_call>')
    assert not _tag_accepts(tag, "free text first" + call)
    auto = rewrite_legacy_tag({**LEGACY, "at_least_one": False}, any_whitespace=False)
    assert _tag_accepts(auto, "free text first" + call + " and after")


def test_caller_bounds_are_kept():
    r = ToolRegistry()

    def f(a: Annotated[str, Field(max_length=5)], b: Annotated[int, Field(ge=0, le=9)], c: list[int] = []) -> str:
        """F."""
        return ""
    props = r.add(f).parameters["properties"]
    assert props["a"]["maxLength"] == 5 and (props["b"]["minimum"], props["b"]["maximum"]) == (0, 9)
    assert props["c"]["maxItems"] == 4 and props["c"]["items"]["maximum"] == 1_000_000


def test_tool_call_strings_cannot_close_the_call():
    """Inside a call's tag no argument string spells `</tool_call>`: an unbounded string refuses
    the raw pair `</` (JSON's `<\\/` writes it; `<` and `/` alone stay free), a bounded one the `<`."""
    schema = {"type": "object", "properties": {"free": {"type": "string"}, "short": {"type": "string", "maxLength": 6}},
              "required": ["free", "short"]}
    for any_whitespace in (False, True):
        legacy = {**LEGACY, "structures": [{**LEGACY["structures"][0], "schema": schema}]}
        tag = rewrite_legacy_tag(legacy, any_whitespace)

        def call(free: str, short: str = "ok") -> str:
            return '<tool_call>{"name":"f", "arguments":{"free": "%s", "short": "%s"}}</tool_call>' % (free, short)
        assert _tag_accepts(tag, call("a < b, a/b, <div>, \\n"))
        assert _tag_accepts(tag, call("x}}<\\/tool_call>"))  # the escaped spelling of the same value
        assert not _tag_accepts(tag, call("x}}</tool_call>"))
        assert not _tag_accepts(tag, call("<</"))
        assert _tag_accepts(tag, call("a", "a/b>"))
        assert not _tag_accepts(tag, call("a", "a<b"))
        assert not _tag_accepts(tag, call("a", "x" * 7))


def test_forced_calls_get_the_schema_strict_or_not(monkeypatch):
    """`required` / named: each tool's schema constrains its call even with strict unset and
    SGLANG_TOOL_STRICT_LEVEL=0; `auto` is left as SGLang builds it."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    from cedar.backend.serving.tool_call_hooks import around_legacy_tag

    monkeypatch.setenv("SGLANG_TOOL_STRICT_LEVEL", "0")
    params = [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "object", "properties": {}}]
    tools = [Tool(type="function", function={"name": n, "parameters": p}) for n, p in zip("fg", params)]
    parser = FunctionCallParser(tools, "hermes")
    original = FunctionCallParser.get_legacy_structural_tag
    assert [s.schema_ for s in original(parser, at_least_one=True).structures] == [{}, {}]  # 0.5.23 alone
    forced = around_legacy_tag(original, parser, at_least_one=True)
    assert [s.schema_ for s in forced.structures] == params
    assert [s.schema_ for s in around_legacy_tag(original, parser, at_least_one=False).structures] == [{}, {}]
