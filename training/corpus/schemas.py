"""Function-calling tasks over generated tool schemas: random tool names and parameters (integer,
number, enum, string, array and nested-object types), values drawn uniformly from each schema's
range, paraphrased requests, several calls per turn, several turns, turns answered without a tool,
and a text answer once the results are in.

Two catalogues of schemas, built once from fixed seeds: `TRAIN_SCHEMAS` and `HELD_SCHEMAS`.
A schema's name and every parameter name and enum value in it are words on its split's side
(`common.held_word`), so no held-out tool name, parameter name (hence parameter-name set) or enum
value appears in a training task; request phrasings are cut by index (`common.side`).

A task (`cedar agent run function-calling --task FILE` format, see `agents/function_calling.py`),
each turn with one more key, ``answer``: the assistant's text after the turn's tool results (or,
when ``expected`` is empty, instead of any call) - what an OpenAI-API loop ends its turn with.

`loop_text(inputs)` renders a task as the chat template renders the OpenAI conversation (calls,
results, text answers); with ``answers=False`` it is, byte for byte, the text the constrained
function-calling program writes (the corpus build checks that on every task).

Training tasks (not held-out ones) also vary how a turn's loop runs, in a turn's ``loop`` key
(:func:`vary_loops`; the runners ignore it, `loop_text` renders it): a turn of several calls made
one call a request (each result before the next call), and a call whose first result is an
error: after a transient error the same call once more (its result, or a second error), after a
permanent one no retry; a call that stays failed ends the turn with a text answer that says so
(an agent loop stops rather than repeating a call). Error texts are the training side's own.
With a ``mistakes`` share (`cedar train --mistakes`), some turns instead make **a wrong call of
their own** (the right tool, one argument's value drawn anew), get an error for it and give up:
the turn ends with a text answer that says the call failed, never with the same call again. The
wrong call is context only (`loop_render` gives its span, which carries no loss): the model learns
to stop after its own mistake, not to make one. A later turn asking what came back answers with
the last tool message the loop showed (`last_result`: an error, when the call failed).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache

from cedar.agents.api_loop import reported_values
from cedar.backend.chat_template import system_text, tool_call_text
from cedar.frontend.chat import message_text
from cedar.frontend.tools import ToolRegistry

from .common import SYLLABLES, WORDS, Task, call, code, held_word, name, side

N_TRAIN_SCHEMAS, N_HELD_SCHEMAS = 400, 120
QUOTE_SHARE = 0.85  # share of string values a request writes in quotes (tokenized as in the call)
FC_VERBS = ("get", "set", "list", "find", "create", "update", "delete", "check", "count", "book", "send", "fetch",
            "convert", "schedule", "cancel", "track", "rate", "scan", "merge", "split", "sort", "filter", "move",
            "copy", "open", "close", "lock", "reserve", "estimate", "measure", "log", "tag", "rank", "ping", "sync",
            "archive", "restore", "assign", "query", "compute", "register", "resize", "refund", "notify", "price")
FC_NOUNS = ("ticket", "order", "invoice", "route", "sensor", "account", "playlist", "shipment", "forecast",
            "meeting", "parcel", "badge", "recipe", "ledger", "device", "report", "alarm", "budget", "voucher",
            "flight", "room", "lesson", "contract", "battery", "garden", "engine", "camera", "queue", "vault",
            "portal", "beacon", "crate", "library", "market", "museum", "orbit", "planet", "pump", "reactor",
            "satellite", "signal", "station", "tunnel", "turbine", "valve", "wallet", "warehouse", "window", "zone",
            "lamp", "drone", "cargo", "cluster", "dataset", "domain", "folder", "gateway", "job", "node", "table")
PARAMS = ("amount", "count", "limit", "city", "name", "label", "code", "level", "speed", "size", "width", "height",
          "depth", "weight", "price", "rate", "score", "priority", "region", "mode", "unit", "color", "channel",
          "target", "source", "owner", "title", "tag", "note", "user", "email", "phone", "zip", "street", "country",
          "language", "format", "quality", "volume", "duration", "delay", "timeout", "retries", "offset", "page",
          "year", "month", "day", "hour", "minute", "seat", "floor", "room_number", "temperature", "humidity",
          "pressure", "voltage", "angle", "radius", "ratio", "threshold", "discount", "quantity", "category",
          "status", "kind", "version", "branch", "currency", "locale", "theme", "batch", "items", "ids", "tags",
          "members", "filters", "options", "window_size", "max_results", "start_year", "end_day", "group_id",
          "fleet", "lane", "shelf", "ward", "sector", "grade", "layer", "tier", "slot")
ENUM_WORDS = (*WORDS, "fast", "slow", "low", "high", "north", "south", "east", "west", "daily", "weekly", "red",
              "green", "blue", "small", "large", "draft", "final", "public", "private", "metric", "imperial",
              "urgent", "normal", "basic", "premium", "alpha", "beta", "gamma", "solid", "liquid", "spring",
              "summer", "autumn", "winter", "morning", "evening")
KINDS = ("integer", "number", "enum", "string", "array", "object")
KIND_WEIGHTS = (0.26, 0.14, 0.2, 0.26, 0.08, 0.06)
STRING_STYLES = ("name", "code", "phrase", "email")

# request phrasings ({action}: "fetch the ledger", {tool}: the tool's name, {args}: the arguments)
FRAMES = ("Please {action} with {args}.", "Can you {action}? Use {args}.", "{Action}: {args}.",
          "I need you to {action}, {args}.", "Call {tool} with {args}.", "{Action} for me, {args}.",
          "Could you {action} using {args}?", "Go ahead and {action}; {args}.", "Run {tool}: {args}.",
          "I'd like you to {action} with {args}.", "Time to {action}. Parameters: {args}.",
          "With {args}, {action}.", "Use {tool} to {action}, {args}.", "{Action} now, {args}.",
          "Next, {action} ({args}).", "Kindly {action} given {args}.")
CONNECTORS = (" ", " = ", ": ", " of ", " set to ", " as ")
JOINS = (" ", " Also, ", " Then: ", " And ")
THANKS = (("Thanks, that is all.", "You're welcome."), ("Great, thank you!", "Glad to help."),
          ("Perfect, nothing else for now.", "Happy to help."), ("Thank you.", "Anytime."),
          ("That's everything, thanks.", "You're welcome, goodbye."), ("Nice, thanks a lot.", "My pleasure."),
          ("OK, we are done.", "Great, done."), ("Cheers!", "Cheers, glad it worked."))
WHICH = ("Which tool would you use to {action}?", "What tool can {action}?", "Is there a tool to {action}?",
         "Which function should I use to {action}?")
LAST = ("What did the last call return?", "What was the result?", "Remind me what came back.",
        "Repeat the last result.")
SYSTEMS = ("You are a helpful assistant with tools.", "Call the right tool with exact arguments.",
           "Use the tools to help the user. Answer in text when no tool is needed.", None)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS
    schema: dict
    required: bool
    style: str = ""  # strings: how values look (STRING_STYLES); arrays: "int" or "enum"


@dataclass(frozen=True)
class Schema:
    name: str
    verb: str
    noun: str
    params: tuple[Param, ...]

    def tool(self) -> dict:
        props = {p.name: p.schema for p in self.params}
        parameters = {"type": "object", "properties": props, "required": [p.name for p in self.params if p.required]}
        return {"type": "function", "function": {"name": self.name, "description": f"{self.verb.capitalize()} "
                                                 f"the {self.noun}.", "parameters": parameters}}


def _words(rng: random.Random, pool, heldout: bool, k: int) -> list[str]:
    """k distinct words of `pool` on the split's side."""
    mine = [w for w in pool if held_word(w) == heldout]
    return rng.sample(mine, k)


