"""`cedar evaluate`: a model on generated tasks through a real server, greedy, per split.

The splits are reported apart, never mixed: **held-out** tasks come from templates no training
task uses (bug kinds, tool schemas, fact bases, phrasings); **in-template** tasks are fresh
instances of the training templates. A task's template is `task.template` (its kind where the
task has none). Per split:

- **task success per kind and per template**: each task runs through its agent program
  (constrained calls, as the agents always call) and is judged by `outcome.outcome_ok`: a coding
  task only when its test passes on the files the agent left (the old check, the fixed line
  present in the file, is reported beside it as `fixed_line_present`, never as success);
- **function calling per call**: name right, arguments right (an optional argument may be left
  out), exact, values right; and per task (`function_calling.summarize`);
- **long-range recall**: the `recall` tasks with the token distance between value and answer;
- **tool-call validity without constraints**: every turn with calls of the function-calling tasks
  through the OpenAI API with `tool_choice: "auto"` (earlier turns are the gold calls, results and
  answers; a turn's calls may come one request at a time, each after the previous result, as a
  client loop takes them), with why each call that is not valid is not;
- **the OpenAI-API loop** (`api_loop`): the function-calling tasks as client loops; how many end
  on their own, hit the limit, are solved;
- with ``--stated-values``, **calls narrowed to stated values** (`function_calling_stated`): the
  function-calling tasks again, every free argument value constrained to the values the
  conversation states (`cedar.frontend.stated_values`, PICARD-style): a frontend's help, so its
  figures are reported apart from the plain constrained ones, never in their place; and the
  OpenAI-API loops twice more (`api_loop_strict`: every tool sent ``strict``, so the server
  constrains each call by its schema; `api_loop_stated`: strict and narrowed before each request,
  `narrow_tools`): the narrowing's share apart from the constraint's.

A task whose run fails (the server refuses a gen, a tool raises, a malformed task) is an error
for that task, reported with its index, kind and reason, and counted as not solved; the others
still run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cedar.frontend.tools import ToolRegistry

from cedar.training.corpus.tasks import Task
from cedar.agents.function_calling import same_json
from cedar.agents.outcome import coding_test, outcome_ok
from cedar.agents.runs import AGENTS

W = 128
FC_COUNTS = ("tasks", "tasks_ok", "tasks_exact", "task_errors", "calls", "names_ok", "calls_ok", "calls_exact",
             "values", "values_ok")


def template_of(task: Task) -> str:
    """The task's template ("coding/off-by-one", ...); its kind where tasks carry none."""
    return getattr(task, "template", None) or task.kind


@dataclass
class Outcome:
    """One task's run, judged."""

    index: int
    kind: str
    template: str
    ok: bool
    result: dict  # the agent's result ({"error": ...} when the run failed)
    error: str | None = None


def recall_distance(text: str, value: str, tokenizer) -> int:
    """Tokens from the end of the value's first appearance to the end of the session."""
    at = text.find(value)
    return len(tokenizer.encode(text[at + len(value):]).ids) if at >= 0 else -1


def what_it_did(result: dict):
    """A failed run in brief: the session's answer, the scored calls, or the error."""
    if "session" in result:
        return result["session"].get("answer")
    if "scores" in result:
        return result["scores"]["per_task"]
    return result.get("error")


def run_one(backend, index: int, task: Task) -> Outcome:
    try:
        result = AGENTS[task.agent](backend, task.inputs)
        ok, error = outcome_ok(task, result), None
        if "scores" in result and result["scores"]["errors"]:
            error = "; ".join(e["reason"] for e in result["scores"]["errors"])[:300]
    except Exception as e:  # noqa: BLE001 - a failed run is a failed task, reported
        result, ok, error = {"error": repr(e)[:300]}, False, repr(e)[:300]
    return Outcome(index, task.kind, template_of(task), ok, result, error)


