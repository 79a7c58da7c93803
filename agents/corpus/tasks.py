"""Generated agent tasks, each with the script of a policy that knows the answer.

Every generator takes a `random.Random` and returns a `Task`: the agent's name (as in
`cedar.agents.runs.AGENTS`), its inputs (what `cedar agent run NAME --task FILE` reads), the
script for `ScriptedBackend`, and what a correct run ends with (`expect`). The same task run on a
trained model through the real server is scored against `expect`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

SYLLABLES = ("ka", "lo", "mi", "ren", "sa", "tor", "vel", "zu", "dra", "fen", "gal", "hor", "is", "jun",
             "kel", "mor", "nas", "ol", "pra", "quin", "rus", "sel", "tam", "ur", "vos", "wen", "yar", "zel")
WORDS = ("amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
         "umber", "violet", "willow", "xenon", "yonder", "zephyr")
RELATIONS = ("capital", "river", "mayor", "largest lake", "oldest bridge", "main port", "twin city")
NUMERIC = ("population", "area in km2", "height in m", "founding year")


@dataclass
class Task:
    agent: str  # react | coding | parallel | subagents | function-calling
    kind: str  # the generator: react, recall, coding, parallel, subagents, function-calling
    inputs: dict
    script: dict = field(default_factory=dict)  # (first user message, branch) -> answers
    expect: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"agent": self.agent, "kind": self.kind, "inputs": self.inputs, "expect": self.expect}


def name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def code(rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randrange(10)}-{rng.randrange(1000, 10000)}"
    if style == 1:
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(10, 100)}"
    return str(rng.randrange(10000, 1000000))


def call(name_: str, args: dict) -> list[str]:
    """The answers of one unforced call: the name gen, then the arguments gen."""
    return [name_, json.dumps(args)]


def thought(text: str) -> str:
    """A thought gen's answer: at most 60 characters without '<', ended by its newline."""
    text = text.replace("<", "").replace("\n", " ")
    return (text[:60].rstrip() or "next step") + "\n"


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(WORDS, 2)
    return (f"The {a} {rng.choice(('team', 'station', 'archive', 'garden', 'office'))} "
            f"{rng.choice(('moved', 'checked', 'logged', 'sorted', 'stored'))} {rng.randrange(2, 99)} "
            f"{rng.choice(('crates', 'reports', 'samples', 'files', 'boxes'))} near the {b} "
            f"{rng.choice(('gate', 'hall', 'dock', 'tower', 'yard'))}.")


# ---------------------------------------------------------------------------------------------
# ReAct over generated facts
# ---------------------------------------------------------------------------------------------

def react_task(rng: random.Random) -> Task:
    facts: dict[str, str] = {}
    places = [name(rng) for _ in range(6)]
    for p in places:
        for rel in rng.sample(RELATIONS, 3):
            facts[f"{rel} of {p}"] = name(rng)
        for num in rng.sample(NUMERIC, 2):
            facts[f"{num} of {p}"] = str(rng.randrange(100, 99999))
    steps: list[tuple[str, str, dict, str]] = []  # thought, tool, args, result
    form = rng.randrange(4)
    x = rng.choice(places)
    rels = [k.split(" of ")[0] for k in facts if k.endswith(f" of {x}") and not k.split(" of ")[0] in NUMERIC]
    if form == 0:  # one hop
        rel = rng.choice(rels)
        question = f"What is the {rel} of {x}?"
        key = f"{rel} of {x}"
        steps.append((f"I need the {rel} of {x}.", "lookup", {"key": key}, facts[key]))
        answer = facts[key]
    elif form == 1:  # two hops
        rel = rng.choice(rels)
        y = facts[f"{rel} of {x}"]
        rel2 = rng.choice(RELATIONS)
        facts[f"{rel2} of {y}"] = name(rng)
        question = f"What is the {rel2} of the {rel} of {x}?"
        steps.append((f"First find the {rel} of {x}.", "lookup", {"key": f"{rel} of {x}"}, y))
        steps.append((f"Now the {rel2} of {y}.", "lookup", {"key": f"{rel2} of {y}"}, facts[f"{rel2} of {y}"]))
        answer = facts[f"{rel2} of {y}"]
    else:  # arithmetic over two numbers
        a, b = rng.sample(places, 2)
        num = rng.choice([n for n in NUMERIC if f"{n} of {a}" in facts and f"{n} of {b}" in facts] or [None])
        if num is None:
            num = NUMERIC[0]
            facts[f"{num} of {a}"], facts[f"{num} of {b}"] = str(rng.randrange(100, 9999)), str(rng.randrange(100, 9999))
        op, word = rng.choice((("+", "plus"), ("-", "minus")))
        question = f"What is the {num} of {a} {word} the {num} of {b}?"
        va, vb = facts[f"{num} of {a}"], facts[f"{num} of {b}"]
        steps.append((f"Look up the {num} of {a}.", "lookup", {"key": f"{num} of {a}"}, va))
        steps.append((f"Now the {num} of {b}.", "lookup", {"key": f"{num} of {b}"}, vb))
        expr = f"{va} {op} {vb}"
        result = str(eval(expr))  # noqa: S307 - two generated integers
        steps.append((f"Compute {expr}.", "calculate", {"expression": expr}, result))
        answer = result
    if rng.random() < 0.15 and form != 0:  # a wrong key first, then the hint's fix
        t, tool, args, res = steps[0]
        bad = args["key"].capitalize()
        steps.insert(0, (t, tool, {"key": bad}, ""))
        steps[1] = ("Use the key the tool suggested.", tool, args, res)
    return _react(question, facts, steps, answer, "react")


