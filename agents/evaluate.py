"""`cedar evaluate`: the shipped model on the held-out generated tasks, through a real server,
greedy.

- **task success per agent**: each held-out task runs through its agent program (constrained
  calls, as the agents always call) and is scored by `corpus.build.outcome_ok`;
- **long-range recall**: the `recall` tasks (a value from the first tool result, asked for after
  the notes), with the token distance between the value and the final call;
- **tool-call validity without constraints**: every turn of the held-out function-calling tasks
  through the OpenAI API with `tool_choice: "auto"` (nothing constrains the output; earlier turns
  are the gold calls and results): a call is valid when SGLang's `hermes` parser returns it and its
  arguments validate against the tool's schema; right when it equals the expected call.
"""

from __future__ import annotations

import json

from cedar.frontend.tools import ToolRegistry

from .corpus.build import outcome_ok
from .corpus.tasks import Task
from .function_calling import same_json
from .runs import AGENTS

W = 128


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


def run_tasks(backend, tasks: list[Task], tokenizer=None, log=print) -> dict:
    """Per kind: tasks, successes, success rate; recall tasks also carry their distances."""
    per_kind: dict[str, dict] = {}
    for i, task in enumerate(tasks):
        try:
            result = AGENTS[task.agent](backend, task.inputs)
            ok = outcome_ok(task, result)
        except Exception as e:  # noqa: BLE001 - a failed run is a failed task, reported
            result, ok = {"error": repr(e)[:200]}, False
        k = per_kind.setdefault(task.kind, {"tasks": 0, "ok": 0, "failures": [], "distances": []})
        k["tasks"] += 1
        k["ok"] += ok
        if not ok and len(k["failures"]) < 3:
            k["failures"].append({"expect": task.expect, "got": what_it_did(result)})
        if task.kind == "recall" and tokenizer is not None and "text" in result:
            d = recall_distance(result["text"], task.expect["answer"], tokenizer)
            k["distances"].append(d)
            if d > 4 * W:
                k["over_4W_tasks"] = k.get("over_4W_tasks", 0) + 1
                k["over_4W_ok"] = k.get("over_4W_ok", 0) + ok
        if log and (i + 1) % 20 == 0:
            log(f"[evaluate] {i + 1}/{len(tasks)} tasks")
    for k in per_kind.values():
        k["success"] = round(k["ok"] / k["tasks"], 4) if k["tasks"] else 0.0
        if k.get("over_4W_tasks"):
            k["over_4W_success"] = round(k["over_4W_ok"] / k["over_4W_tasks"], 4)
        d = [x for x in k.pop("distances") if x >= 0]
        if d:
            k["distance_tokens"] = {"min": min(d), "median": sorted(d)[len(d) // 2], "max": max(d),
                                    "share_over_4W": round(sum(x > 4 * W for x in d) / len(d), 4)}
    return per_kind


def unconstrained_calls(base_url: str, model: str, tasks: list[Task]) -> dict:
    """Tool-call validity of free generation (`tool_choice: auto`) on function-calling tasks."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    calls = valid = right = turns_ok = turns = 0
    examples = []
    for task in tasks:
        if task.agent != "function-calling":
            continue
        t = task.inputs
        registry = ToolRegistry.from_openai(t["tools"])
        tools = registry.openai_tools()
        messages = ([{"role": "system", "content": t["system"]}] if t.get("system") else [])
        for turn in t["turns"]:
            messages.append({"role": "user", "content": turn["user"]})
            budget = sum(registry[c["name"]].max_tokens + 16 for c in turn["expected"])
            out = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="auto",
                                                 temperature=0, max_tokens=budget)
            got = out.choices[0].message.tool_calls or []
            turns += 1
            ok_turn = len(got) == len(turn["expected"])
            for k, exp in enumerate(turn["expected"]):
                calls += 1
                g = got[k] if k < len(got) else None
                try:
                    args = registry.validate(g.function.name, g.function.arguments) if g else None
                    valid += args is not None
                    hit = args is not None and g.function.name == exp["name"] and \
                        same_json(json.loads(g.function.arguments), exp["arguments"])
                except ValueError:
                    hit = False
                right += hit
                ok_turn = ok_turn and hit
                if not hit and len(examples) < 5:
                    examples.append({"expected": exp, "got": None if g is None else
                                     {"name": g.function.name, "arguments": g.function.arguments},
                                     "content": out.choices[0].message.content})
            turns_ok += ok_turn
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for i, c in enumerate(turn["expected"])]})
            for i, res in enumerate(turn.get("results") or ["ok"] * len(turn["expected"])):
                messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": res})
    return {"calls": calls, "valid": valid, "right": right, "valid_share": round(valid / calls, 4) if calls else 0.0,
            "right_share": round(right / calls, 4) if calls else 0.0, "turns": turns, "turns_right": turns_ok,
            "examples": examples}
