"""The step every Cedar agent takes: one assistant message with a short thought and one
constrained tool call, then the tool's result as a tool message.

    <|assistant|>Thought: {thought}\n<tool_call>{"name":"NAME", "arguments":{...}}</tool_call><|end|>
    <|tool|>{observation}<|end|>

The thought is a bounded regex gen (printable ASCII without '<', at most THOUGHT_CHARS), so it
cannot open a tool call and ends inside its token budget; it ends where its grammar ends, so its
tokens are carried forward exactly (see `cedar.frontend.endpoint`).
"""

from __future__ import annotations

from typing import Annotated

import sglang as sgl
from pydantic import Field

from cedar.frontend.calls import Call, gen_call, observe
from cedar.frontend.session import Session, Step
from cedar.frontend.tools import ToolRegistry

THOUGHT_CHARS = 60
THOUGHT_REGEX = "[ -;=-~]{1,%d}" % THOUGHT_CHARS  # printable ASCII without '<'


def step(s, registry: ToolRegistry, var: str, names: list[str] | None = None, temperature: float = 0.0,
         thought: str | None = None) -> tuple[Step, Call]:
    """One thought + call + observation on `s`; `thought` given skips the thought gen."""
    s += sgl.assistant_begin()
    s += "Thought: "
    if thought is None:
        # NOTE: the gen includes the newline that ends a thought: a model ends its thought by writing
        # it, and a grammar without it could only stop at THOUGHT_CHARS (a trained model, denied
        # its newline, writes filler until then)
        s += sgl.gen(f"{var}_thought", regex=THOUGHT_REGEX + "\n", max_tokens=THOUGHT_CHARS + 2,
                     temperature=temperature)
        thought = s[f"{var}_thought"].rstrip("\n")
    else:
        s += thought + "\n"
    call = gen_call(s, registry, var, names=names, temperature=temperature)
    s += sgl.assistant_end()
    obs = observe(s, registry, call)
    return Step(thought, call.name, call.arguments, obs.text, obs.ok), call


def run_until_finish(s, registry: ToolRegistry, session: Session, turns: range, var: str = "step",
                     forced: dict[int, list[str]] | None = None, temperature: float = 0.0) -> None:
    """Take steps for each turn in `turns` until the model calls `finish`; its `answer` argument
    becomes `session.answer`. `forced[turn]` limits that turn's choice of tools."""
    for turn in turns:
        done, call = step(s, registry, f"{var}{turn}", names=(forced or {}).get(turn), temperature=temperature)
        session.add(done)
        if call.name == "finish":
            session.answer = (call.parsed() or {}).get("answer")
            return


def final_answer(s, registry: ToolRegistry, session: Session, temperature: float = 0.0) -> None:
    """One last step whose call is `finish`: its answer becomes `session.answer`."""
    run_until_finish(s, registry, session, range(1), var="final", forced={0: ["finish"]}, temperature=temperature)


def finish_tool(registry: ToolRegistry) -> None:
    """Add the `finish` tool every loop ends with (once): its argument is the final answer."""
    if "finish" in registry.names():
        return
    def finish(answer: Annotated[str, Field(max_length=40)]) -> str:
        """Give the final answer and stop.

        Args:
            answer: the final answer
        """
        return "done"

    registry.add(finish)
