"""Cedar's tool-call parser (``--tool-call-parser cedar``): SGLang's ``hermes`` markup
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, see ``chat_template.py``) read by a
JSON-aware scan, the same one for a whole response and for a stream.

NOTE: why not ``hermes`` itself. Its one-shot parse cuts a call at the first ``</tool_call>`` (a
non-greedy regex), so a call whose argument string holds that text fails to parse and the server
returns the raw markup as content, while its streaming parse (partial JSON) returns the call:
the two disagree. Here a call ends where its JSON value ends (strings and escapes followed), and
the stream is parsed by the same scan over what has arrived, so a streamed response adds up to the
non-streamed one in every ``tool_choice``.

Registered through SGLang 0.5.23's parser registry, ``FunctionCallParser.ToolCallParserEnum``,
which ``--tool-call-parser`` reads live once a plugin has added to it (``server_args.
_tool_call_parser_choices``); the plugin runs before the server's arguments are parsed, and a
server without it refuses ``--tool-call-parser cedar`` at start.

Contract (``scan``):
- a *call* is ``<tool_call>``, optional whitespace, one JSON object or array, optional whitespace,
  then ``</tool_call>`` (or the end of the response: a call the model closed but did not tag);
- everything else is text, kept verbatim: text around calls, and a ``<tool_call>`` that does not
  start a call (malformed JSON, something other than the closing tag after it, a call cut off by
  ``max_tokens``) together with what follows it up to the next ``<tool_call>``;
- streamed, text that may still become a call (a partial ``<tool_call>`` or an open call) is held
  back until it is decided; each call is sent whole, name and arguments in one delta, when its
  closing tag arrives (or at the end of the stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..chat_template import TOOL_CALL_BEGIN, TOOL_CALL_END

PARSER_NAME = "cedar"
_WS = " \t\r\n"


@dataclass
class Scan:
    """What ``scan`` decided: ``parts`` in order, each a text (str) or a call (the parsed JSON
    object or array); ``consumed`` characters of the input are decided, the rest is held."""

    parts: list = field(default_factory=list)
    consumed: int = 0

    def text(self, s: str) -> None:
        if not s:
            return
        if self.parts and isinstance(self.parts[-1], str):
            self.parts[-1] += s
        else:
            self.parts.append(s)


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that starts at ``text[start]`` (its brackets
    matched outside strings, escapes followed), None when ``text`` ends first; -1 when
    ``text[start]`` does not open one."""
    if start >= len(text):
        return None
    if text[start] not in "{[":
        return -1
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest proper prefix of ``token`` that ``text`` ends with."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan(text: str, final: bool) -> Scan:
    """Split ``text`` into text and calls (the module's contract). ``final``: nothing more will
    arrive, so nothing is held back."""
    out, i = Scan(), 0
    while True:
        j = text.find(TOOL_CALL_BEGIN, i)
        if j < 0:
            hold = 0 if final else _partial_suffix(text[i:], TOOL_CALL_BEGIN)
            out.text(text[i:len(text) - hold])
            out.consumed = len(text) - hold
            return out
        out.text(text[i:j])
        body = _skip_ws(text, j + len(TOOL_CALL_BEGIN))
        end = json_value_end(text, body)
        if end is None:  # the call is still open
            if final:
                out.text(text[j:])
                out.consumed = len(text)
            else:
                out.consumed = j
            return out
        after = _skip_ws(text, end) if end > 0 else -1
        value = _loads(text[body:end]) if end > 0 else None
        if value is not None and text.startswith(TOOL_CALL_END, after):
            out.parts.append(value)
            i = after + len(TOOL_CALL_END)
            continue
        if value is not None and TOOL_CALL_END.startswith(text[after:]):  # the tag may follow
            if not final:
                out.consumed = j
                return out
            if after == len(text):  # a closed call the model did not tag, at the very end
                out.parts.append(value)
                out.consumed = len(text)
                return out
        # not a call: the marker is text; scanning goes on after it
        out.text(TOOL_CALL_BEGIN)
        i = j + len(TOOL_CALL_BEGIN)


def _loads(s: str):
    try:
        value = json.loads(s)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, (dict, list)) else None


def _detector_class():
    from sglang.srt.function_call.core_types import StreamingParseResult
    from sglang.srt.function_call.hermes_detector import HermesDetector

    class CedarToolCallDetector(HermesDetector):
        """``hermes``' markup, structural tags and constraints; the parse of ``scan``."""

        def _items(self, parts, tools, streamed: bool):
            normal, calls = "", []
            for part in parts:
                if isinstance(part, str):
                    normal += part
                    continue
                for item in self.parse_base_json(part, tools):
                    if streamed:  # in a stream, tool_index is the call's ordinal
                        self.current_tool_id = len(self.prev_tool_call_arr)
                        item.tool_index = self.current_tool_id
                        self.prev_tool_call_arr.append({"name": item.name, "arguments": json.loads(item.parameters)})
                        self.streamed_args_for_tool.append(item.parameters)
                    calls.append(item)
            return StreamingParseResult(normal_text=normal, calls=calls)

        def detect_and_parse(self, text, tools):
            return self._items(scan(text, final=True).parts, tools, streamed=False)

        def parse_streaming_increment(self, new_text, tools):
            self._buffer += new_text
            result = scan(self._buffer, final=False)
            self._buffer = self._buffer[result.consumed:]
            return self._items(result.parts, tools, streamed=True)

        def finish(self, tools):
            result = scan(self._buffer, final=True)
            self._buffer = ""
            return self._items(result.parts, tools, streamed=True)

    return CedarToolCallDetector


def register() -> type:
    """Add the parser to SGLang's registry under ``PARSER_NAME`` (idempotent); the class."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    registry = FunctionCallParser.ToolCallParserEnum
    if PARSER_NAME not in registry:
        registry[PARSER_NAME] = _detector_class()
    return registry[PARSER_NAME]
