"""The OpenAI-API agent loop, as a client application runs one: `/v1/chat/completions` through the
`openai` client with a function-calling task's tools and `tool_choice: "auto"`, greedy. The tools
are sent as the task gives them (``tools_mode="free"``: nothing constrains the output), or marked
``strict`` (``"strict"``: the server constrains each call by its tool's schema), or marked strict
and narrowed before every request to the values the conversation states so far (``"stated"``:
`cedar.frontend.stated_values.narrow_tools`, a client's opt-in help; `cedar evaluate
--stated-values` reports it apart).

Per user turn of the task: send the conversation; while the reply has tool calls, answer each
with a `tool` message (the task's result for a call it expects, matched by name and values, each
expected call answered once; any other call gets an error result) and ask again; a reply
without tool calls is the turn's text answer. At most `max_requests` requests per turn: a turn
that reaches it without a text answer has **hit the limit**.

Scoring (`score_loop`, on the transcript alone): a loop **ends on its own** when every turn ends
with a text answer (not empty, and not call markup the parser left in the text) before the limit;
a task is **solved** when it ends on its own and in every turn the calls made are exactly the
expected ones (the same multiset: names and values, an argument the tool does not require may
be left out); **calls right** counts expected calls that were made. A turn that hits the limit
is counted as hit **after right calls** (every expected call was made right: the model kept
calling after its results) or **after errors** (some expected call never was: its attempts got
error results). A turn that ends with a text answer after results worth reporting (a JSON object
result: its values, the ``status`` field aside) **states its results** when the answer holds every
such value as a whole value (`reported_values`): an answer such as "Done." after
``{"status": "queued", "id": 4417}`` ends the loop without telling the user the id. Counted apart
from ``solved``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from cedar.backend.chat_template import TOOL_CALL_BEGIN
from cedar.frontend.stated_values import narrow_tools
from cedar.frontend.tools import ToolRegistry

from .function_calling import arguments_match, parse_arguments, required_arguments, whole_value

MAX_REQUESTS = 6
TOOLS_MODES = ("free", "strict", "stated")
ERROR_RESULT = "error: this call failed (unknown request); check the tool and its arguments"


@dataclass
class LoopTurn:
    """One user turn of a loop: what the model did, request by request."""

    user: str
    expected: list[dict]  # the task's expected calls for this turn
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments" (str as sent)} in order
    answer: str | None = None  # the text reply that ended the turn; None if it never came
    requests: int = 0
    hit_limit: bool = False
    results: list[str] = field(default_factory=list)  # the tool results it got for expected calls (no errors)


@dataclass(frozen=True)
class LoopScore:
    ended: bool  # every turn ended with a text answer before the limit
    hit_limit: bool  # some turn used all its requests without a text answer
    markup_answer: bool  # some "answer" was tool-call markup left unparsed
    solved: bool
    calls_expected: int
    calls_right: int  # expected calls made (name and values)
    calls_made: int
    # turns that hit the limit with every expected call made right (the model kept calling after
    # its results), and with some expected call never made right (its calls got error results)
    limit_after_right: int = 0
    limit_after_error: int = 0
    # turns that ended with a text answer after results worth reporting, and of them those whose
    # answer states every value of those results (see `reported_values`)
    answers_due: int = 0
    answers_stating: int = 0


def reported_values(result: str) -> list[str]:
    """What an answer must state to report a tool result: every leaf value of a JSON object result
    but its ``status`` field (numbers as JSON writes them, strings as they are); nothing for a
    result that is not a JSON object ("ok", plain text)."""
    try:
        obj = json.loads(result)
    except ValueError:
        return []
    if not isinstance(obj, dict):
        return []
    out: list[str] = []

    def walk(x) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif x is not None and not isinstance(x, bool):
            out.append(x if isinstance(x, str) else json.dumps(x))

    walk({k: v for k, v in obj.items() if k != "status"})
    return out


def states(answer: str, value: str) -> bool:
    """``value`` occurs in ``answer`` as a whole value (`whole_value`)."""
    return whole_value(value).search(answer) is not None


def _match(call: dict, expected: list[dict], used: list[bool], required: dict[str, frozenset]) -> int | None:
    """The index of the first unused expected call that `call` makes, or None."""
    args = parse_arguments(call["arguments"])  # None (not JSON) matches nothing
    for i, exp in enumerate(expected):
        if not used[i] and call["name"] == exp["name"] and \
                arguments_match(args, exp["arguments"], required.get(exp["name"]))[0]:
            return i
    return None


def is_text_answer(answer: str | None) -> bool:
    return bool(answer and answer.strip()) and TOOL_CALL_BEGIN not in answer


def score_loop(turns: list[LoopTurn], required: dict[str, frozenset] | None = None) -> LoopScore:
    """Score one loop's transcript (see the module doc)."""
    required = required or {}
    right = made = total = after_right = after_error = due = stating = 0
    exact_turns = True
    for t in turns:
        values = [v for r in t.results for v in reported_values(r)]
        if values and is_text_answer(t.answer):
            due += 1
            stating += all(states(t.answer, v) for v in values)
        used = [False] * len(t.expected)
        for c in t.calls:
            i = _match(c, t.expected, used, required)
            if i is not None:
                used[i] = True
        if t.hit_limit:
            after_right += all(used)
            after_error += not all(used)
        right += sum(used)
        made += len(t.calls)
        total += len(t.expected)
        exact_turns = exact_turns and all(used) and len(t.calls) == len(t.expected)
    hit = any(t.hit_limit for t in turns)
    markup = any(t.answer and TOOL_CALL_BEGIN in t.answer for t in turns)
    ended = bool(turns) and not hit and all(is_text_answer(t.answer) for t in turns)
    return LoopScore(ended, hit, markup, ended and exact_turns, total, right, made, after_right, after_error, due,
                     stating)