def _param(rng: random.Random, pname: str, heldout: bool, depth: int = 0, pick=None) -> Param:
    """A parameter named `pname`; `pick(pool, k)` gives an enum's values and an object's field
    names (default: k distinct words of `pool` on the split's side)."""
    pick = pick or (lambda pool, k: _words(rng, pool, heldout, k))
    kind = rng.choices(KINDS if depth == 0 else KINDS[:4], KIND_WEIGHTS if depth == 0 else KIND_WEIGHTS[:4])[0]
    required = depth > 0 or rng.random() < 0.8
    if kind == "integer":
        lo = rng.choice((0, 1, -50, -1000))
        hi = rng.choice((9, 100, 999, 9999, 99999, 999999))
        return Param(pname, kind, {"type": "integer", "minimum": lo, "maximum": hi}, required)
    if kind == "number":
        lo, hi = rng.choice((0, -100)), rng.choice((1, 10, 100, 1000, 10000))
        return Param(pname, kind, {"type": "number", "minimum": lo, "maximum": hi}, required)
    if kind == "enum":
        return Param(pname, kind, {"type": "string", "enum": pick(ENUM_WORDS, rng.randrange(2, 6))},
                     required)
    if kind == "string":
        return Param(pname, kind, {"type": "string", "maxLength": 32}, required, rng.choice(STRING_STYLES))
    if kind == "array":
        if rng.random() < 0.5:
            items = {"type": "integer", "minimum": 0, "maximum": rng.choice((99, 999, 9999))}
            style = "int"
        else:
            items = {"type": "string", "enum": pick(ENUM_WORDS, rng.randrange(3, 6))}
            style = "enum"
        return Param(pname, kind, {"type": "array", "items": items, "minItems": 1, "maxItems": 4}, required, style)
    subs = [_param(rng, s, heldout, depth + 1, pick) for s in pick(PARAMS, 2)]
    schema = {"type": "object", "properties": {s.name: s.schema for s in subs}, "required": [s.name for s in subs],
              "additionalProperties": False}
    return Param(pname, kind, schema, required, json.dumps([[s.name, s.kind, s.style] for s in subs]))


