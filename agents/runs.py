"""Every agent by name, run on a backend with a task (a JSON dict; each agent has an example),
returning one JSON-able result: the session(s) or scores, and what the cache did per request."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from cedar.frontend.session import reuse_figures

from . import coding as coding_mod
from . import function_calling as fc
from . import react as react_mod
from .parallel import parallel
from .sandbox import Sandbox
from .subagents import fan_out

TASKS_DIR = Path(__file__).parent / "tasks"


def run_react(backend, task: dict | None) -> dict:
    task = task or {"question": react_mod.EXAMPLE_QUESTION, "facts": react_mod.EXAMPLE_FACTS}
    state = react_mod.react.run(question=task["question"], facts=task["facts"],
                                max_steps=task.get("max_steps", 6), backend=backend)
    return {"session": state.ret_value.to_json(), "text": state.text()}


def run_coding(backend, task: dict | None) -> dict:
    task = {"parallel_hints": ["list the files", "read calc.py"], "delegate_at": 2, **(task or coding_mod.EXAMPLE_TASK)}
    with Sandbox() as box:
        box.write_files(task["files"])
        state = coding_mod.coding.run(instruction=task["instruction"], box=box, max_turns=task.get("max_turns", 8),
                                      parallel_hints=task["parallel_hints"], delegate_at=task["delegate_at"],
                                      backend=backend)
        files = {str(p.relative_to(box.root)): p.read_text(errors="replace")
                 for p in sorted(box.root.rglob("*")) if p.is_file()}
    return {"session": state.ret_value.to_json(), "files_after": files, "text": state.text()}


def run_parallel(backend, task: dict | None) -> dict:
    task = task or {"question": react_mod.EXAMPLE_QUESTION, "facts": react_mod.EXAMPLE_FACTS,
                    "hints": ["look up the capital of France", "look up the river of Paris",
                              "look up the length of the Seine"]}
    state = parallel.run(question=task["question"], hints=task["hints"], registry=react_mod.react_tools(task["facts"]),
                         backend=backend)
    return {"session": state.ret_value.to_json(), "text": state.text()}


def run_subagents(backend, task: dict | None) -> dict:
    task = task or {"goal": react_mod.EXAMPLE_QUESTION, "facts": react_mod.EXAMPLE_FACTS,
                    "subtasks": ["find the capital of France", "find the length of the Seine"]}
    state = fan_out.run(goal=task["goal"], subtasks=task["subtasks"], registry=react_mod.react_tools(task["facts"]),
                        backend=backend)
    return {"session": state.ret_value.to_json(), "text": state.text(), "child_texts": state["child_texts"]}


def run_function_calling(backend, task: dict | list | fc.TaskSet | None, stated_values: bool = False) -> dict:
    """A task, a task list or a file's `TaskSet` (default: the example file); a bad task is an
    error in `scores["errors"]`, the others still run. stated_values: see `fc.function_calling`."""
    tasks = task if isinstance(task, (list, fc.TaskSet)) else [task] if task else \
        fc.read_tasks(TASKS_DIR / "function_calling.json")
    return {"scores": fc.run_tasks(tasks, backend, stated_values=stated_values)}


AGENTS: dict[str, Callable] = {
    "react": run_react,
    "coding": run_coding,
    "parallel": run_parallel,
    "subagents": run_subagents,
    "function-calling": run_function_calling,
}


def load_task(name: str, path: str | None):
    """The task for agent `name` from a file: a task file (see `function_calling`) for the
    function-calling runner, read leniently (a bad task is kept as its error), one JSON object of
    the agent's inputs for the others."""
    if path is None:
        return None
    if name == "function-calling":
        return fc.read_tasks(Path(path))
    try:
        task = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(task, dict):
        raise ValueError(f"{path}: the {name} agent takes one JSON object")
    return task


def run_agent(name: str, backend, task=None, stated_values: bool = False) -> dict:
    """Run agent ``name`` on ``task``; stated_values (the function-calling runner only): narrow
    every free argument value to those the conversation states."""
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name!r}; agents: {', '.join(AGENTS)}")
    if stated_values and name != "function-calling":
        raise ValueError(f"--stated-values is an option of the function-calling runner, not of {name!r}")
    backend.take_records()
    result = AGENTS[name](backend, task, stated_values=True) if stated_values else AGENTS[name](backend, task)
    records = backend.take_records()
    return {"agent": name, **result, "records": [asdict(r) for r in records],
            "reuse": reuse_figures(records).to_json()}
