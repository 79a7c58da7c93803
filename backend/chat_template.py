"""Cedar's chat markup: roles, tools and tool calls, as one Jinja template (what SGLang's
`/v1/chat/completions` renders) and the same markup as Python strings (what frontend programs
write and what the training corpus is rendered with).

Markup (one line per message, no newlines between them):

    <|bos|>
    <|system|>{system text}\\n\\n{TOOLS_PREAMBLE + one JSON line per tool + TOOLS_EPILOGUE}<|end|>
    <|user|>{text}<|end|>
    <|assistant|>{text}<tool_call>{"name":"NAME", "arguments":{...}}</tool_call>...<|end|>
    <|tool|>{result text}<|end|>
    <|assistant|>                     (add_generation_prompt)

A `developer` message (the role current OpenAI clients send instructions in) is read as a
`system` message.

Tool calls are the markup of SGLang's `hermes` tool-call parser
(`sglang/srt/function_call/hermes_detector.py`; Cedar serves it as `--tool-call-parser cedar`,
the same markup read by a JSON-aware scan: `serving/tool_call_parser.py`), written byte for byte as that detector's
structural tag begins and ends them (`<tool_call>{"name":"` + name + `", "arguments":` ...
`}</tool_call>`), and the arguments as `json.dumps` (= Jinja `tojson`) writes them, which is
also what xgrammar emits with `--constrained-json-disable-any-whitespace`. NOTE: so a
constrained call, once it comes back through the OpenAI API as a parsed `tool_calls` entry and
is rendered again in the next turn, re-tokenizes to the text the model generated, and the
next turn's prefix hit covers it.

Every message starts with a special token, so tokenization restarts at each turn boundary
(special tokens are split off before BPE runs): the tokens of one message never depend on its
neighbours.
"""

from __future__ import annotations

import json

TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# the parser that reads this markup: hermes' markup read by a JSON-aware scan
# (`serving/tool_call_parser.py`, registered by Cedar's SGLang plugin)
TOOL_CALL_PARSER = "cedar"
# a call is CALL_HEAD + name + CALL_MID + arguments JSON + CALL_TAIL (the hermes structural tag's
# begin is CALL_HEAD + name + CALL_MID, its end CALL_TAIL)
CALL_HEAD = TOOL_CALL_BEGIN + '{"name":"'
CALL_MID = '", "arguments":'
CALL_TAIL = "}" + TOOL_CALL_END

TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions. Their signatures, as JSON schemas, "
                  "within <tools></tools>:\n<tools>")
TOOLS_EPILOGUE = ("\n</tools>\n\nTo call a function, write its name and arguments as a JSON object "
                  "within <tool_call></tool_call> tags:\n"
                  '<tool_call>{"name":"<function-name>", "arguments":<arguments-json-object>}</tool_call>')


def tools_block(tools: list[dict]) -> str:
    """The system-prompt text that lists `tools` (OpenAI `{"type": "function", ...}` dicts)."""
    return TOOLS_PREAMBLE + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_EPILOGUE


def system_text(system: str | None, tools: list[dict] | None) -> str:
    """The body of the system message: the system text, then the tools block if any."""
    if not tools:
        return system or ""
    return (system + "\n\n" if system else "") + tools_block(tools)


def tool_call_text(name: str, arguments: dict | str) -> str:
    """One call in the assistant's markup; `arguments` as a dict or as its JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return CALL_HEAD + name + CALL_MID + args + CALL_TAIL


def _jinja_str(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# NOTE: mirrors the functions above; tests/test_chat_template.py checks the two agree.
CHAT_TEMPLATE = (
    "{%- set markers = {'system': '<|system|>', 'developer': '<|system|>', 'user': '<|user|>', "
    "'assistant': '<|assistant|>', 'tool': '<|tool|>'} -%}"
    "{{- '<|bos|>' -}}"
    "{%- set first = 0 -%}"
    "{%- if tools -%}"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') -%}"
    "{%- set first = 1 -%}"
    "{%- set sys = messages[0]['content'] or '' -%}"
    "{{- '<|system|>' + (sys + '\\n\\n' if sys else '') -}}"
    "{%- else -%}{{- '<|system|>' -}}{%- endif -%}"
    "{{- " + _jinja_str(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + _jinja_str(TOOLS_EPILOGUE) + " -}}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages[first:] -%}"
    "{%- if message['role'] not in markers -%}"
    "{{- raise_exception('unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- markers[message['role']] + (message['content'] or '') -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) -%}"
    "{{- " + _jinja_str(CALL_HEAD) + " + f['name'] + " + _jinja_str(CALL_MID) + " + args + "
    + _jinja_str(CALL_TAIL) + " -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
