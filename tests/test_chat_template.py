"""The chat markup: the Jinja template (what SGLang renders for /v1/chat/completions) and the
Python markup (what frontend programs write) agree byte for byte, a `developer` message is a
`system` one, and Cedar's tool-call parser (`--tool-call-parser cedar`) reads every well-formed
call, the same way one-shot and fed a few characters at a time (where `hermes` loses calls)."""

import json

import pytest

from cedar.backend.chat_template import TOOL_CALL_PARSER, system_text, tool_call_text

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers ('a' + 'b').",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_jinja_and_python_markup_agree(hf_tokenizer, system):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "5", "tool_call_id": "c2"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = ("<|bos|><|system|>" + system_text(system, TOOLS) + "<|end|>"
                "<|user|>Weather in Paris, and 2 + 3?<|end|>"
                "<|assistant|>" + tool_call_text("get_weather", {"city": "Paris"}) + tool_call_text("add", '{"a": 2, "b": 3}')
                + "<|end|><|tool|>sunny<|end|><|tool|>5<|end|><|assistant|>")
    assert text == expected
    assert tool_call_text("get_weather", {"city": "Paris"}) == \
        '<tool_call>{"name":"get_weather", "arguments":{"city": "Paris"}}</tool_call>'


def test_no_tools_renders_as_before(hf_tokenizer):
    text = hf_tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                            tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>S<|end|><|user|>U<|end|><|assistant|>"


def test_turn_boundaries_restart_tokenization(hf_tokenizer):
    """Each message's tokens do not depend on its neighbours (specials split first)."""
    a = hf_tokenizer.encode("<|user|>abc def<|end|>", add_special_tokens=False)
    b = hf_tokenizer.encode("<|assistant|>xyz<|end|>", add_special_tokens=False)
    assert hf_tokenizer.encode("<|user|>abc def<|end|><|assistant|>xyz<|end|>", add_special_tokens=False) == a + b


def _tools():
    from sglang.srt.entrypoints.openai.protocol import Tool

    return [Tool(**t) for t in TOOLS]


def _detector(name: str = TOOL_CALL_PARSER):
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    from cedar.backend.serving.tool_call_parser import register

    register()
    return FunctionCallParser(_tools(), name)


def _streamed(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    parser, normal, calls = _detector(), "", {}
    for i in range(0, len(text), step):
        chunk_text, chunk_calls = parser.parse_stream_chunk(text[i:i + step])
        normal += chunk_text
        for c in chunk_calls:
            entry = calls.setdefault(c.tool_index, ["", ""])
            entry[0] += c.name or ""
            entry[1] += c.parameters or ""
    end_text, end_calls = parser.parse_stream_end()
    normal += end_text
    for c in end_calls:
        entry = calls.setdefault(c.tool_index, ["", ""])
        entry[0] += c.name or ""
        entry[1] += c.parameters or ""
    return normal, [tuple(calls[k]) for k in sorted(calls)]


# NOTE: chunks of a few characters, as a server streams tokens. A whole call in one chunk makes
# the detector emit the name only; SGLang's chat server sends the rest of the arguments when the
# stream ends (`_check_for_unstreamed_tool_args`), which tests/test_openai_tools.py covers.
@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("case", ["one", "two", "prose"])
def test_hermes_parser_streamed_equals_one_shot(case, step):
    calls = {"one": [("get_weather", {"city": "Paris"})],
             "two": [("get_weather", {"city": "Nice"}), ("add", {"a": 2, "b": -30})],
             "prose": [("add", {"a": 1, "b": 1})]}[case]
    text = ("Let me check. " if case == "prose" else "") + "".join(tool_call_text(n, a) for n, a in calls)
    normal, one_shot = _detector().parse_non_stream(text)
    assert [(c.name, json.loads(c.parameters)) for c in one_shot] == calls
    s_normal, streamed = _streamed(text, step)
    assert [(n, json.loads(p)) for n, p in streamed] == calls
    # NOTE: argument *text* may be re-serialized by the parser, but never changes value or type
    assert s_normal.strip() == normal.strip()


def test_developer_is_system(hf_tokenizer):
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "U"}]
    as_developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "U"}]
    for tools in (None, TOOLS):
        render = [hf_tokenizer.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=True)
                  for m in (as_system, as_developer)]
        assert render[0] == render[1] and "Be brief." in render[1]
    later = as_developer[::-1]  # a developer message after the first one too
    assert "<|user|>U<|end|><|system|>Be brief.<|end|>" in hf_tokenizer.apply_chat_template(later, tokenize=False)


MARKUP_IN_STRING = tool_call_text("get_weather", {"city": 'x}}</tool_call>'})
CUT = 'ok <tool_call>{"name": "add", "arguments": {"a": 5'
MALFORMED = '<tool_call>{"name": "add", "arguments": {a: 5}}</tool_call>'
GARBAGE = '<tool_call>{"name": "add", "arguments": {}} x</tool_call>'
# text the parser must read: (text, the calls in it, the rest as content)
CASES = {
    "markup in a string": (MARKUP_IN_STRING, [("get_weather", {"city": 'x}}</tool_call>'})], ""),
    "two calls, text around": ("A " + MARKUP_IN_STRING + " B " + tool_call_text("add", {"a": 1, "b": 2}) + " C",
                               [("get_weather", {"city": 'x}}</tool_call>'}), ("add", {"a": 1, "b": 2})], "A  B  C"),
    "whitespace in the tag": ('<tool_call> {"name": "add", "arguments": {"a": 1}} \n</tool_call>',
                              [("add", {"a": 1})], ""),
    "closed, not tagged, at the end": ('<tool_call>{"name": "add", "arguments": {"a": 5}}', [("add", {"a": 5})], ""),
    "cut off by max_tokens": (CUT, [], CUT),
    "malformed JSON": (MALFORMED, [], MALFORMED),
    "garbage after the JSON": (GARBAGE + tool_call_text("add", {"b": 1}), [("add", {"b": 1})], GARBAGE),
    "escaped quote and bracket": (tool_call_text("get_weather", {"city": 'a"}]\\'}),
                                  [("get_weather", {"city": 'a"}]\\'})], ""),
    "no call": ("just text </tool_call> <tool_", [], "just text </tool_call> <tool_"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cedar_parser_reads_every_well_formed_call(case):
    text, calls, rest = CASES[case]
    normal, one_shot = _detector().parse_non_stream(text)
    assert [(c.name, json.loads(c.parameters)) for c in one_shot] == calls
    assert normal == (rest if calls or "<tool_call>" in text else text)
    for step in (1, 2, 5, len(text)):
        s_normal, streamed = _streamed(text, step)
        assert [(n, json.loads(p)) for n, p in streamed] == calls, step
        assert [p for _, p in streamed] == [c.parameters for c in one_shot]  # the same argument text
        assert s_normal == rest, step


def test_hermes_loses_a_call_with_markup_in_a_string():
    """Why Cedar serves its own parser: SGLang's `hermes` (a non-greedy match) drops this call
    one-shot and returns the markup as text, while its stream returns the call."""
    normal, calls = _detector("hermes").parse_non_stream(MARKUP_IN_STRING)
    assert calls == [] and normal == MARKUP_IN_STRING
