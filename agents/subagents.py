"""Subagents: a parent hands a task to children that start from a fresh context (their own
system prompt and the task, none of the parent's history), runs them in parallel, and folds their
answers back into its own context as tool results, as AgentX's coding sessions do with their
`Task` tool.

- `subagent`: the child program (a short ReAct loop over read-only tools).
- `delegate_tool(registry, backend, ...)`: a `delegate(task)` tool for a parent's registry that
  runs one child and returns its answer.
- `fan_out`: the parent program of the `subagents` agent: one child per subtask, in parallel
  (`run_batch`), then a final step over the folded results.
"""

from __future__ import annotations

from typing import Annotated

import sglang as sgl
from pydantic import Field

from cedar.frontend.chat import message_text, system_text, tool
from cedar.frontend.endpoint import backend_of, executor_of, label
from cedar.frontend.session import Session
from cedar.frontend.tools import ToolRegistry

from .steps import final_answer, finish_tool, run_until_finish

CHILD_SYSTEM = ("You are a subagent. You get one task and no other context. Use the tools, then call "
                "finish with a short answer for the agent that sent you.")
PARENT_SYSTEM = ("You coordinate subagents. Each answer of a subagent comes back as a tool result; "
                 "combine them and call finish with the final answer.")
READ_ONLY = ("list_dir", "read_file", "grep", "lookup", "calculate")


@sgl.function
def subagent(s, task: str, registry: ToolRegistry, max_steps: int = 3, temperature: float = 0.0,
             name: str = "subagent"):
    label(s, name)
    session = Session(name)
    s += sgl.system(system_text(CHILD_SYSTEM, registry.openai_tools()))
    s += sgl.user(task)
    run_until_finish(s, registry, session, range(max_steps), temperature=temperature)
    return session


def child_registry(registry: ToolRegistry) -> ToolRegistry:
    """The parent's read-only tools plus `finish`: what a child may use."""
    child = registry.subset([n for n in registry.names() if n in READ_ONLY])
    finish_tool(child)
    return child


def run_child(backend, registry: ToolRegistry, task: str, name: str, max_steps: int, temperature: float):
    state = subagent.run(task=task, registry=child_registry(registry), max_steps=max_steps,
                         temperature=temperature, name=name, backend=backend)
    return state.ret_value, state.text()


def delegate_tool(registry: ToolRegistry, backend, sessions: list, max_steps: int = 3,
                  temperature: float = 0.0, prefix: str = "sub") -> None:
    """Add `delegate(task)` to `registry`; each child's Session is appended to `sessions`."""

    def delegate(task: Annotated[str, Field(max_length=48)]) -> str:
        """Hand a self-contained task to a subagent with a fresh context; returns its answer.

        Args:
            task: the task, with everything the subagent needs to know
        """
        session, _ = run_child(backend, registry, task, f"{prefix}{len(sessions)}", max_steps, temperature)
        sessions.append(session)
        return f"subagent answer: {session.answer or '(no answer)'}"

    registry.add(delegate, timeout_s=600)


@sgl.function
def fan_out(s, goal: str, subtasks: list, registry: ToolRegistry, child_steps: int = 2,
            temperature: float = 0.0, name: str = "parent"):
    label(s, name)
    session = Session(name)
    parent_tools = registry.subset(registry.names())
    finish_tool(parent_tools)
    s += sgl.system(system_text(PARENT_SYSTEM, parent_tools.openai_tools()))
    s += sgl.user(goal)
    backend = backend_of(s)
    children_tools = child_registry(registry)
    if hasattr(backend, "prefill"):  # the children's common system message, once, before they run
        backend.prefill(executor_of(s), message_text("system", system_text(CHILD_SYSTEM, children_tools.openai_tools())))
    states = subagent.run_batch(
        [dict(task=t, registry=children_tools, max_steps=child_steps, temperature=temperature,
              name=f"{name}/child{i}") for i, t in enumerate(subtasks)], backend=backend)
    children = [st.ret_value for st in states]
    session.children = children
    s.set_var("child_texts", [st.text() for st in states])
    # fold back: one message announcing the hand-off, one tool result per child
    s += sgl.assistant("Thought: delegate the subtasks\n" + "".join(
        f"[subagent {i}] {t}\n" for i, t in enumerate(subtasks)))
    for i, child in enumerate(children):
        s += tool(f"subagent {i} answer: {child.answer or '(no answer)'}")
    final_answer(s, parent_tools, session, temperature)
    return session
