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
         # optional "answer": the text that ends the turn after the results; with "expected": []
         # the turn is answered without a tool (the constrained runner writes no call for it)
      ]
    }

Each turn: the user message, then one assistant message with as many constrained calls as the
turn expects (the name among the task's tools, the arguments by that tool's schema with default
bounds added), then one tool message per call (`results[k]`, or "ok"). With ``stated_values``
(`run_tasks(..., stated_values=True)`, `cedar evaluate --stated-values`) every free argument value
is further narrowed to the values the user's messages and the tool results so far state
(`cedar.frontend.stated_values`): a frontend's help, whose figures are reported apart.

Scoring, per call: **name** right; **arguments** right when every expected value is there and
equal (JSON equality: key order does not matter, 1 == 1.0) and nothing else is, except that an
argument the tool does not require may be left out; **exact** when the arguments equal the
expected ones as written; and per value (each expected argument), with each value not right told
apart (`value_misses`): left out, given as another value stated in the conversation before the
call (a wrong span copied), or given as a value stated nowhere in it (made up); a wrong tool's
values are all "wrong_tool". A task is right when all its calls are (arguments right), exact when
all are exact.

A bad task (not an object, no tools, a schema the runner refuses, a malformed turn, a JSONL line
that is not JSON, a constrained gen the server refuses) is an error for that task, reported with
its index and reason in `errors`, counted among the tasks and not solved; the others still run.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sglang as sgl

from cedar.frontend.calls import ConstrainedCallError, gen_call
from cedar.frontend.chat import system_text, tool
from cedar.frontend.endpoint import label
from cedar.frontend.stated_values import StatedValues
from cedar.frontend.tools import ToolRegistry


class TaskFileError(ValueError):
    """A task file that does not follow the format above."""


@dataclass(frozen=True)
class TaskError:
    """A task that could not be run: where it is in its file, its name if it has one, and why."""

    index: int
    name: str | None
    reason: str
    stage: str = "check"  # "check": refused before running; "run": stopped while running


@dataclass(frozen=True)
class CallScore:
    turn: int
    index: int
    expected: dict
    got_name: str
    got_arguments: str
    name_ok: bool
    arguments_ok: bool  # every value right; an argument the tool does not require may be left out
    exact: bool = False  # the arguments equal the expected ones as written
    values: int = 0  # expected argument values
    values_ok: int = 0  # of them given and equal (under the right name)
    misses: dict = field(default_factory=dict)  # the others by `MISSES` (`value_misses`; a wrong tool's: "wrong_tool")

    @property
    def ok(self) -> bool:
        return self.name_ok and self.arguments_ok


@dataclass(frozen=True)
class TaskSet:
    """A task file read leniently: the tasks that passed the checks (with their index in the
    file) and the errors of those that did not."""

    tasks: list[dict]
    indices: list[int]
    errors: list[TaskError]


def load_tasks(path: Path) -> list[dict]:
    """Every task of a file; raises TaskFileError at the first bad one (`read_tasks` does not)."""
    ts = read_tasks(path)
    if ts.errors:
        e = ts.errors[0]
        raise TaskFileError(f"{path}[{e.index}]: {e.reason}")
    return ts.tasks


def read_tasks(path: Path) -> TaskSet:
    """A task file (JSON list, one JSON task, or JSONL) with each bad task kept as its error.
    Raises TaskFileError only when the file holds no JSON at all."""
    text = Path(path).read_text()
    try:
        items = json.loads(text)
        items = items if isinstance(items, list) else [items]
    except json.JSONDecodeError as e:
        lines = [line for line in text.splitlines() if line.strip()]
        items = []
        for line in lines:
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as le:
                items.append(TaskError(len(items), None, f"not JSON: {le}"))
        if all(isinstance(x, TaskError) for x in items):
            raise TaskFileError(f"{path}: neither JSON nor JSONL: {e}") from None
    return check_tasks(items)


