"""A coding agent in a throw-away sandbox (`sandbox.py`): list, read, grep, write and edit files,
run Python snippets, hand subtasks to subagents (`delegate`), and finish.

Many turns long; each turn is one thought + one constrained call + its result. Two turns can be
placed by the caller, as an agent framework's policy would place them:
- `parallel_hints`: the first turn explores in parallel (a `fork` of read-only calls, joined);
- `delegate_at`: the turn whose call is the `delegate` tool (a subagent with a fresh context).

    with Sandbox() as box:
        box.write_files(task["files"])
        state = coding.run(instruction=..., box=box, max_turns=8, backend=backend)
"""

from __future__ import annotations

import sglang as sgl

from cedar.frontend.chat import system_text
from cedar.frontend.endpoint import backend_of, label
from cedar.frontend.session import Session

from .parallel import parallel_step
from .sandbox import Sandbox
from .steps import finish_tool, run_until_finish
from .subagents import delegate_tool

SYSTEM = ("You are a coding agent working in a sandbox directory. Each turn, write one short thought "
          "and call one tool. Run the tests before you finish; call finish with a one-line summary.")
EXAMPLE_TASK = {
    "instruction": "The test in test_calc.py fails. Fix calc.py so that add(2, 3) == 5.",
    "files": {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "test_calc.py": "from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n",
        "README.md": "A tiny calculator.\n",
    },
}


@sgl.function
def coding(s, instruction: str, box: Sandbox, max_turns: int = 8, parallel_hints: list | None = None,
           delegate_at: int | None = None, temperature: float = 0.0, name: str = "coding"):
    label(s, name)
    session = Session(name)
    registry = box.tools()
    delegate_tool(registry, backend_of(s), session.children, temperature=temperature,
                  prefix=f"{name}/sub")
    finish_tool(registry)
    s += sgl.system(system_text(SYSTEM, registry.openai_tools()))
    s += sgl.user(instruction)
    if parallel_hints:  # turn 0
        for st in parallel_step(s, registry, "explore", list(parallel_hints), names=["list_dir", "read_file", "grep"],
                                temperature=temperature, name=f"{name}/fork"):
            session.add(st)
    forced = {delegate_at: ["delegate"]} if delegate_at is not None else None
    run_until_finish(s, registry, session, range(1 if parallel_hints else 0, max_turns), var="turn", forced=forced,
                     temperature=temperature)
    s.set_var("answer", session.answer or "")
    return session