@lru_cache(maxsize=2)
def catalogue(heldout: bool) -> tuple[Schema, ...]:
    """The split's tool schemas: unique names, built from a fixed seed (the same every run)."""
    n = N_HELD_SCHEMAS if heldout else N_TRAIN_SCHEMAS
    rng = random.Random(f"schemas:{'heldout' if heldout else 'train'}")
    out: dict[str, Schema] = {}
    while len(out) < n:
        verb, noun = rng.choice(FC_VERBS), rng.choice(FC_NOUNS)
        tname = f"{verb}_{noun}"
        if tname in out or held_word(tname) != heldout:
            continue
        params = tuple(_param(rng, p, heldout) for p in _words(rng, PARAMS, heldout, rng.randrange(1, 5)))
        out[tname] = Schema(tname, verb, noun, _one_required(params))
    return tuple(out.values())


def _one_required(params: tuple[Param, ...]) -> tuple[Param, ...]:
    if any(p.required for p in params):
        return params
    return (Param(params[0].name, params[0].kind, params[0].schema, True, params[0].style), *params[1:])


# NOTE: no word of a catalogue's pools, so a fresh schema can never name a held-out tool, parameter or enum value
NONCE_AVOID = frozenset((*PARAMS, *ENUM_WORDS, *FC_NOUNS, *FC_VERBS))
TRAIN_PARAMS = tuple(p for p in PARAMS if not held_word(p))


def nonce_word(rng: random.Random, used: set[str], join: bool = False) -> str:
    """A made-up lowercase word for a fresh schema (2-3 syllables: "velmor", "zukaldra"; with
    ``join``, a third of them joined to a training-side parameter name: "torsa_size"), on the
    training side of `held_word`, in no catalogue pool, not in `used` (to which it is added)."""
    while True:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        if join and rng.random() < 1 / 3:
            w = f"{w}_{rng.choice(TRAIN_PARAMS)}" if rng.random() < 0.5 else f"{rng.choice(TRAIN_PARAMS)}_{w}"
        if w not in used and w not in NONCE_AVOID and not held_word(w):
            used.add(w)
            return w