def recall_task(rng: random.Random, notes: int | None = None) -> Task:
    """A value from the first tool result, needed after many long results (> 4W tokens later)."""
    notes = notes or rng.randrange(5, 9)
    what = rng.choice(("vault code", "access key", "ticket number", "batch id", "door code", "badge id"))
    value = code(rng)
    facts = {what: value}
    for i in range(1, notes + 1):
        facts[f"note {i}"] = " ".join(sentence(rng) for _ in range(rng.randrange(4, 7)))
    question = f"Look up the {what}, then read notes 1 to {notes}, then answer with the {what}."
    steps = [(f"First the {what}.", "lookup", {"key": what}, value)]
    steps += [(f"Read note {i}.", "lookup", {"key": f"note {i}"}, facts[f"note {i}"]) for i in range(1, notes + 1)]
    task = _react(question, facts, steps, value, "recall")
    task.inputs["max_steps"] = notes + 3
    return task


def _react(question: str, facts: dict, steps: list, answer: str, kind: str) -> Task:
    answers: list[str] = []
    for t, tool, args, _ in steps:
        answers += [thought(t), *call(tool, args)]
    answers += [thought(f"The answer is {answer}."), *call("finish", {"answer": answer})]
    items = list(facts.items())
    return Task("react", kind, {"question": question, "facts": dict(items), "max_steps": len(steps) + 2},
                {(question, None): answers}, {"answer": answer})


# ---------------------------------------------------------------------------------------------
# The coding agent: a generated module with one bug, its test, a README
# ---------------------------------------------------------------------------------------------

