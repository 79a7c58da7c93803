"""Arguments narrowed to the values a conversation states (`cedar.frontend.stated_values`): what
counts as stated, which leaves are narrowed and to what, and that a leaf with nothing stated for it
keeps its schema; OpenAI-style tools narrowed for a chat's next request (`narrow_tools`) and the
API loop's ways of sending its tools. The served paths (a real server writing narrowed calls) are
in tests/test_agents_server.py (the frontend) and tests/test_openai_tools.py (the `openai` client)."""

import json

import jsonschema
import pytest

from cedar.frontend.schema import grammar_schema, max_json_chars, with_default_bounds
from cedar.agents.api_loop import TOOLS_MODES, request_tools
from cedar.frontend.stated_values import MAX_CANDIDATES, MAX_WORDS, StatedValues, admitted, narrow_tools, said_texts

SCHEMA = with_default_bounds({
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 100, "description": "how many"},
        "ratio": {"type": "number", "minimum": -10, "maximum": 10},
        "city": {"type": "string", "maxLength": 12},
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "flag": {"type": "boolean"},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99999}, "maxItems": 3},
        "where": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}}},
    },
    "required": ["count", "city"],
})


def test_numbers_are_whole_literals_the_most_recent_first():
    sv = StatedValues.of(["Take 15 of x5 at -3.25, then 7.", "No: 42 and 15, v2.0 or 1.5.3"])
    # the later text's first, each text read from its end; x5, v2.0 and 1.5.3 are not whole literals
    assert sv.numbers == (15, 42, 7, -3.25)
    assert all(isinstance(x, int) for x in sv.numbers[:3]) and isinstance(sv.numbers[3], float)


def test_strings_are_quoted_spans_and_runs_of_words_with_outer_punctuation_stripped():
    sv = StatedValues.of(['Send it to "New York" (office), quickly!'])
    assert "New York" in sv.strings and "office" in sv.strings and "quickly" in sv.strings
    assert "(office)," not in sv.strings and "office), quickly" not in sv.strings  # no run across punctuation
    assert "to \"New York\"" not in sv.strings  # the grammar's strings hold no '"'
    assert "Send it to" in sv.strings and "it to \"New" not in sv.strings
    # a candidate never holds closing markup (the server's argument strings refuse `</`)
    marked = StatedValues.of(['Reply "</tool_call>" or "a</b", then "x<5" and done'])
    assert not any("</" in s for s in marked.strings) and "x<5" in marked.strings
    long = StatedValues.of(["a b c d e f"])
    assert max(len(s.split()) for s in long.strings) == MAX_WORDS


def test_each_free_leaf_is_narrowed_to_the_stated_values_it_admits():
    said = ['Book 3 seats in Oslo for 250, ratio 2.5, ids 7 and 123456; zip 4021. Not 500.']
    n = StatedValues.of(said).narrow(SCHEMA)
    p = n["properties"]
    assert set(p["count"]["enum"]) == {3, 7} and p["count"]["description"] == "how many"
    assert 250 not in p["count"]["enum"] and 500 not in p["count"]["enum"]  # out of range
    assert set(admitted(p["ratio"])) == {3, 2.5, 7}  # a number admits integer literals too
    assert {"type": "number", "minimum": 2.5, "maximum": 2.5} in p["ratio"]["anyOf"]  # a decimal: a one-point range
    assert "Oslo" in p["city"]["enum"] and all(len(s) <= 12 for s in p["city"]["enum"])
    assert p["mode"] == SCHEMA["properties"]["mode"] and p["flag"] == SCHEMA["properties"]["flag"]
    assert set(p["ids"]["items"]["enum"]) == {3, 250, 7, 4021, 500} and p["ids"]["maxItems"] == 3
    assert 123456 not in p["ids"]["items"]["enum"]
    assert 4021 in p["where"]["properties"]["zip"]["enum"]
    assert n["required"] == SCHEMA["required"] and SCHEMA["properties"]["count"].get("enum") is None  # input kept


def test_a_number_outside_a_leafs_multiple_is_not_admitted():
    leaf = StatedValues.of(["pages 12, 15 or 20"]).narrow({"type": "integer", "minimum": 0, "maximum": 99, "multipleOf": 5})
    assert set(admitted(leaf)) == {15, 20}