def fresh_schema(rng: random.Random, used: set[str]) -> Schema:
    """A schema made for one training task: a catalogue verb, a made-up noun, made-up parameter
    names, enum values and object fields (`nonce_word`), each new to the model. A task over such
    tools can only be solved by reading which name the request gives which value, where the 400
    training schemas' 68 parameter names can also be learnt by heart (held-out integers were right
    19/44 times, in-template ones 44/65, drawn alike)."""
    pick = lambda pool, k: [nonce_word(rng, used, join=pool is PARAMS) for _ in range(k)]  # noqa: E731
    while True:
        verb, noun = rng.choice(FC_VERBS), nonce_word(rng, used)
        if not held_word(f"{verb}_{noun}"):
            break
    params = tuple(_param(rng, p, False, pick=pick) for p in pick(PARAMS, rng.randrange(1, 5)))
    return Schema(f"{verb}_{noun}", verb, noun, _one_required(params))


def _string(rng: random.Random, style: str) -> str:
    if style == "name":
        return name(rng, rng.randrange(2, 4))
    if style == "code":
        return code(rng)
    if style == "email":
        return f"{name(rng).lower()}@{rng.choice(WORDS)}.com"
    return " ".join(rng.sample(WORDS, rng.randrange(2, 4)))


def sample_value(rng: random.Random, p: Param):
    """A value for `p`, uniform over its range (integers, numbers to 2 decimals, enum members)."""
    s = p.schema
    if p.kind == "integer":
        return rng.randint(s["minimum"], s["maximum"])
    if p.kind == "number":
        return rng.randint(s["minimum"] * 100, s["maximum"] * 100) / 100
    if p.kind == "enum":
        return rng.choice(s["enum"])
    if p.kind == "string":
        return _string(rng, p.style)
    if p.kind == "array":
        k = rng.randint(1, s["maxItems"])
        if p.style == "int":
            return [rng.randint(s["items"]["minimum"], s["items"]["maximum"]) for _ in range(k)]
        return [rng.choice(s["items"]["enum"]) for _ in range(k)]
    subs = json.loads(p.style)
    return {n: sample_value(rng, Param(n, k, s["properties"][n], True, st)) for n, k, st in subs}


def value_text(rng: random.Random, value) -> str:
    """A value as a request states it: numbers and arrays as JSON (after a space, as in the call),
    strings in quotes most of the time (after a quote, as in the call), objects as their fields."""
    if isinstance(value, str):
        return f'"{value}"' if rng.random() < QUOTE_SHARE else value
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {value_text(rng, v)}" for k, v in value.items()) + ")"
    return json.dumps(value)


def leaves(value) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in leaves(v)]
    return [value]


def request(rng: random.Random, schema: Schema, args: dict, frames) -> str:
    parts = [f"{p.name if rng.random() < 0.5 else p.name.replace('_', ' ')}{rng.choice(CONNECTORS)}"
             f"{value_text(rng, args[p.name])}" for p in schema.params if p.name in args]
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    action = f"{schema.verb} the {schema.noun}"
    frame = rng.choice(frames)
    return frame.format(action=action, Action=action.capitalize(), tool=schema.name, args=joined)


def result_for(rng: random.Random) -> tuple[str, str]:
    """A tool result (JSON text) and the text answer that reports it."""
    form = rng.randrange(4)
    if form == 0:
        n = rng.randrange(1, 1000000)
        status = rng.choice(("ok", "queued", "done", "accepted"))
        return json.dumps({"status": status, "id": n}), f"Done, the id is {n}."
    if form == 1:
        x = rng.randint(-100000, 100000) / 100
        return json.dumps({"result": x}), f"The result is {json.dumps(x)}."
    if form == 2:
        w = name(rng)
        return json.dumps({"status": "ok", "ref": w}), f'Done, the reference is "{w}".'
    return "ok", "Done."


TRANSIENT_ERRORS = ("error: timeout after 30 s", "error: service busy, try again", "error: 503 temporarily unavailable",
                    "error: connection reset; retry the call")
PERMANENT_ERRORS = ("error: {tool} is disabled for this account", "error: permission denied for {tool}",
                    "error: daily quota of {tool} used up", "error: {tool} is not offered in this region",
                    "error: {tool} refused the request", "error: invalid arguments for {tool}",
                    "error: no such record", "error: the request could not be processed")