def _tally(outcomes: list[tuple[Task, Outcome]], key, tokenizer) -> dict:
    groups: dict[str, dict] = {}
    for task, o in outcomes:
        g = groups.setdefault(key(o), {"tasks": 0, "ok": 0, "errors": 0, "failures": [], "distances": []})
        g["tasks"] += 1
        g["ok"] += o.ok
        g["errors"] += o.error is not None
        if task.kind == "coding" and "files_after" in o.result:
            g["fixed_line_present"] = g.get("fixed_line_present", 0) + any(
                task.expect["fixed_line"] in text for text in o.result["files_after"].values())
            g["finished"] = g.get("finished", 0) + (o.result["session"]["answer"] is not None)
        if not o.ok and len(g["failures"]) < 3:
            fail = {"index": o.index, "expect": task.expect, "got": what_it_did(o.result)}
            if task.kind == "coding" and "files_after" in o.result:
                fail["test_output"] = coding_test(task, o.result["files_after"]).output[-300:]
            g["failures"].append(fail)
        if task.kind == "recall" and tokenizer is not None and "text" in o.result:
            d = recall_distance(o.result["text"], task.expect["answer"], tokenizer)
            g["distances"].append(d)
            if d > 4 * W:
                g["over_4W_tasks"] = g.get("over_4W_tasks", 0) + 1
                g["over_4W_ok"] = g.get("over_4W_ok", 0) + o.ok
    for g in groups.values():
        g["success"] = round(g["ok"] / g["tasks"], 4) if g["tasks"] else 0.0
        if g.get("over_4W_tasks"):
            g["over_4W_success"] = round(g["over_4W_ok"] / g["over_4W_tasks"], 4)
        d = [x for x in g.pop("distances") if x >= 0]
        if d:
            g["distance_tokens"] = {"min": min(d), "median": sorted(d)[len(d) // 2], "max": max(d),
                                    "share_over_4W": round(sum(x > 4 * W for x in d) / len(d), 4)}
    return groups


def function_calling_figures(outcomes: list[Outcome]) -> dict:
    """The function-calling runs' per-call and per-task counts summed, with their shares."""
    out = dict.fromkeys(FC_COUNTS, 0)
    for o in outcomes:
        if o.kind == "function-calling":
            sc = o.result.get("scores")
            if sc is None:  # the run failed before scoring: one task, in error
                out["tasks"] += 1
                out["task_errors"] += 1
                continue
            for k in FC_COUNTS:
                out[k] += sc[k]
            for kind, d in sc.get("values_by_kind", {}).items():
                mine = out.setdefault("values_by_kind", {}).setdefault(kind, {"values": 0, "ok": 0})
                mine["values"] += d["values"]
                mine["ok"] += d["ok"]
            for why, n in sc.get("values_missed", {}).items():
                missed = out.setdefault("values_missed", {})
                missed[why] = missed.get(why, 0) + n
    for name, num, den in (("name_accuracy", "names_ok", "calls"), ("call_accuracy", "calls_ok", "calls"),
                           ("exact_accuracy", "calls_exact", "calls"), ("value_accuracy", "values_ok", "values"),
                           ("task_accuracy", "tasks_ok", "tasks"), ("task_exact_accuracy", "tasks_exact", "tasks")):
        out[name] = round(out[num] / out[den], 4) if out[den] else 0.0
    return out


def evaluate_tasks(backend, tasks: list[Task], tokenizer=None, log=print) -> dict:
    """One split: per kind, per template, function calling per call, and the errors."""
    pairs = []
    for i, task in enumerate(tasks):
        pairs.append((task, run_one(backend, i, task)))
        if log and (i + 1) % 10 == 0:
            log(f"[evaluate] {i + 1}/{len(tasks)} tasks")
    return {"per_kind": _tally(pairs, lambda o: o.kind, tokenizer),
            "per_template": _tally(pairs, lambda o: o.template, None),
            "function_calling": function_calling_figures([o for _, o in pairs]),
            "errors": [{"index": o.index, "kind": o.kind, "template": o.template, "reason": o.error}
                       for _, o in pairs if o.error is not None]}


def run_tasks(backend, tasks: list[Task], tokenizer=None, log=print) -> dict:
    """Per kind: tasks, successes, success rate (recall tasks also carry their distances)."""
    return evaluate_tasks(backend, tasks, tokenizer, log)["per_kind"]


def stated_value_calls(backend, tasks: list[Task]) -> dict:
    """The function-calling tasks run again with every free argument value narrowed to the values
    the user's messages and the tool results state (`function_calling.run_tasks(stated_values=True)`),
    scored as the plain runs are: the summary's counts and shares, its errors, and every call that
    is not right (its task, expected and written call, and why each value missed)."""
    from cedar.agents.function_calling import run_tasks as run_fc_tasks

    summary = run_fc_tasks([t.inputs for t in tasks if t.agent == "function-calling"], backend, stated_values=True)
    wrong = [{"task": name, **c} for name, calls in summary.pop("per_task").items() for c in calls if not c["ok"]]
    return {**summary, "wrong_calls": wrong}


INVALID_REASONS = ("no call", "cut off", "unknown tool", "not JSON", "schema")


def invalid_reason(message: str) -> str:
    """Why `ToolRegistry.validate` refused a call, from its message: "unknown tool", "not JSON"
    or "schema" (the arguments are a JSON object the tool's schema refuses)."""
    if message.startswith("unknown tool"):
        return "unknown tool"
    if message.startswith("arguments are not JSON") or message.startswith("arguments must be"):
        return "not JSON"
    return "schema"


def _turn_calls(client, model: str, messages: list[dict], tools: list[dict], turn: dict, budget) -> tuple:
    """A calls-turn as a client runs it: ask; while the reply has tool calls and fewer than the
    turn expects have come, answer each with the result of the expected call at its position and
    ask again (at most one request per expected call). Returns (calls: the first len(expected)
    made, in order; requests; whether all came in the first reply; whether the turn stopped on
    a reply cut off by max_tokens with no calls parsed from it)."""
    expected, results = turn["expected"], turn.get("results") or []
    convo, got, requests, cut = list(messages), [], 0, False
    while len(got) < len(expected) and requests < len(expected):
        out = client.chat.completions.create(model=model, messages=convo, tools=tools, tool_choice="auto",
                                             temperature=0, max_tokens=budget(expected[len(got):]))
        requests += 1
        msg = out.choices[0].message
        new = list(msg.tool_calls or [])
        if not new:
            cut = out.choices[0].finish_reason == "length"
            break
        convo.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in new]})
        for c in new:
            k = len(got)
            got.append(c)
            convo.append({"role": "tool", "tool_call_id": c.id, "content": results[k] if k < len(results) else "ok"})
    return got[:len(expected)], requests, requests == 1 and len(got) >= len(expected), cut