def check_tools_mode(tools_mode: str) -> None:
    if tools_mode not in TOOLS_MODES:
        raise ValueError(f"tools_mode must be one of {TOOLS_MODES}, got {tools_mode!r}")


def request_tools(tools: list[dict], messages: list[dict], tools_mode: str) -> list[dict]:
    """The ``tools`` a loop's next request sends in ``tools_mode`` (see the module doc)."""
    check_tools_mode(tools_mode)
    if tools_mode == "strict":
        return [{**t, "function": {**t["function"], "strict": True}} for t in tools]
    return narrow_tools(tools, messages) if tools_mode == "stated" else tools


def run_loop(client, model: str, task: dict, max_requests: int = MAX_REQUESTS,
             tools_mode: str = "free") -> list[LoopTurn]:
    """Run one function-calling task as an OpenAI-API loop; returns its transcript. tools_mode: how
    the tools are sent (one of ``TOOLS_MODES``, see the module doc)."""
    registry = ToolRegistry.from_openai(task["tools"])
    required = required_arguments(task["tools"])
    tools = registry.openai_tools()
    budget = 2 * max(t.max_tokens for t in registry.tools.values()) + 64
    messages = [{"role": "system", "content": task["system"]}] if task.get("system") else []
    out = []
    for turn in task["turns"]:
        t = LoopTurn(turn["user"], turn["expected"])
        results = list(turn.get("results") or [])
        used = [False] * len(turn["expected"])
        messages.append({"role": "user", "content": turn["user"]})
        while t.requests < max_requests:
            reply = client.chat.completions.create(model=model, messages=messages,
                                                   tools=request_tools(tools, messages, tools_mode), tool_choice="auto",
                                                   temperature=0, max_tokens=budget).choices[0].message
            t.requests += 1
            calls = reply.tool_calls or []
            if not calls:
                t.answer = reply.content or ""
                messages.append({"role": "assistant", "content": t.answer})
                break
            base = len(t.calls)
            messages.append({"role": "assistant", "content": reply.content, "tool_calls": [
                {"id": f"call_{base + k}", "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for k, c in enumerate(calls)]})
            for k, c in enumerate(calls):
                call = {"name": c.function.name, "arguments": c.function.arguments}
                t.calls.append(call)
                i = _match(call, turn["expected"], used, required)
                if i is not None:
                    used[i] = True
                content = (results[i] if i < len(results) else "ok") if i is not None else ERROR_RESULT
                if i is not None:
                    t.results.append(content)
                messages.append({"role": "tool", "tool_call_id": f"call_{base + k}", "content": content})
        else:
            t.hit_limit = True
            messages.append({"role": "assistant", "content": ""})
        out.append(t)
    return out


def pick_examples(transcripts: list[dict], examples: int) -> list[dict]:
    """The transcripts to keep, in task order: the first solved, the first ended unsolved and the
    first that hit the limit (each kind that occurs), then the earliest others, `examples` at most."""
    kinds = (lambda s: s["solved"], lambda s: s["ended"] and not s["solved"], lambda s: s["hit_limit"])
    firsts = [next((i for i, t in enumerate(transcripts) if kind(t["score"])), None) for kind in kinds]
    keep = list(dict.fromkeys(i for i in firsts if i is not None))[:examples]
    keep += [i for i in range(len(transcripts)) if i not in keep][: examples - len(keep)]
    return [transcripts[i] for i in sorted(keep)]


def run_loops(base_url: str, model: str, tasks: list[dict], max_requests: int = MAX_REQUESTS,
              examples: int = 3, tools_mode: str = "free") -> dict:
    """Every task as a loop: how many end on their own, hit the limit, are solved; calls right;
    `examples` transcripts (:func:`pick_examples`). A task whose requests fail is an error.
    tools_mode: how the tools are sent (see the module doc)."""
    from openai import OpenAI

    check_tools_mode(tools_mode)  # NOTE: a bad mode is the caller's error, not one per task
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    scores, transcripts, errors = [], [], []
    for i, task in enumerate(tasks):
        try:
            turns = run_loop(client, model, task, max_requests, tools_mode)
        except Exception as e:  # noqa: BLE001 - a loop the server refused is an error for that task
            errors.append({"index": i, "name": task.get("name"), "reason": repr(e)[:300]})
            continue
        sc = score_loop(turns, required_arguments(task["tools"]))
        scores.append(sc)
        transcripts.append({"task": task.get("name"), "score": asdict(sc), "turns": [asdict(t) for t in turns]})
    shown = pick_examples(transcripts, examples)
    n = len(scores) + len(errors)
    return {"tools_mode": tools_mode, "loops": n, "ended": sum(s.ended for s in scores),
            "hit_limit": sum(s.hit_limit for s in scores),
            "markup_answers": sum(s.markup_answer for s in scores), "solved": sum(s.solved for s in scores),
            "calls_expected": sum(s.calls_expected for s in scores), "calls_right": sum(s.calls_right for s in scores),
            "calls_made": sum(s.calls_made for s in scores), "max_requests_per_turn": max_requests,
            "turns_at_limit_after_right_calls": sum(s.limit_after_right for s in scores),
            "turns_at_limit_after_errors": sum(s.limit_after_error for s in scores),
            "answers_after_results": sum(s.answers_due for s in scores),
            "answers_stating_results": sum(s.answers_stating for s in scores),
            "ended_share": round(sum(s.ended for s in scores) / n, 4) if n else 0.0,
            "solved_share": round(sum(s.solved for s in scores) / n, 4) if n else 0.0,
            "errors": errors, "examples": shown}