# (function, params, correct line, buggy line, call args -> expected value)
BUGS = (
    ("add", "a, b", "return a + b", "return a - b", lambda r: (r.randrange(2, 50), r.randrange(2, 50)), lambda a, b: a + b),
    ("mul", "a, b", "return a * b", "return a + b", lambda r: (r.randrange(3, 12), r.randrange(3, 12)), lambda a, b: a * b),
    ("area", "w, h", "return w * h", "return w + h", lambda r: (r.randrange(3, 20), r.randrange(3, 20)), lambda a, b: a * b),
    ("double", "x", "return 2 * x", "return 3 * x", lambda r: (r.randrange(2, 40),), lambda a: 2 * a),
    ("is_even", "n", "return n % 2 == 0", "return n % 2 == 1", lambda r: (2 * r.randrange(1, 40),), lambda a: True),
    ("is_adult", "age", "return age >= 18", "return age > 18", lambda r: (18,), lambda a: True),
    ("last", "items", "return items[-1]", "return items[0]", lambda r: ([r.randrange(1, 9) for _ in range(3)],), lambda a: a[-1]),
    ("count_to", "n", "return list(range(1, n + 1))", "return list(range(1, n))", lambda r: (r.randrange(2, 6),),
     lambda a: list(range(1, a + 1))),
    ("diff", "a, b", "return a - b", "return b - a", lambda r: (r.randrange(30, 60), r.randrange(2, 29)), lambda a, b: a - b),
    ("half", "x", "return x // 2", "return x // 3", lambda r: (2 * r.randrange(5, 40),), lambda a: a // 2),
)
MODULES = ("calc", "mathx", "util", "shapes", "numbers", "helpers", "tools", "core")
HELPERS = ("def square(x):\n    return x * x\n", "def neg(x):\n    return -x\n", "def ident(x):\n    return x\n",
           "def inc(x):\n    return x + 1\n", "def is_zero(x):\n    return x == 0\n")


def coding_task(rng: random.Random, layout: str | None = None) -> Task:
    func, params, good, bad, gen_args, expected = rng.choice(BUGS)
    module = rng.choice(MODULES)
    mod_file, test_file = f"{module}.py", f"test_{module}.py"
    args = gen_args(rng)
    want = expected(*args)
    call_text = f"{func}({', '.join(map(repr, args))})"
    helpers = rng.sample(HELPERS, rng.randrange(0, 3))
    body = [f"def {func}({params}):\n    {bad}\n", *helpers]
    rng.shuffle(body)
    files = {
        mod_file: "\n\n".join(body),
        test_file: f"from {module} import {func}\nassert {call_text} == {want!r}, {call_text}\nprint('ok')\n",
        "README.md": f"{rng.choice(('A tiny', 'A small', 'Some'))} {module} helpers.\n",
    }
    instruction = f"The test in {test_file} fails. Fix {mod_file} so that {call_text} == {want!r}."
    layout = layout or rng.choices(("full", "plain", "fork"), (0.7, 0.15, 0.15))[0]
    hints = ["list the files", f"read {mod_file}"] if layout in ("full", "fork") else []
    delegate_at = 2 if layout == "full" else None
    script: dict = {}
    main: list[str] = []
    turn = 0
    if hints:
        script[(instruction, 0)] = call("list_dir", {"path": "."})
        script[(instruction, 1)] = call("read_file", {"path": mod_file})
        turn = 1
    else:
        main += [thought(f"Read {mod_file} first."), *call("read_file", {"path": mod_file})]
        turn = 1
    main += [thought(f"Read the test {test_file}."), *call("read_file", {"path": test_file})]
    turn += 1
    if delegate_at is not None:
        task_text = f"find where {func} is defined"
        main += [thought(f"Ask a subagent where {func} is."), json.dumps({"task": task_text})]
        line = files[mod_file].splitlines().index(f"def {func}({params}):") + 1
        script[(task_text, None)] = [thought(f"grep for def {func}."), *call("grep", {"pattern": f"def {func}", "path": "."}),
                                     thought("Report the file and line."),
                                     *call("finish", {"answer": f"{mod_file} line {line}"})]
    main += [thought(f"{func} should {good}."), *call("edit_file", {"path": mod_file, "old": bad, "new": good})]
    main += [thought("Run the test."), *call("run_python", {"code": f"exec(open('{test_file}').read())"})]
    main += [thought("The test passes."), *call("finish", {"answer": f"fixed {func} in {mod_file}"})]
    script[(instruction, None)] = main
    inputs = {"instruction": instruction, "files": files, "parallel_hints": hints, "delegate_at": delegate_at,
              "max_turns": 8}
    return Task("coding", "coding", inputs, script, {"test": test_file, "fixed_line": good})


# ---------------------------------------------------------------------------------------------
# Parallel calls (fork) and subagents, over generated facts
# ---------------------------------------------------------------------------------------------

def parallel_task(rng: random.Random) -> Task:
    places = [name(rng) for _ in range(rng.randrange(2, 4))]
    rel = rng.choice(RELATIONS)
    facts = {f"{rel} of {p}": name(rng) for p in places}
    for p in places:
        facts[f"{rng.choice(NUMERIC)} of {p}"] = str(rng.randrange(100, 9999))
    question = f"What is the {rel} of each of {', '.join(places)}?"
    hints = [f"look up the {rel} of {p}" for p in places]
    answer = ", ".join(facts[f"{rel} of {p}"] for p in places)[:40]
    script = {(question, i): call("lookup", {"key": f"{rel} of {p}"}) for i, p in enumerate(places)}
    script[(question, None)] = [thought("I have every value."), json.dumps({"answer": answer})]
    return Task("parallel", "parallel", {"question": question, "facts": facts, "hints": hints}, script,
                {"answer": answer})


def subagents_task(rng: random.Random) -> Task:
    places = [name(rng) for _ in range(2)]
    rels = rng.sample(RELATIONS, 2)
    facts = {f"{r} of {p}": name(rng) for r, p in zip(rels, places)}
    subtasks = [f"find the {r} of {p}" for r, p in zip(rels, places)]
    goal = f"Find the {rels[0]} of {places[0]} and the {rels[1]} of {places[1]}."
    answers = [facts[f"{r} of {p}"] for r, p in zip(rels, places)]
    script = {}
    for sub, r, p, a in zip(subtasks, rels, places, answers):
        script[(sub, None)] = [thought(f"Look up the {r} of {p}."), *call("lookup", {"key": f"{r} of {p}"}),
                               thought(f"It is {a}."), *call("finish", {"answer": a})]
    answer = f"{answers[0]} and {answers[1]}"
    script[(goal, None)] = [thought("Combine the subagents' answers."), json.dumps({"answer": answer})]
    return Task("subagents", "subagents", {"goal": goal, "facts": facts, "subtasks": subtasks}, script,
                {"answer": answer})


# ---------------------------------------------------------------------------------------------
# Function calling from generated schemas
# ---------------------------------------------------------------------------------------------

def _s(n=16):
    return {"type": "string", "maxLength": n}


def _i(lo, hi):
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _e(*values):
    return {"type": "string", "enum": list(values)}


CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Delhi", "Rome", "Seoul", "Accra", "Perth", "Bern")
# name, description, properties, phrasings (format with the arguments), argument sampler
TOOLS = (
    ("get_weather", "Current weather in a city.", {"city": _s(), "unit": _e("celsius", "fahrenheit")},
     ("What is the weather in {city}, in {unit}?", "Weather for {city} please, {unit}."),
     lambda r: {"city": r.choice(CITIES), "unit": r.choice(("celsius", "fahrenheit"))}),
    ("get_time", "Local time in a city.", {"city": _s()}, ("What time is it in {city}?", "Tell me the time in {city}."),
     lambda r: {"city": r.choice(CITIES)}),
    ("add", "Add two integers.", {"a": _i(-1000, 1000), "b": _i(-1000, 1000)}, ("What is {a} plus {b}?", "Add {a} and {b}."),
     lambda r: {"a": r.randrange(-999, 1000), "b": r.randrange(-999, 1000)}),
    ("to_hex", "Write an integer in hexadecimal.", {"n": _i(0, 100000)}, ("Write {n} in hexadecimal.", "What is {n} in hex?"),
     lambda r: {"n": r.randrange(0, 100000)}),
    ("convert_currency", "Convert an amount between currencies.",
     {"amount": _i(1, 100000), "source": _e("USD", "EUR", "JPY", "GBP"), "target": _e("USD", "EUR", "JPY", "GBP")},
     ("Convert {amount} {source} to {target}.", "How much is {amount} {source} in {target}?"),
     lambda r: dict(zip(("amount", "source", "target"), (r.randrange(1, 5000), *r.sample(("USD", "EUR", "JPY", "GBP"), 2))))),
    ("search_web", "Search the web.", {"query": _s(32)}, ("Search the web for {query}.", "Look up {query} online."),
     lambda r: {"query": f"{r.choice(WORDS)} {r.choice(('recipes', 'news', 'prices', 'history', 'maps'))}"}),
    ("send_email", "Send an email.", {"to": _s(24), "subject": _s(32)},
     ("Send an email to {to} with the subject {subject}.", "Email {to}: subject {subject}."),
     lambda r: {"to": f"{name(r).lower()}@example.com", "subject": f"{r.choice(WORDS)} {r.choice(('plan', 'notes', 'update'))}"}),
    ("set_alarm", "Set an alarm.", {"hour": _i(0, 23), "minute": _i(0, 59)},
     ("Set an alarm for {hour}:{minute:02d}.", "Wake me at {hour}:{minute:02d}."),
     lambda r: {"hour": r.randrange(0, 24), "minute": r.randrange(0, 60)}),
    ("book_table", "Book a restaurant table.", {"restaurant": _s(24), "people": _i(1, 12)},
     ("Book a table for {people} at {restaurant}.", "Reserve {restaurant} for {people} people."),
     lambda r: {"restaurant": f"{name(r)} {r.choice(('Grill', 'Cafe', 'Bistro'))}", "people": r.randrange(1, 13)}),
    ("get_stock_price", "Latest price of a stock.", {"symbol": _s(6)},
     ("What is the stock price of {symbol}?", "Quote {symbol} for me."),
     lambda r: {"symbol": "".join(r.choice("ABCDEFGHIKLMNOPRSTUVXYZ") for _ in range(r.randrange(3, 5)))}),
    ("translate", "Translate a text.", {"text": _s(32), "target": _e("fr", "de", "es", "it")},
     ("Translate '{text}' into {target}.", "Say '{text}' in {target}."),
     lambda r: {"text": f"{r.choice(('good', 'warm', 'quiet'))} {r.choice(('morning', 'evening', 'night'))}",
                "target": r.choice(("fr", "de", "es", "it"))}),
    ("get_distance", "Distance between two cities in km.", {"origin": _s(), "destination": _s()},
     ("How far is it from {origin} to {destination}?", "Distance from {origin} to {destination}?"),
     lambda r: dict(zip(("origin", "destination"), r.sample(CITIES, 2)))),
    ("set_light", "Turn a light on at a brightness.", {"room": _e("kitchen", "bedroom", "office", "hall"), "level": _i(0, 100)},
     ("Set the {room} light to {level} percent.", "Dim the {room} light to {level}."),
     lambda r: {"room": r.choice(("kitchen", "bedroom", "office", "hall")), "level": r.randrange(0, 101)}),
    ("track_order", "Where an order is.", {"order_id": _i(1, 999999)},
     ("Where is my order {order_id}?", "Track order {order_id}."), lambda r: {"order_id": r.randrange(1, 1000000)}),
    ("play_song", "Play a song.", {"title": _s(24), "artist": _s(24)},
     ("Play {title} by {artist}.", "Put on {title} from {artist}."),
     lambda r: {"title": f"{r.choice(WORDS).capitalize()} {r.choice(('Road', 'Song', 'Sky'))}", "artist": name(r, 3)}),
)
RESULTS = ("ok", "done", "sunny, 21 C", "14:05", "success", "queued", "found 3 results", "confirmed")


def fc_task(rng: random.Random, index: int = 0) -> Task:
    chosen = rng.sample(TOOLS, rng.randrange(2, 5))
    tools = [{"type": "function", "function": {"name": n, "description": d,
                                                "parameters": {"type": "object", "properties": p, "required": list(p)}}}
             for n, d, p, _, _ in chosen]
    turns, answers = [], []
    for _ in range(rng.randrange(1, 4)):
        picks = rng.sample(chosen, 2) if len(chosen) > 1 and rng.random() < 0.2 else [rng.choice(chosen)]
        expected, texts = [], []
        for n, _, _, phrasings, sample in picks:
            args = sample(rng)
            texts.append(rng.choice(phrasings).format(**args))
            expected.append({"name": n, "arguments": args})
            answers += call(n, args)
        turns.append({"user": " Also: ".join(texts), "expected": expected,
                      "results": [rng.choice(RESULTS) for _ in picks]})
    system = rng.choice(("You are a helpful assistant with tools.", "Call the right tool with exact arguments.", None))
    task = {"name": f"fc-{index}", "tools": tools, "turns": turns}
    if system:
        task["system"] = system
    return Task("function-calling", "function-calling", task, {(turns[0]["user"], None): answers},
                {"calls": [c for t in turns for c in t["expected"]]})


GENERATORS = {"react": react_task, "recall": recall_task, "coding": coding_task, "parallel": parallel_task,
              "subagents": subagents_task, "function-calling": fc_task}
