"""OpenAI-style tool calling through `cedar serve` with the real `openai` client (random weights):
forced calls (`required`, a named function) always parse and validate against the function's
schema, `strict` or not, streamed calls add up to exactly the non-streamed ones in every
`tool_choice`, `auto` never leaks markup, a model pushed to write `</tool_call>` cannot put it in
an argument, bad tool requests get a 400, a call sent back in the next turn re-tokenizes to what
was cached; a `developer` message is a `system` one and `seed` makes sampling repeatable; tools a
client narrowed to the chat's stated values (`narrow_tools`) get calls holding only those."""

import json

import jsonschema
import openai
import pytest

from cedar.frontend.stated_values import StatedValues, narrow_tools

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


def strict_tools(strict: bool) -> list[dict]:
    return [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS] if strict else TOOLS


def complete(client, messages, choice, stream, max_tokens=MAX_TOKENS, tools=TOOLS, **extra):
    kw = dict(model="cedar", messages=messages, tools=tools, tool_choice=choice, max_tokens=max_tokens, temperature=0,
              **extra)
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


@pytest.mark.parametrize("strict", [False, True], ids=["not-strict", "strict"])
@pytest.mark.parametrize("case", sorted(CHOICES))
def test_forced_calls_validate_and_stream_exactly(checked_server, client, case, strict):
    choice, allowed = CHOICES[case]
    tools = strict_tools(strict)
    messages = [{"role": "user", "content": f"Case {case}: what is the weather in Paris, and 2 + 3?"}]
    cold = complete(client, messages, choice, stream=False, tools=tools)
    assert_valid(cold[1], allowed)
    assert cold[2] == "tool_calls" and cold[0] == ""
    # NOTE: both of these are hits on the same prefix (same replay), so their tokens are equal
    plain = complete(client, messages, choice, stream=False, tools=tools)
    streamed = complete(client, messages, choice, stream=True, tools=tools)
    assert_valid(plain[1], allowed)
    assert streamed[1] == plain[1] and streamed[0] == plain[0] == ""
    assert streamed[2] == plain[2] == "tool_calls"


def test_none_returns_content_and_streams_it_exactly(checked_server, client):
    """``tool_choice: none``: no call, streamed or not, and the same content both ways."""
    messages = [{"role": "user", "content": "What is the weather in Paris? Answer in words."}]
    complete(client, messages, "none", stream=False, max_tokens=32)
    plain = complete(client, messages, "none", stream=False, max_tokens=32)
    streamed = complete(client, messages, "none", stream=True, max_tokens=32)
    assert plain[1] == streamed[1] == []
    assert streamed[0] == plain[0] and plain[2] != "tool_calls"


@pytest.mark.parametrize("strict", [False, True], ids=["not-strict", "strict"])
def test_auto_returns_content_or_valid_calls(checked_server, client, strict):
    messages = [{"role": "user", "content": "Say hello, or call a tool if you must."}]
    tools = strict_tools(strict)
    complete(client, messages, "auto", stream=False, max_tokens=48, tools=tools)
    plain = complete(client, messages, "auto", stream=False, max_tokens=48, tools=tools)
    streamed = complete(client, messages, "auto", stream=True, max_tokens=48, tools=tools)
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


NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
        "additionalProperties": False}
NOTE_TOOLS = [{"type": "function", "function": {"name": "note", "description": "Write a note.", "parameters": NOTE}}]


@pytest.fixture(scope="module")
def pushed_tokens(tiny_model_dir):
    """The test model's tokens for `</` (the start of `</tool_call>`) and `"`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    lt_slash, quote = tok.encode("</", add_special_tokens=False), tok.encode('"', add_special_tokens=False)
    assert len(lt_slash) == len(quote) == 1, (lt_slash, quote)
    assert tok.encode("</tool_call>", add_special_tokens=False)[0] == lt_slash[0]
    return lt_slash[0], quote[0]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "note"}}],
                         ids=["required", "named"])
def test_closing_markup_never_inside_an_argument(checked_server, client, pushed_tokens, choice):
    """A model pushed to write the closing markup wherever it may: a logit bias of +100 on `</`
    (the token that starts `</tool_call>`), +50 on `"`. Unconstrained it writes `</` at once; in
    a forced call the old grammar let it write `</` into the (free) argument string for ever (it
    always beats `"`); now the pair is refused there, `"` closes the string, and the call parses
    whole, streamed and not."""
    lt_slash, quote = pushed_tokens
    bias = {str(lt_slash): 100, str(quote): 50}
    status, out = checked_server.post("/generate", {
        "text": "<|bos|><|user|>hi<|end|><|assistant|>",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "logit_bias": bias, "skip_special_tokens": False}})
    assert status == 200 and out["text"].startswith("</"), out
    messages = [{"role": "user", "content": "Write a note that says hello."}]
    runs = [complete(client, messages, choice, stream=s, tools=NOTE_TOOLS, logit_bias=bias, max_tokens=96)
            for s in (False, False, True)]
    for content, calls, finish, _ in runs:
        assert content == "" and finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
        name, args = calls[0]
        assert name == "note" and "</" not in json.loads(args)["text"], args
    assert runs[2][1] == runs[1][1]


def test_developer_message_is_a_system_message(checked_server, client):
    def ask(role):
        r = client.chat.completions.create(model="cedar", max_tokens=4, temperature=0, messages=[
            {"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Developer role?"}])
        return r.usage
    system = ask("system")
    developer = ask("developer")  # a 400 ("unknown chat role: developer") before
    assert developer.prompt_tokens == system.prompt_tokens
    # the same rendered prompt: the developer request hits what the system one cached
    assert developer.prompt_tokens_details.cached_tokens >= developer.prompt_tokens - 2


def test_seed_makes_sampling_repeatable(checked_server, client):
    messages = [{"role": "user", "content": "Tell me a story with a seed."}]

    def sample(**kw):
        r = client.chat.completions.create(model="cedar", messages=messages, max_tokens=24, temperature=1.0, **kw)
        return r.choices[0].message.content

    sample(seed=7)  # NOTE: the first request is cold; the ones below are hits on the same prefix
    same = [sample(seed=7) for _ in range(2)]
    assert same[0] == same[1] and same[0]
    assert sample(seed=8) != same[0]
    assert sample() != sample()  # unseeded requests stay random


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_calls_to_tools_narrowed_to_stated_values_hold_only_those(checked_server, client, choice):
    # random weights: whatever the model prefers, every value of a call is one the chat stated
    messages = [{"role": "user", "content": 'Case narrowed-%s: weather in "Oslo" for 3 days, or Bergen for 5? '
                 'Or compute 12*4.' % choice}]
    tools = narrow_tools(TOOLS, messages)
    strings = StatedValues.of([messages[0]["content"]]).strings
    complete(client, messages, choice, stream=False, tools=tools)  # NOTE: then both below are hits on one prefix
    plain = complete(client, messages, choice, stream=False, tools=tools)
    streamed = complete(client, messages, choice, stream=True, tools=tools)
    assert streamed[:2] == plain[:2]
    if choice == "required":
        assert len(plain[1]) == 1
    for name, args in plain[1]:
        values = json.loads(args)
        jsonschema.validate(values, SCHEMAS[name])
        if name == "get_weather":
            assert values["days"] in (3, 5) and values["city"] in strings
        else:
            assert values["expression"] in strings
