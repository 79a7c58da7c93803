"""OpenAI-style tool calling through `cedar serve` with the real `openai` client (random weights):
forced calls (`required`, a named function) always parse and validate against the function's
schema, streamed calls add up to exactly the non-streamed ones, `auto` never leaks markup, bad
tool requests get a 400, and a call sent back in the next turn re-tokenizes to what was cached."""

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CALC = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 20}},
        "required": ["expression"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.", "parameters": CALC}}]
SCHEMAS = {"get_weather": WEATHER, "calc": CALC}
# NOTE: a string of n characters may take up to 4n tokens (multi-byte characters), plus the markup
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def complete(client, messages, choice, stream, max_tokens=MAX_TOKENS):
    kw = dict(model="cedar", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return m.content or "", calls, r.choices[0].finish_reason, r.usage
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice_ = chunk.choices[0]
        finish = choice_.finish_reason or finish
        content += choice_.delta.content or ""
        for tc in choice_.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
    return content, [tuple(calls[k]) for k in sorted(calls)], finish, None


def assert_valid(calls, allowed):
    assert len(calls) == 1, calls
    name, args = calls[0]
    assert name in allowed
    jsonschema.validate(json.loads(args), SCHEMAS[name])


CHOICES = {"required": ("required", {"get_weather", "calc"}),
           "named-calc": ({"type": "function", "function": {"name": "calc"}}, {"calc"}),
           "named-weather": ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})}


@pytest.mark.parametrize("case", sorted(CHOICES))
def test_forced_calls_validate_and_stream_exactly(checked_server, client, case):
    choice, allowed = CHOICES[case]
    messages = [{"role": "user", "content": f"Case {case}: what is the weather in Paris, and 2 + 3?"}]
    cold = complete(client, messages, choice, stream=False)
    assert_valid(cold[1], allowed)
    assert cold[2] == "tool_calls" and cold[0] == ""
    # NOTE: both of these are hits on the same prefix (same replay), so their tokens are equal
    plain = complete(client, messages, choice, stream=False)
    streamed = complete(client, messages, choice, stream=True)
    assert_valid(plain[1], allowed)
    assert streamed[1] == plain[1] and streamed[0] == plain[0] == ""
    assert streamed[2] == plain[2] == "tool_calls"


def test_auto_returns_content_or_valid_calls(checked_server, client):
    messages = [{"role": "user", "content": "Say hello, or call a tool if you must."}]
    complete(client, messages, "auto", stream=False, max_tokens=48)
    plain = complete(client, messages, "auto", stream=False, max_tokens=48)
    streamed = complete(client, messages, "auto", stream=True, max_tokens=48)
    for content, calls, _, _ in (plain, streamed):
        assert "<tool_call>" not in content
        for name, args in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
    assert streamed[:2] == plain[:2]


def test_bad_tool_requests_are_refused(checked_server, client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.chat.completions.create(model="cedar", messages=messages, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="cedar", messages=messages, tool_choice="required", max_tokens=8)
    assert complete(client, messages, "auto", stream=False, max_tokens=8)[2] in ("stop", "length")  # still serving


def test_call_sent_back_is_a_prefix_hit(checked_server, client):
    """The next turn renders the returned call with the template; it must tokenize to the very
    tokens the model generated, so the hit covers the call."""
    messages = [{"role": "user", "content": "Turn one: compute 6 * 7 with the calc tool."}]
    _, calls, _, usage1 = complete(client, messages, {"type": "function", "function": {"name": "calc"}}, stream=False)
    (name, args), = calls
    turn2 = messages + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    _, _, _, usage2 = complete(client, turn2, "auto", stream=False)
    generated = usage1.prompt_tokens + usage1.completion_tokens - 1  # less the forced end token
    cached = usage2.prompt_tokens_details.cached_tokens
    assert cached >= generated - 2, (cached, generated)  # page size 2


@pytest.mark.parametrize("params", [
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 1}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}, "required": ["a"]},
], ids=["bad type", "empty range", "empty length range", "bad pattern"])
def test_invalid_tool_schemas_get_a_400(checked_server, client, params):
    """Schemas SGLang's validation or the grammar (through Cedar's rewrite) cannot take."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="cedar", messages=[{"role": "user", "content": "x"}], tools=tools,
                                           tool_choice=choice, max_tokens=16)
    status, out = checked_server.post("/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 4, "json_schema": json.dumps({"type": "string", "minLength": 3, "maxLength": 1})}})
    assert status == 400 and "json grammar" in out["error"]["message"]