# NOTE: an error is followed by the text answer three times in four (a permanent error); a model
# that learns "after an error, call again" keeps calling until a loop's limit (the README's
# --fresh-schemas paragraph)
SEQUENTIAL_SHARE, FAILURE_SHARE, RETRY_SHARE, RETRY_OK_SHARE = 0.5, 0.3, 0.25, 0.75
# a wrong call of the model's own is answered by one of these ({param}: the argument drawn anew)
MISTAKE_ERRORS = ("error: invalid value for {param}", "error: {tool} found nothing for that {param}",
                  "error: bad request: {param} does not match any record", "error: {tool} rejected the arguments",
                  "error: unknown {param}", "error: the request to {tool} is not valid")


def vary_loops(rng: random.Random, turns: list[dict], reports: list[list[str]],
               schemas: dict[str, Schema] | None = None, mistakes: float = 0.0) -> None:
    """Give some of ``turns`` (each calls-turn with its calls' ``reports``) a ``loop``: one call a
    request (``sequential``, for turns of several calls) and/or a ``failure`` of one call
    (``{"call": k, "errors": [...], "retry": bool}``); a failure that stands rewrites the turn's
    answer (the calls reported that ran, then the failure). With ``mistakes`` (a share), a turn
    without a failure whose calls come one a request (or that has one call) may instead make a
    ``mistake`` (`mistake_for`, from the task's ``schemas`` by name): its answer reports the calls
    made before it, then that the call failed. Mutates ``turns``."""
    for turn, reps in zip(turns, reports):
        calls = turn["expected"]
        if not calls:
            continue
        loop = {}
        if len(calls) > 1 and rng.random() < SEQUENTIAL_SHARE:
            loop["sequential"] = True
        if rng.random() < FAILURE_SHARE:
            k = rng.randrange(len(calls))
            tool = calls[k]["name"]
            retry = rng.random() < RETRY_SHARE
            first = rng.choice(TRANSIENT_ERRORS if retry else PERMANENT_ERRORS).format(tool=tool)
            errors = [first] if not retry or rng.random() < RETRY_OK_SHARE else [first, rng.choice(TRANSIENT_ERRORS)]
            loop["failure"] = {"call": k, "errors": errors, "retry": retry}
            if stays_failed(loop["failure"]):  # the answer says so
                done = reps[:k] if loop.get("sequential") else reps[:k] + reps[k + 1:]
                turn["answer"] = failed_answer(done, tool, errors[-1])
        # NOTE: drawn only with a share, so a corpus without mistakes is what it was before them
        one_a_request = loop.get("sequential") or len(calls) == 1
        if mistakes and "failure" not in loop and one_a_request and rng.random() < mistakes:
            mistake = mistake_for(rng, calls, schemas or {})
            if mistake:
                loop["mistake"] = mistake
                tool = calls[mistake["call"]]["name"]
                turn["answer"] = failed_answer(reps[:mistake["call"]], tool, mistake["error"])
        if loop:
            turn["loop"] = loop


def failed_answer(done: list[str], tool: str, error: str) -> str:
    """The text that ends a turn whose call to ``tool`` failed: the reports of the calls ``done``,
    then the failure (``error`` without its ``"error: "`` head)."""
    return " ".join(done + [f"The call to {tool} failed ({error.removeprefix('error: ')})."])


def mistake_for(rng: random.Random, calls: list[dict], schemas: dict[str, Schema]) -> dict | None:
    """A wrong call made in place of call ``k`` and the error it gets: ``{"call": k, "wrong":
    {"name", "arguments"}, "error": str}``; the wrong call is call ``k`` with one argument's value
    drawn anew (None when no argument of it can be drawn another value)."""
    k = rng.randrange(len(calls))
    c = calls[k]
    schema = schemas.get(c["name"])
    params = [p for p in (schema.params if schema else ()) if p.name in c["arguments"]]
    if not params:
        return None
    p = rng.choice(params)
    for _ in range(20):
        wrong = sample_value(rng, p)
        if wrong != c["arguments"][p.name]:
            error = rng.choice(MISTAKE_ERRORS).format(tool=c["name"], param=p.name)
            return {"call": k, "wrong": {"name": c["name"], "arguments": {**c["arguments"], p.name: wrong}},
                    "error": error}
    return None


