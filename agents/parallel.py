"""Parallel tool calls with `fork`: the context forks into branches, each branch writes one
constrained call (concurrent requests sharing the prefix), every call runs, and the calls and
their results are joined back into one context as one assistant message holding all calls
followed by one tool message per result (the OpenAI parallel-tool-call shape).
"""

from __future__ import annotations

import concurrent.futures as cf

import sglang as sgl

from cedar.frontend.calls import gen_call
from cedar.frontend.chat import system_text, tool, tool_call_text
from cedar.frontend.endpoint import label, sync
from cedar.frontend.session import Session, Step
from cedar.frontend.tools import ToolRegistry

from .steps import final_answer


def parallel_step(s, registry: ToolRegistry, var: str, hints: list[str], names: list[str] | None = None,
                  temperature: float = 0.0, name: str = "fork") -> list[Step]:
    """Fork `len(hints)` branches (branch i's thought is hints[i]), one call each, then join."""
    thought = "in parallel: " + "; ".join(hints)
    s += sgl.assistant_begin()
    s += "Thought: " + thought + "\n"
    # NOTE: SGLang prefills the shared prefix once before the branches only if the text is there
    # when `fork` looks (it checks before syncing the executor): sync first
    sync(s)
    forks = s.fork(len(hints))
    for i, f in enumerate(forks):
        label(f, f"{name}/{i}")
        f += f"[{i}] {hints[i]}\n"
    # NOTE: one thread per branch (a branch blocks on its own name before its arguments), so the
    # branches' requests are in flight together and the server batches them
    with cf.ThreadPoolExecutor(len(hints)) as pool:
        calls = list(pool.map(lambda i: gen_call(forks[i], registry, f"{var}_b{i}", names=names,
                                                  temperature=temperature), range(len(hints))))
    forks.join()
    results = [registry.call(c.name, c.arguments) for c in calls]
    s += "".join(tool_call_text(c.name, c.arguments) for c in calls)
    s += sgl.assistant_end()
    for obs in results:
        s += tool(obs.text)
    return [Step(thought, c.name, c.arguments, o.text, o.ok) for c, o in zip(calls, results)]


@sgl.function
def parallel(s, question: str, hints: list, registry: ToolRegistry, temperature: float = 0.0,
             name: str = "parallel"):
    """The `parallel` agent: one forked step over `hints`, then a final answer."""
    label(s, name)
    session = Session(name)
    s += sgl.system(system_text("Use several tools at once when they are independent.", registry.openai_tools()))
    s += sgl.user(question)
    for st in parallel_step(s, registry, "par", hints, names=[n for n in registry.names() if n != "finish"],
                            temperature=temperature, name=name + "/fork"):
        session.add(st)
    final_answer(s, registry, session, temperature)
    return session