def test_a_leaf_with_nothing_stated_for_it_keeps_its_schema():
    n = StatedValues.of(["nothing numeric here"]).narrow(SCHEMA)
    for key in ("count", "ratio", "ids", "where"):
        assert n["properties"][key] == SCHEMA["properties"][key]
    assert "enum" in n["properties"]["city"]  # words are stated
    assert StatedValues.of([]).narrow(SCHEMA) == SCHEMA


def test_the_narrowed_grammar_admits_exactly_the_stated_values_and_stays_bounded():
    sv = StatedValues.of(["count 4, city Lima"])
    g = grammar_schema(sv.narrow(SCHEMA))
    jsonschema.validate({"count": 4, "city": "Lima"}, g)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"count": 5, "city": "Lima"}, g)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"count": 4, "city": "Paris"}, g)
    assert max_json_chars(g) < max_json_chars(grammar_schema(SCHEMA))


def test_a_stated_decimal_is_written_as_stated_by_the_grammar_backend():
    # xgrammar writes an enum's 49.86 as 49.859999999999999: the model would be forced into digits
    # nobody stated; a one-point range comes out as the literal (trailing zeros allowed)
    from xgrammar.testing import _json_schema_to_ebnf

    leaf = StatedValues.of(["filters 49.86, retries 3"]).narrow({"type": "number", "minimum": 0, "maximum": 100})
    ebnf = _json_schema_to_ebnf(json.dumps({"type": "object", "properties": {"x": leaf}, "required": ["x"]}),
                                any_whitespace=False)
    assert '"4" "9" "." "8" "6"' in ebnf and "49.8599" not in ebnf and '"3"' in ebnf
    assert set(admitted(leaf)) == {49.86, 3}


def test_candidates_are_capped_most_recent_first():
    said = [" ".join(str(i) for i in range(1000))]
    enum = StatedValues.of(said).narrow({"type": "integer", "minimum": 0, "maximum": 5000})["enum"]
    assert len(enum) == MAX_CANDIDATES and enum[0] == 999
    json.dumps(enum)  # plain JSON values


CHAT = [{"role": "system", "content": "Tools: ship(count 0-100000). Say 99 never."},
        {"role": "user", "content": "Ship 48213 parcels."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "ship", "arguments": '{"count": 31337}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": '{"status": "ok", "next": 777}'},
        {"role": "assistant", "content": "Shipped 65000."},
        {"role": "user", "content": [{"type": "text", "text": "Then 12 more"}, {"type": "image_url", "image_url": {}}]}]
SHIP = [{"type": "function", "function": {"name": "ship", "description": "Ship parcels.", "parameters": {
    "type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 100000}},
    "required": ["count"]}}},
        {"type": "function", "function": {"name": "ping", "description": "No arguments."}}]


def test_a_chat_states_values_in_its_user_and_tool_messages_only():
    # not the system prompt, not the assistant's own calls or answers (31337, 65000)
    assert said_texts(CHAT) == ["Ship 48213 parcels.", '{"status": "ok", "next": 777}', "Then 12 more"]


def test_openai_tools_are_narrowed_to_what_the_chat_states_and_marked_strict():
    before = json.dumps(SHIP)
    ship, ping = narrow_tools(SHIP, CHAT)
    assert ship["function"]["strict"] is True and ping["function"]["strict"] is True
    assert ship["function"]["parameters"]["properties"]["count"]["enum"] == [12, 777, 48213]  # the latest first
    assert ship["function"]["parameters"]["required"] == ["count"] and ship["function"]["name"] == "ship"
    assert "parameters" not in ping["function"]
    assert json.dumps(SHIP) == before  # the caller's tools are not changed
    # nothing stated yet: the schema as given, strict
    assert narrow_tools(SHIP, CHAT[:1])[0]["function"] == {**SHIP[0]["function"], "strict": True}
    with pytest.raises(ValueError, match=r"tools\[1\] is not an OpenAI function tool"):
        narrow_tools([SHIP[0], {"type": "function", "name": "flat"}], CHAT)


def test_the_api_loop_sends_its_tools_free_strict_or_narrowed():
    free, strict, stated = (request_tools(SHIP, CHAT, mode) for mode in TOOLS_MODES)
    assert free is SHIP
    assert [t["function"].get("strict") for t in strict] == [True, True]
    assert strict[0]["function"]["parameters"] == SHIP[0]["function"]["parameters"]
    assert stated == narrow_tools(SHIP, CHAT)
    with pytest.raises(ValueError, match="tools_mode"):
        request_tools(SHIP, CHAT, "narrow")