def check_tasks(items: list) -> TaskSet:
    tasks, indices, errors, seen = [], [], [], {}
    for i, item in enumerate(items):
        if isinstance(item, TaskError):
            errors.append(item)
            continue
        try:
            check_task(item, f"task {i}")
            if item["name"] in seen:
                raise TaskFileError(f"task {i}: the name {item['name']!r} is task {seen[item['name']]}'s too")
        except (TaskFileError, ValueError) as e:
            name = item.get("name") if isinstance(item, dict) and isinstance(item.get("name"), str) else None
            errors.append(TaskError(i, name, str(e)))
            continue
        seen[item["name"]] = i
        tasks.append(item)
        indices.append(i)
    return TaskSet(tasks, indices, errors)


def check_task(task: dict, where: str) -> None:
    """Raise TaskFileError for a task the runner cannot run (a schema the tool registry refuses included)."""
    if not isinstance(task, dict) or not isinstance(task.get("name"), str):
        raise TaskFileError(f"{where}: a task is an object with a string 'name'")
    if not isinstance(task.get("tools"), list) or not task["tools"] or \
            not all(isinstance(t, dict) for t in task["tools"]):
        raise TaskFileError(f"{where}: 'tools' must be a non-empty list of OpenAI tools")
    try:
        ToolRegistry.from_openai(task["tools"])
    except ValueError as e:
        raise TaskFileError(f"{where}: a tool the runner refuses: {e}") from None
    names = {t.get("function", t).get("name") for t in task["tools"]}
    if not isinstance(task.get("turns"), list) or not task["turns"]:
        raise TaskFileError(f"{where}: 'turns' must be a non-empty list")
    for j, turn in enumerate(task["turns"]):
        if not isinstance(turn, dict) or not isinstance(turn.get("user"), str) or \
                not isinstance(turn.get("expected"), list) or \
                not (turn["expected"] or isinstance(turn.get("answer"), str)):  # [] + answer: no tool
            raise TaskFileError(f"{where}.turns[{j}]: needs 'user' (string) and 'expected' (non-empty list, "
                                "or [] with a text 'answer')")
        for call in turn["expected"]:
            if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
                raise TaskFileError(f"{where}.turns[{j}]: expected call {call} names no listed tool "
                                    "or has no 'arguments' object")
        results = turn.get("results")
        if results is not None and (not isinstance(results, list) or not all(isinstance(r, str) for r in results)):
            raise TaskFileError(f"{where}.turns[{j}]: 'results' must be a list of strings")


def required_arguments(tools: list[dict]) -> dict[str, frozenset]:
    """Per tool name, the arguments its schema requires (JSON Schema: none unless listed)."""
    out = {}
    for t in tools:
        f = t.get("function", t)
        out[f["name"]] = frozenset((f.get("parameters") or {}).get("required") or ())
    return out


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


def parse_arguments(arguments: str):
    """A call's arguments as JSON, None when they are not JSON."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return None


def value_hits(got, expected: dict) -> list[bool]:
    """Per expected argument (in order): given and equal."""
    return [isinstance(got, dict) and k in got and same_json(got[k], v) for k, v in expected.items()]


def arguments_match(got, expected: dict, required: frozenset | None = None) -> tuple[bool, int]:
    """(every value right, an unrequired one possibly left out; expected values given and equal).
    `required` None: every expected argument is required."""
    if not isinstance(got, dict):
        return False, 0
    values_ok = sum(value_hits(got, expected))
    need = set(expected) if required is None else set(expected) & set(required)
    ok = set(got) <= set(expected) and need <= set(got) and all(same_json(got[k], expected[k]) for k in got)
    return ok, values_ok


MISSES = ("left_out", "stated_elsewhere", "stated_nowhere", "wrong_tool")


def whole_value(value: str) -> re.Pattern:
    """A pattern for ``value`` as a whole value: not inside a longer word or number (5 is not in
    -5, 15, 5.3 or x5; "ab" is not in "abc"). The corpus finds stated values with it too
    (`cedar.training.corpus.build.value_at`)."""
    before = r"(?<![0-9A-Za-z.\-])" if value[:1].isdigit() else r"(?<![0-9A-Za-z.])"
    return re.compile(before + re.escape(value) + r"(?![0-9A-Za-z]|\.[0-9])")


def value_texts(value) -> list[str]:
    """A JSON value's leaves as a conversation states them: strings as they are, numbers as JSON
    writes them (an array's or object's leaves in order; none for an empty one)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in value_texts(v)]
    if isinstance(value, list):
        return [x for v in value for x in value_texts(v)]
    return [value if isinstance(value, str) else json.dumps(value)]