def stays_failed(failure: dict) -> bool:
    """Whether a turn's failed call is still failed when the turn ends: no retry, or a retry that
    got a second error."""
    return len(failure["errors"]) == 1 + failure["retry"]


def _turn_loop(turn: dict) -> tuple[str, list[tuple[int, int]]]:
    """A calls-turn after its user message as an OpenAI-API loop renders it (``loop`` applied):
    assistant messages of calls and their tool messages, up to the text answer (not included);
    and the (start, end) characters of a wrong call's assistant message in that text."""
    calls = [tool_call_text(c["name"], json.dumps(c["arguments"])) for c in turn["expected"]]
    results = turn.get("results") or []
    result = [results[k] if k < len(results) else "ok" for k in range(len(calls))]
    loop = turn.get("loop") or {}
    fail = loop.get("failure")
    k, retry_text, stays = -1, "", False
    if fail:  # call k's first result is an error; a retry makes the call again: its result, or a second error
        k, stays = fail["call"], stays_failed(fail)
        if fail["retry"]:
            again = fail["errors"][-1] if stays else result[k]
            retry_text = message_text("assistant", calls[k]) + message_text("tool", again)
        result[k] = fail["errors"][0]
    mistake = loop.get("mistake")
    if not loop.get("sequential") and not mistake:
        return (message_text("assistant", "".join(calls)) + "".join(message_text("tool", r) for r in result)
                + retry_text, [])
    text = ""
    for j, (c, r) in enumerate(zip(calls, result)):
        if mistake and j == mistake["call"]:  # the wrong call in place of this one, its error, and the turn ends
            w = mistake["wrong"]
            wrong = message_text("assistant", tool_call_text(w["name"], json.dumps(w["arguments"])))
            return text + wrong + message_text("tool", mistake["error"]), [(len(text), len(text) + len(wrong))]
        text += message_text("assistant", c) + message_text("tool", r) + (retry_text if j == k else "")
        if j == k and stays:  # NOTE: a call that stays failed ends the turn: no further call
            break
    return text, []


def last_result(turn: dict) -> str:
    """The last tool message a calls-turn's loop shows (an error, when its last call failed or a
    call that failed ended the turn)."""
    head, tail = message_text("tool", "\0").split("\0")
    text = _turn_loop(turn)[0]
    return text[text.rindex(head) + len(head):].split(tail)[0]