def unconstrained_calls(base_url: str, model: str, tasks: list[Task]) -> dict:
    """Tool calls of free generation (`tool_choice: auto`) on the function-calling tasks' turns,
    earlier turns being the gold calls, results and answers. A turn runs as a client runs it
    (`_turn_calls`): a model that makes a turn's calls one request at a time, each after the
    previous one's result, is not short of calls. Per expected call: made or not, valid (parses
    and validates against its schema), right (valid, the expected name and values, in order);
    `valid_of_made` is the share of calls made that are valid; `invalid` says why each expected
    call is not valid (no call made, a reply cut off by max_tokens, unknown tool, arguments not
    JSON, refused by the schema)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    calls = made = valid = right = turns_ok = turns = one_reply = requests = 0
    examples, errors = [], []
    invalid = {reason: 0 for reason in INVALID_REASONS}
    for task in tasks:
        if task.agent != "function-calling":
            continue
        try:
            t = task.inputs
            registry = ToolRegistry.from_openai(t["tools"])
            tools = registry.openai_tools()
            messages = ([{"role": "system", "content": t["system"]}] if t.get("system") else [])

            def budget(pending: list[dict]) -> int:
                return sum(registry[c["name"]].max_tokens + 16 for c in pending)

            for turn in t["turns"]:
                messages.append({"role": "user", "content": turn["user"]})
                if not turn["expected"]:  # a turn answered without a tool: no call to check
                    messages.append({"role": "assistant", "content": turn.get("answer") or ""})
                    continue
                got, n, at_once, cut = _turn_calls(client, model, messages, tools, turn, budget)
                turns += 1
                requests += n
                one_reply += at_once
                made += len(got)
                ok_turn = len(got) == len(turn["expected"])
                for k, exp in enumerate(turn["expected"]):
                    calls += 1
                    g = got[k] if k < len(got) else None
                    try:
                        args = registry.validate(g.function.name, g.function.arguments) if g else None
                        valid += args is not None
                        if g is None:
                            invalid["cut off" if cut and k == len(got) else "no call"] += 1
                        hit = args is not None and g.function.name == exp["name"] and \
                            same_json(json.loads(g.function.arguments), exp["arguments"])
                    except ValueError as e:
                        invalid[invalid_reason(str(e))] += 1
                        hit = False
                    right += hit
                    ok_turn = ok_turn and hit
                    if not hit and len(examples) < 5:
                        examples.append({"expected": exp, "got": None if g is None else
                                         {"name": g.function.name, "arguments": g.function.arguments}})
                turns_ok += ok_turn
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{i}", "type": "function",
                     "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                    for i, c in enumerate(turn["expected"])]})
                for i, res in enumerate(turn.get("results") or ["ok"] * len(turn["expected"])):
                    messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": res})
                if turn.get("answer"):
                    messages.append({"role": "assistant", "content": turn["answer"]})
        except Exception as e:  # noqa: BLE001 - a task the server refused is an error for that task
            errors.append({"name": task.inputs.get("name"), "reason": repr(e)[:300]})
    share = (lambda a, b: round(a / b, 4) if b else 0.0)
    return {"calls": calls, "made": made, "valid": valid, "right": right, "valid_share": share(valid, calls),
            "valid_of_made": share(valid, made), "right_share": share(right, calls), "turns": turns,
            "turns_right": turns_ok, "turns_in_one_reply": one_reply, "requests": requests,
            "invalid": invalid, "errors": errors, "examples": examples}