def value_misses(got, expected: dict, context: str) -> dict[str, int]:
    """The expected values a call's arguments (``got``, parsed) do not give right, by why:
    "left_out" (no such argument), "stated_elsewhere" (the given value's every leaf is stated whole
    in ``context``, the conversation before the call: another span copied), "stated_nowhere"
    (some leaf is not: made up). Keys with no value are left out."""
    out: dict[str, int] = {}
    for (k, v), hit in zip(expected.items(), value_hits(got, expected)):
        if hit:
            continue
        if not isinstance(got, dict) or k not in got:
            why = "left_out"
        else:
            texts = value_texts(got[k])
            why = "stated_elsewhere" if texts and all(whole_value(t).search(context) for t in texts) else "stated_nowhere"
        out[why] = out.get(why, 0) + 1
    return out


def values_missed(calls: list[CallScore]) -> dict[str, int]:
    """The expected values not right, summed over ``calls`` by `MISSES` (every key present)."""
    out = dict.fromkeys(MISSES, 0)
    for c in calls:
        for why, n in c.misses.items():
            out[why] += n
    return out


def value_kind(v) -> str:
    """A JSON value's kind as the scores break values down: bool, integer, number, string,
    array, object or null."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "null")


def values_by_kind(calls: list[CallScore]) -> dict[str, dict[str, int]]:
    """Expected argument values by kind: {kind: {"values": n, "ok": given and equal under the
    right name (0 for a call to the wrong tool, as values_ok counts)}}."""
    out: dict[str, dict[str, int]] = {}
    for c in calls:
        expected = c.expected["arguments"]
        for v, hit in zip(expected.values(), value_hits(parse_arguments(c.got_arguments), expected)):
            d = out.setdefault(value_kind(v), {"values": 0, "ok": 0})
            d["values"] += 1
            d["ok"] += c.name_ok and hit
    return out


def score_call(turn: int, index: int, expected: dict, name: str, arguments: str,
               required: frozenset | None = None, context: str = "") -> CallScore:
    """One call against its expected one; ``context``: the conversation's text before the call
    (what `value_misses` looks a wrong value up in)."""
    parsed = parse_arguments(arguments)
    name_ok = name == expected["name"]
    args_ok, values_ok = arguments_match(parsed, expected["arguments"], required)
    n = len(expected["arguments"])
    misses = value_misses(parsed, expected["arguments"], context) if name_ok else ({"wrong_tool": n} if n else {})
    return CallScore(turn, index, expected, name, arguments, name_ok, name_ok and args_ok,
                     name_ok and same_json(parsed, expected["arguments"]), n, values_ok if name_ok else 0, misses)


def share(n: int, total: int) -> float:
    return round(n / total, 4) if total else 0.0


def summarize(per_task: dict[str, list[CallScore]], errors: list[TaskError] = ()) -> dict:
    """Per call (name, arguments, exact, values) and per task; a task with an error counts as
    a task, never as solved, and is listed with its index and reason."""
    calls = [c for scores in per_task.values() for c in scores]
    failed = {e.name for e in errors if e.stage == "run"}
    ran = {k: v for k, v in per_task.items() if k not in failed}
    tasks = len(ran) + len(errors)
    tasks_ok = sum(all(c.ok for c in s) for s in ran.values())  # a task with no call has nothing wrong
    tasks_exact = sum(all(c.exact for c in s) for s in ran.values())
    values = sum(c.values for c in calls)
    return {"tasks": tasks, "tasks_ok": tasks_ok, "tasks_exact": tasks_exact, "task_errors": len(errors),
            "calls": len(calls), "names_ok": sum(c.name_ok for c in calls), "calls_ok": sum(c.ok for c in calls),
            "calls_exact": sum(c.exact for c in calls), "values": values,
            "values_ok": sum(c.values_ok for c in calls), "values_by_kind": values_by_kind(calls),
            "values_missed": values_missed(calls),
            "name_accuracy": share(sum(c.name_ok for c in calls), len(calls)),
            "call_accuracy": share(sum(c.ok for c in calls), len(calls)),
            "exact_accuracy": share(sum(c.exact for c in calls), len(calls)),
            "value_accuracy": share(sum(c.values_ok for c in calls), values),
            "task_accuracy": share(tasks_ok, tasks),
            "errors": [asdict(e) for e in errors],
            "per_task": {k: [asdict(c) | {"ok": c.ok} for c in v] for k, v in per_task.items()}}


@sgl.function
def function_calling(s, task: dict, temperature: float = 0.0, stated_values: bool = False):
    """One task: returns {"scores": [CallScore, ...], "error": None or why it stopped}; a gen the
    server refuses ends the task with its error, not the batch. stated_values: every free
    argument value narrowed to those the user's messages and the tool results so far state
    (`cedar.frontend.stated_values`)."""
    label(s, task["name"])
    registry = ToolRegistry.from_openai(task["tools"])
    required = required_arguments(task["tools"])
    s += sgl.system(system_text(task.get("system"), registry.openai_tools()))
    scores, said = [], []  # said: the user's messages and the tool results, in order
    try:
        for t, turn in enumerate(task["turns"]):
            s += sgl.user(turn["user"])
            said.append(turn["user"])
            context = s.text()  # the conversation before this turn's calls
            stated = StatedValues.of(said) if stated_values else None
            s += sgl.assistant_begin()
            calls = [gen_call(s, registry, f"t{t}c{k}", temperature=temperature, stated=stated)
                     for k in range(len(turn["expected"]))]
            s += sgl.assistant_end()
            results = turn.get("results") or []
            for k, (call, expected) in enumerate(zip(calls, turn["expected"])):
                scores.append(score_call(t, k, expected, call.name, call.arguments, required[expected["name"]], context))
                s += tool(results[k] if k < len(results) else "ok")
                said.append(results[k] if k < len(results) else "ok")
    except ConstrainedCallError as e:
        return {"scores": scores, "error": str(e)[:300]}
    return {"scores": scores, "error": None}


def run_tasks(tasks: list | TaskSet, backend, temperature: float = 0.0, stated_values: bool = False) -> dict:
    """Check every task (a list) or take a file's checked `TaskSet`, run the good ones as one
    batch and score them; the bad ones are errors in the summary. stated_values: see
    `function_calling`."""
    ts = tasks if isinstance(tasks, TaskSet) else check_tasks(tasks)
    errors = list(ts.errors)
    states = function_calling.run_batch([dict(task=t, temperature=temperature, stated_values=stated_values)
                                         for t in ts.tasks], backend=backend) if ts.tasks else []
    per_task = {}
    for i, t, st in zip(ts.indices, ts.tasks, states):
        out = st.ret_value
        per_task[t["name"]] = out["scores"]
        if out["error"]:
            errors.append(TaskError(i, t["name"], out["error"], "run"))
    return summarize(per_task, sorted(errors, key=lambda e: e.index))