def fc_task(rng: random.Random, heldout: bool = False, index: int = 0, fresh: bool = False,
            mistakes: float = 0.0) -> Task:
    """A task over 2-5 schemas of the split's catalogue: 1-3 turns, each with 1-3 calls (or, after
    the first, a turn answered without a tool), a result per call and the text that ends it.
    ``fresh`` (training tasks only; `make_tasks` refuses it for another split): 1 to all of the
    tools are `fresh_schema`s instead. ``mistakes`` (training tasks only): `vary_loops`' share of
    turns that make a wrong call and give up."""
    tools = rng.sample(catalogue(heldout), rng.randrange(2, 6))
    if fresh:
        used: set[str] = set()
        for k in rng.sample(range(len(tools)), rng.randint(1, len(tools))):
            tools[k] = fresh_schema(rng, used)
    frames, which, last = side(FRAMES, heldout), side(WHICH, heldout), side(LAST, heldout)
    thanks = side(THANKS, heldout)
    turns, answers, values, turn_reports = [], [], [], []
    for t in range(rng.randrange(1, 4)):
        if t > 0 and rng.random() < 0.2:  # a turn answered without a tool
            form = rng.randrange(3)
            if form == 0:
                user, answer = rng.choice(thanks)
            elif form == 1:
                target = rng.choice(tools)
                user = rng.choice(which).format(action=f"{target.verb} the {target.noun}")
                answer = f"I would call `{target.name}`."
            else:
                user = rng.choice(last)
                answer = f"It returned {turns[-1]['results'][-1]}." if turns[-1]["results"] else "Nothing yet."
            turns.append({"user": user, "expected": [], "results": [], "answer": answer})
            turn_reports.append([])
            continue
        picks = [rng.choice(tools) for _ in range(rng.choices((1, 2, 3), (0.6, 0.3, 0.1))[0])]
        turn_reports.append(reports := [])
        expected, texts, results = [], [], []
        for schema in picks:
            args = {p.name: sample_value(rng, p) for p in schema.params if p.required or rng.random() < 0.5}
            texts.append(request(rng, schema, args, frames))
            expected.append({"name": schema.name, "arguments": args})
            answers += call(schema.name, args)
            values += [v if isinstance(v, str) else json.dumps(v) for v in leaves(args)]
            res, report = result_for(rng)
            values += reported_values(res)  # NOTE: the answer's copy of a result is trained as a call's value is
            results.append(res)
            reports.append(report)
        user = texts[0] + "".join(rng.choice(JOINS) + x for x in texts[1:])
        answer = reports[0] if len(reports) == 1 else f"All {len(reports)} calls are done. " + " ".join(reports)
        turns.append({"user": user, "expected": expected, "results": results, "answer": answer})
    system = rng.choice(SYSTEMS)
    split = "heldout" if heldout else "train"
    inputs = {"name": f"{split}-fc-{index}", "tools": [s.tool() for s in tools], "turns": turns}
    if system:
        inputs["system"] = system
    values += [s.name for s in tools]
    if not heldout:  # NOTE: from a stream drawn last, so every other field is what it was without it
        vary_loops(random.Random(rng.getrandbits(64)), turns, turn_reports, {s.name: s for s in tools}, mistakes)
        for before, turn in zip(turns, turns[1:]):  # NOTE: "what did it return?" answers what the loop showed last
            if not turn["expected"] and turn["user"] in LAST and before.get("loop"):
                turn["answer"] = f"It returned {last_result(before)}."
    first = turns[0]["expected"][0]["name"]
    return Task("function-calling", "function-calling", inputs, {(turns[0]["user"], None): answers},
                {"calls": [c for t in turns for c in t["expected"]]}, f"function-calling/schema:{first}",
                sorted(set(values)))


def loop_text(inputs: dict, answers: bool = True) -> str:
    """`loop_render`'s text."""
    return loop_render(inputs, answers)[0]


def loop_render(inputs: dict, answers: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """The task's conversation in the served markup: system (with the tools), then per turn the
    user message, one assistant message with the expected calls, one tool message per call
    (`results[k]` or "ok") and, with ``answers``, the turn's text answer (a message of its own
    after the results, or the assistant message itself when the turn has no calls). With
    ``answers`` a turn's ``loop`` (one call a request, a failed call, a wrong call) is rendered
    too; without, the text is the constrained program's, which knows no loop. Also returns the
    (start, end) characters of every wrong call's assistant message (no loss in training)."""
    registry = ToolRegistry.from_openai(inputs["tools"])
    text = message_text("system", system_text(inputs.get("system"), registry.openai_tools()))
    spans: list[tuple[int, int]] = []
    for turn in inputs["turns"]:
        text += message_text("user", turn["user"])
        final = turn.get("answer") if answers else None
        if not turn["expected"]:
            text += message_text("assistant", final or "")
            continue
        part, part_spans = _turn_loop(turn if answers else {k: v for k, v in turn.items() if k != "loop"})
        spans += [(len(text) + a, len(text) + b) for a, b in part_spans]
        text += part
        if final:
            text += message_text("assistant", final)
    return text, spans


def check_calls(inputs: dict) -> None:
    """Every expected call validates against its tool's schema (ValueError otherwise)."""
    registry = ToolRegistry.from_openai(inputs["tools"])
    for turn in inputs["turns"]:
        for c in turn["expected"]:
            registry.validate(c["name"], c["arguments"])
