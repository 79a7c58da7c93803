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
    CALL_HEAD,
    CALL_MID,
    CALL_TAIL,
    system_text,
    tool_call_text,
)
from cedar.backend.tokenizer import BOS, END, ROLE_MARKERS

TEMPLATE_NAME = "cedar"
CEDAR_TEMPLATE = ChatTemplate(
    name=TEMPLATE_NAME,
    default_system_prompt=None,
    role_prefix_and_suffix={role: ((BOS if role == "system" else "") + marker, END)
                            for role, marker in ROLE_MARKERS.items()},
    stop_str=(END,),
)


def message_text(role: str, text: str) -> str:
    """One message as the template writes it (what `sgl.system(text)` etc. append)."""
    prefix, suffix = CEDAR_TEMPLATE.role_prefix_and_suffix[role]
    return prefix + text + suffix


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
