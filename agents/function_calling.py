"""A function-calling runner: tasks from a JSON file, every call constrained by its function's
schema, scored against the expected calls.

Task file: a JSON list of tasks (or one task per line, JSONL). A task:

    {
      "name": "weather-1",                      # unique id
      "system": "You are a helpful assistant.",   # optional
      "tools": [{"type": "function", "function": {"name": "get_weather",
                 "description": "...", "parameters": {JSON schema}}}],
      "turns": [
        {"user": "What is the weather in Paris?",
         "expected": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
         "results": ["sunny, 21 C"]}           # optional: the tool results fed back, per call
      ]
    }

Each turn: the user message, then one assistant message with as many constrained calls as the
turn expects (the name among the task's tools, the arguments by that tool's schema with default
bounds added), then one tool message per call (`results[k]`, or "ok"). A call is right when its
name is the expected name and its parsed arguments equal the expected ones (JSON equality: key
order does not matter, 1 == 1.0); a task is right when all its calls are.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import sglang as sgl

from cedar.frontend.calls import gen_call
from cedar.frontend.chat import system_text, tool
from cedar.frontend.endpoint import label
from cedar.frontend.tools import ToolRegistry


class TaskFileError(ValueError):
    """A task file that does not follow the format above."""


@dataclass(frozen=True)
class CallScore:
    turn: int
    index: int
    expected: dict
    got_name: str
    got_arguments: str
    name_ok: bool
    arguments_ok: bool

    @property
    def ok(self) -> bool:
        return self.name_ok and self.arguments_ok


def load_tasks(path: Path) -> list[dict]:
    text = Path(path).read_text()
    try:
        tasks = json.loads(text)
    except json.JSONDecodeError:
        try:
            tasks = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}: neither JSON nor JSONL: {e}") from None
    tasks = tasks if isinstance(tasks, list) else [tasks]
    for i, task in enumerate(tasks):
        check_task(task, f"{path}[{i}]")
    return tasks


def check_task(task: dict, where: str) -> None:
    if not isinstance(task, dict) or not isinstance(task.get("name"), str):
        raise TaskFileError(f"{where}: a task is an object with a string 'name'")
    if not isinstance(task.get("tools"), list) or not task["tools"]:
        raise TaskFileError(f"{where}: 'tools' must be a non-empty list of OpenAI tools")
    names = {t.get("function", t).get("name") for t in task["tools"]}
    if not isinstance(task.get("turns"), list) or not task["turns"]:
        raise TaskFileError(f"{where}: 'turns' must be a non-empty list")
    for j, turn in enumerate(task["turns"]):
        if not isinstance(turn.get("user"), str) or not isinstance(turn.get("expected"), list):
            raise TaskFileError(f"{where}.turns[{j}]: needs 'user' (string) and 'expected' (list)")
        for call in turn["expected"]:
            if call.get("name") not in names or not isinstance(call.get("arguments"), dict):
                raise TaskFileError(f"{where}.turns[{j}]: expected call {call} names no listed tool "
                                    "or has no 'arguments' object")


def same_json(a, b) -> bool:
    """JSON equality: dicts ignore key order, numbers compare by value, bool is not a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def score_call(turn: int, index: int, expected: dict, name: str, arguments: str) -> CallScore:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    name_ok = name == expected["name"]
    return CallScore(turn, index, expected, name, arguments, name_ok,
                     name_ok and same_json(parsed, expected["arguments"]))


def summarize(per_task: dict[str, list[CallScore]]) -> dict:
    calls = [c for scores in per_task.values() for c in scores]
    return {"tasks": len(per_task), "tasks_ok": sum(all(c.ok for c in s) for s in per_task.values()),
            "calls": len(calls), "calls_ok": sum(c.ok for c in calls),
            "names_ok": sum(c.name_ok for c in calls),
            "call_accuracy": round(sum(c.ok for c in calls) / len(calls), 4) if calls else 0.0,
            "task_accuracy": round(sum(all(c.ok for c in s) for s in per_task.values()) / len(per_task), 4)
            if per_task else 0.0,
            "per_task": {k: [asdict(c) | {"ok": c.ok} for c in v] for k, v in per_task.items()}}


@sgl.function
def function_calling(s, task: dict, temperature: float = 0.0):
    """One task: returns its list of CallScore."""
    label(s, task["name"])
    registry = ToolRegistry.from_openai(task["tools"])
    s += sgl.system(system_text(task.get("system"), registry.openai_tools()))
    scores = []
    for t, turn in enumerate(task["turns"]):
        s += sgl.user(turn["user"])
        s += sgl.assistant_begin()
        calls = [gen_call(s, registry, f"t{t}c{k}", temperature=temperature) for k in range(len(turn["expected"]))]
        s += sgl.assistant_end()
        results = turn.get("results") or []
        for k, (call, expected) in enumerate(zip(calls, turn["expected"])):
            scores.append(score_call(t, k, expected, call.name, call.arguments))
            s += tool(results[k] if k < len(results) else "ok")
    return scores


def run_tasks(tasks: list[dict], backend, temperature: float = 0.0) -> dict:
    states = function_calling.run_batch([dict(task=t, temperature=temperature) for t in tasks], backend=backend)
    return summarize({t["name"]: st.ret_value for t, st in zip(tasks, states)})
