"""Cedar's chat markup for SGLang's frontend language: the role template (`sgl.system`,
`sgl.user`, `sgl.assistant`, and a `tool` role for results) and the tool-call markup, the same
bytes as the served model's Jinja template (`cedar.backend.chat_template`), so a program's
context and an OpenAI-API conversation tokenize alike.

NOTE: the system prefix carries `<|bos|>`: every Cedar program opens with a system message, as
the Jinja template opens every conversation with `<|bos|>`.
"""

from __future__ import annotations

from sglang.lang.chat_template import ChatTemplate, get_chat_template, register_chat_template
from sglang.lang.ir import SglExprList, SglRoleBegin, SglRoleEnd

from cedar.backend.chat_template import (  # noqa: F401 - re-exported for programs
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    system_text,
    tool_call_text,
    tools_block,
)

TEMPLATE_NAME = "cedar"
END = "<|end|>"
CEDAR_TEMPLATE = ChatTemplate(
    name=TEMPLATE_NAME,
    default_system_prompt=None,
    role_prefix_and_suffix={
        "system": ("<|bos|><|system|>", END),
        "user": ("<|user|>", END),
        "assistant": ("<|assistant|>", END),
        "tool": ("<|tool|>", END),
    },
    stop_str=(END,),
)
# the text between '<tool_call>' and the chosen name, and between the name and the arguments:
# SGLang's hermes structural tag writes a call as CALL_HEAD + name + CALL_MID + args + CALL_TAIL
CALL_HEAD = TOOL_CALL_BEGIN + '{"name":"'
CALL_MID = '", "arguments":'
CALL_TAIL = "}" + TOOL_CALL_END


def register() -> ChatTemplate:
    """Register the template with SGLang's frontend (idempotent) and return it."""
    try:
        return get_chat_template(TEMPLATE_NAME)
    except KeyError:
        register_chat_template(CEDAR_TEMPLATE)
        return CEDAR_TEMPLATE


def tool(expr=None):
    """A tool-result message, like `sgl.user(expr)` for the `tool` role."""
    if expr is None:
        return SglExprList([SglRoleBegin("tool"), SglRoleEnd("tool")])
    return SglExprList([SglRoleBegin("tool"), expr, SglRoleEnd("tool")])
