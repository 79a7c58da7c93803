"""Generated agent tasks, each with the script of a policy that knows the answer.

Every generator takes a `random.Random`, whether it draws held-out templates, and the task's index,
and returns a `Task` (`common.py`): the agent's name (as in `cedar.agents.runs.AGENTS`), its inputs
(what `cedar agent run NAME --task FILE` reads), the script for `ScriptedBackend`, what a correct
run ends with (`expect`), the template it instantiates and the random values it states. The same
task run on a trained model through the real server is scored against `expect`
(`cedar.agents.outcome`).

Templates and what is held out (every 4th item of each pool, see `common.side`; generated names by
`common.held_word`):

- ``react``: forms one-hop, two-hop, arithmetic (trained) and compare (held out); question
  phrasings, relations, numeric attributes and entity names;
- ``recall``: the kind of value and the question phrasing;
- ``coding``: bug kinds (`bugs.BUG_KINDS`) and instruction phrasings;
- ``function-calling``: tool schemas and request phrasings (`schemas.py`);
- ``parallel``, ``subagents``: phrasings, relations and entity names.
"""

from __future__ import annotations

import json
import random

from .bugs import BUG_KINDS, make_bug
from .common import Task, call, code, name, sentence, side, thought
from .schemas import fc_task

__all__ = ["GENERATORS", "Task", "template_pools"]

RELATIONS = ("capital", "river", "mayor", "largest lake", "oldest bridge", "main port", "twin city",
             "highest peak", "founder", "main square", "old gate", "market town", "sister port", "chief judge",
             "archivist", "harbor master")
NUMERIC = ("population", "area in km2", "height in m", "founding year", "rainfall in mm", "number of schools",
           "elevation in m", "number of bridges")
FORMS = ("one-hop", "two-hop", "arithmetic", "compare")  # compare (the 4th) is held out
QUESTIONS = {
    "one-hop": ("What is the {rel} of {x}?", "Tell me the {rel} of {x}.", "Find the {rel} of {x}.",
                "I want to know the {rel} of {x}.", "Which is the {rel} of {x}?", "Give me the {rel} of {x}.",
                "Look up the {rel} of {x} for me.", "Do you know the {rel} of {x}?"),
    "two-hop": ("What is the {rel2} of the {rel} of {x}?", "Find the {rel2} of the {rel} of {x}.",
                "Tell me the {rel2} of the {rel} of {x}.", "I need the {rel2} of the {rel} of {x}.",
                "Give me the {rel2} of the {rel} of {x}.", "Which is the {rel2} of the {rel} of {x}?",
                "Look up the {rel2} of the {rel} of {x}.", "Do you know the {rel2} of the {rel} of {x}?"),
    "arithmetic": tuple(q.replace("{x}", "the {num} of {a} {word} the {num} of {b}") for q in (
        "What is {x}?", "Compute {x}.", "Tell me {x}.", "How much is {x}?", "Work out {x}.", "Give me {x}.",
        "Find {x}.", "What do you get for {x}?")),
    "compare": ("Which has the larger {num}, {a} or {b}?", "Of {a} and {b}, which has the larger {num}?",
                "Which is larger in {num}: {a} or {b}?", "Compare the {num} of {a} and {b}: which is larger?"),
}
RECALL_WHAT = ("vault code", "access key", "ticket number", "batch id", "door code", "badge id", "locker pin",
               "serial number")
RECALL_QUESTIONS = ("Look up the {what}, then read notes 1 to {n}, then answer with the {what}.",
                    "First get the {what}, then read notes 1 to {n}; answer with the {what}.",
                    "Read the {what} and notes 1 to {n}, then give me the {what}.",
                    "Fetch the {what}, go through notes 1 to {n}, and reply with the {what}.")
INSTRUCTIONS = ("The test in `{test}` fails. Fix `{mod}` so that `{call} == {want}`.",
                "Fix `{mod}`: the test `{test}` expects `{call} == {want}`.",
                "`{test}` fails. Make `{call} == {want}` hold by fixing `{mod}`.",
                "There is a bug in `{mod}`; `{test}` checks that `{call} == {want}`. Fix it.",
                "Repair `{mod}` so that the test in `{test}` passes (`{call} == {want}`).",
                "The check `{call} == {want}` in `{test}` fails. Fix the code in `{mod}`.",
                "Make `{test}` pass: `{call}` should be `{want}`; the code is in `{mod}`.",
                "`{call}` must equal `{want}` (see `{test}`). Fix `{mod}`.")
PARALLEL_QUESTIONS = ("What is the {rel} of each of {places}?", "Give me the {rel} of each of {places}.",
                      "Find the {rel} of every one of {places}.", "For each of {places}, what is the {rel}?")
SUBAGENT_GOALS = ("Find the {r0} of {p0} and the {r1} of {p1}.", "I need the {r0} of {p0} and the {r1} of {p1}.",
                  "Get the {r0} of {p0}, and the {r1} of {p1}.", "Look up both the {r0} of {p0} and the {r1} of {p1}.")
MODULES = ("calc", "mathx", "util", "shapes", "numbers", "helpers", "tools", "core", "metrics", "ledger", "grid",
           "stats")
HELPERS = ("def square(x):\n    return x * x\n", "def neg(x):\n    return -x\n", "def ident(x):\n    return x\n",
           "def inc(x):\n    return x + 1\n", "def is_zero(x):\n    return x == 0\n")


def _pick(rng: random.Random, pool, heldout: bool) -> tuple[int, str]:
    """(index in `pool`, item) of a random item on the split's side."""
    i = rng.choice([i for i, x in enumerate(pool) if x in side(pool, heldout)])
    return i, pool[i]


def _template(kind: str, family: str, index: int, heldout: bool, held_family: bool = False) -> str:
    """Training tasks are named by their family; held-out ones by what is held out in them."""
    if not heldout or held_family:
        return f"{kind}/{family}"
    return f"{kind}/phrasing:{family}.{index}"


# ---------------------------------------------------------------------------------------------
# ReAct over generated facts
# ---------------------------------------------------------------------------------------------

def react_task(rng: random.Random, heldout: bool = False, index: int = 0) -> Task:
    relations, numeric = side(RELATIONS, heldout), side(NUMERIC, heldout)
    facts: dict[str, str] = {}
    places = []
    while len(places) < 6:
        p = name(rng, heldout=heldout)
        places += [p] if p not in places else []
    for p in places:
        for rel in rng.sample(relations, 3):
            facts[f"{rel} of {p}"] = name(rng, heldout=heldout)
        for num in rng.sample(numeric, 2):
            facts[f"{num} of {p}"] = str(rng.randrange(100, 99999))
    steps: list[tuple[str, str, dict, str]] = []  # thought, tool, args, result
    form = rng.choice(FORMS if heldout else side(FORMS, False))
    k, phrasing = _pick(rng, QUESTIONS[form], heldout) if form != "compare" else \
        (rng.randrange(len(QUESTIONS[form])), None)
    phrasing = phrasing or QUESTIONS[form][k]
    x = rng.choice(places)
    rels = [r for r in relations if f"{r} of {x}" in facts]
    if form == "one-hop":
        rel = rng.choice(rels)
        question = phrasing.format(rel=rel, x=x)
        key = f"{rel} of {x}"
        steps.append((f"I need the {rel} of {x}.", "lookup", {"key": key}, facts[key]))
        answer = facts[key]
    elif form == "two-hop":
        rel = rng.choice(rels)
        y = facts[f"{rel} of {x}"]
        rel2 = rng.choice(relations)
        facts[f"{rel2} of {y}"] = name(rng, heldout=heldout)
        question = phrasing.format(rel=rel, rel2=rel2, x=x)
        steps.append((f"First find the {rel} of {x}.", "lookup", {"key": f"{rel} of {x}"}, y))
        steps.append((f"Now the {rel2} of {y}.", "lookup", {"key": f"{rel2} of {y}"}, facts[f"{rel2} of {y}"]))
        answer = facts[f"{rel2} of {y}"]
    else:  # two numbers: their sum / difference, or which is larger
        a, b = rng.sample(places, 2)
        num = rng.choice(numeric)
        for p in (a, b):
            facts.setdefault(f"{num} of {p}", str(rng.randrange(100, 99999)))
        va, vb = facts[f"{num} of {a}"], facts[f"{num} of {b}"]
        if va == vb:
            facts[f"{num} of {b}"] = vb = str(int(vb) + 1)
        steps.append((f"Look up the {num} of {a}.", "lookup", {"key": f"{num} of {a}"}, va))
        steps.append((f"Now the {num} of {b}.", "lookup", {"key": f"{num} of {b}"}, vb))
        if form == "arithmetic":
            op, word = rng.choice((("+", "plus"), ("-", "minus")))
            question = phrasing.format(num=num, a=a, b=b, word=word)
            expr = f"{va}{op}{vb}"  # NOTE: no spaces: each number tokenizes as in its tool result
            answer = str(eval(expr))  # noqa: S307 - two generated integers
            steps.append((f"Compute {expr}.", "calculate", {"expression": expr}, answer))
        else:
            question = phrasing.format(num=num, a=a, b=b)
            answer = a if int(va) > int(vb) else b
    if rng.random() < 0.15 and form != "one-hop":  # a wrong key first, then the hint's fix
        t, tool, args, res = steps[0]
        steps.insert(0, (t, tool, {"key": args["key"].capitalize()}, ""))
        steps[1] = ("Use the key the tool suggested.", tool, args, res)
    template = _template("react", form, k, heldout, held_family=form == "compare")
    values = sorted({*places, *facts.values()})
    return _react(question, facts, steps, answer, "react", template, values)


def recall_task(rng: random.Random, heldout: bool = False, index: int = 0, notes: int | None = None) -> Task:
    """A value from the first tool result, needed after many long results (> 4W tokens later)."""
    notes = notes or rng.randrange(5, 9)
    what = rng.choice(side(RECALL_WHAT, heldout))
    k, phrasing = _pick(rng, RECALL_QUESTIONS, heldout)
    value = code(rng)
    facts = {what: value}
    for i in range(1, notes + 1):
        facts[f"note {i}"] = " ".join(sentence(rng) for _ in range(rng.randrange(4, 7)))
    question = phrasing.format(what=what, n=notes)
    steps = [(f"First the {what}.", "lookup", {"key": what}, value)]
    steps += [(f"Read note {i}.", "lookup", {"key": f"note {i}"}, facts[f"note {i}"]) for i in range(1, notes + 1)]
    task = _react(question, facts, steps, value, "recall", _template("recall", "notes", k, heldout), [value])
    task.inputs["max_steps"] = notes + 3
    return task


def _react(question: str, facts: dict, steps: list, answer: str, kind: str, template: str, values: list) -> Task:
    answers: list[str] = []
    for t, tool, args, _ in steps:
        answers += [thought(t), *call(tool, args)]
    answers += [thought(f"The answer is {answer}."), *call("finish", {"answer": answer})]
    return Task("react", kind, {"question": question, "facts": dict(facts), "max_steps": len(steps) + 2},
                {(question, None): answers}, {"answer": answer}, template, values)


# ---------------------------------------------------------------------------------------------
# The coding agent: a generated module with one bug, its test, a README
# ---------------------------------------------------------------------------------------------

def coding_task(rng: random.Random, heldout: bool = False, index: int = 0, layout: str | None = None) -> Task:
    kind = rng.choice(side(list(BUG_KINDS), heldout))
    bug = make_bug(rng, kind)
    module = rng.choice(MODULES)
    mod_file, test_file = f"{module}.py", f"test_{module}.py"
    want = bug.want
    call_text = f"{bug.func}({', '.join(map(repr, bug.args))})"
    # NOTE: no helper may hold the buggy line (edit_file needs it once in the file)
    helpers = [h for h in rng.sample(HELPERS, rng.randrange(0, 3)) if bug.bad not in h]
    body = [bug.source(), *([bug.extra] if bug.extra else []), *helpers]
    rng.shuffle(body)
    files = {
        mod_file: "\n\n".join(body),
        test_file: f"from {module} import {bug.func}\nassert {call_text} == {want!r}, {call_text}\nprint('ok')\n",
        "README.md": f"{rng.choice(('A tiny', 'A small', 'Some'))} {module} helpers.\n",
    }
    _, phrasing = _pick(rng, INSTRUCTIONS, heldout)
    instruction = phrasing.format(test=test_file, mod=mod_file, call=call_text, want=repr(want))
    layout = layout or rng.choices(("full", "plain", "fork"), (0.7, 0.15, 0.15))[0]
    hints = ["list the files", f"read {mod_file}"] if layout in ("full", "fork") else []
    delegate_at = 2 if layout == "full" else None
    script: dict = {}
    main: list[str] = []
    if hints:
        script[(instruction, 0)] = call("list_dir", {"path": "."})
        script[(instruction, 1)] = call("read_file", {"path": mod_file})
    else:
        main += [thought(f"Read {mod_file} first."), *call("read_file", {"path": mod_file})]
    main += [thought(f"Read the test {test_file}."), *call("read_file", {"path": test_file})]
    if delegate_at is not None:
        task_text = f"find where {bug.func} is defined"
        main += [thought(f"Ask a subagent where {bug.func} is."), json.dumps({"task": task_text})]
        line = files[mod_file].splitlines().index(f"def {bug.func}({bug.params}):") + 1
        script[(task_text, None)] = [thought(f"grep for def {bug.func}."),
                                     *call("grep", {"pattern": f"def {bug.func}", "path": "."}),
                                     thought("Report the file and line."),
                                     *call("finish", {"answer": f"{mod_file} line {line}"})]
    # NOTE: the edit copies the line with its indentation, so its words tokenize as in the file
    main += [thought(f"{bug.func} should {bug.good.strip()}."),
             *call("edit_file", {"path": mod_file, "old": bug.bad, "new": bug.good})]
    main += [thought("Run the test."), *call("run_python", {"code": f"exec(open('{test_file}').read())"})]
    main += [thought("The test passes."), *call("finish", {"answer": f"fixed {bug.func} in {mod_file}"})]
    script[(instruction, None)] = main
    inputs = {"instruction": instruction, "files": files, "parallel_hints": hints, "delegate_at": delegate_at,
              "max_turns": 8}
    return Task("coding", "coding", inputs, script,
                {"test": test_file, "module": mod_file, "fixed_line": bug.good.strip(), "bug_kind": kind},
                f"coding/{kind}", [bug.func, mod_file, test_file, bug.bad.strip()])


# ---------------------------------------------------------------------------------------------
# Parallel calls (fork) and subagents, over generated facts
# ---------------------------------------------------------------------------------------------

def _places(rng: random.Random, n: int, heldout: bool) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        p = name(rng, heldout=heldout)
        out += [p] if p not in out else []
    return out


def parallel_task(rng: random.Random, heldout: bool = False, index: int = 0) -> Task:
    places = _places(rng, rng.randrange(2, 4), heldout)
    rel = rng.choice(side(RELATIONS, heldout))
    facts = {f"{rel} of {p}": name(rng, heldout=heldout) for p in places}
    for p in places:
        facts[f"{rng.choice(side(NUMERIC, heldout))} of {p}"] = str(rng.randrange(100, 9999))
    k, phrasing = _pick(rng, PARALLEL_QUESTIONS, heldout)
    question = phrasing.format(rel=rel, places=", ".join(places))
    hints = [f"look up the {rel} of {p}" for p in places]
    # NOTE: joined without spaces, so each value tokenizes as in its tool result
    answer = ",".join(facts[f"{rel} of {p}"] for p in places)
    script = {(question, i): call("lookup", {"key": f"{rel} of {p}"}) for i, p in enumerate(places)}
    script[(question, None)] = [thought("I have every value."), json.dumps({"answer": answer})]
    return Task("parallel", "parallel", {"question": question, "facts": facts, "hints": hints}, script,
                {"answer": answer}, _template("parallel", "facts", k, heldout), sorted({*places, *facts.values()}))


def subagents_task(rng: random.Random, heldout: bool = False, index: int = 0) -> Task:
    places = _places(rng, 2, heldout)
    rels = rng.sample(side(RELATIONS, heldout), 2)
    facts = {f"{r} of {p}": name(rng, heldout=heldout) for r, p in zip(rels, places)}
    subtasks = [f"find the {r} of {p}" for r, p in zip(rels, places)]
    k, phrasing = _pick(rng, SUBAGENT_GOALS, heldout)
    goal = phrasing.format(r0=rels[0], p0=places[0], r1=rels[1], p1=places[1])
    answers = [facts[f"{r} of {p}"] for r, p in zip(rels, places)]
    script = {}
    for sub, r, p, a in zip(subtasks, rels, places, answers):
        script[(sub, None)] = [thought(f"Look up the {r} of {p}."), *call("lookup", {"key": f"{r} of {p}"}),
                               thought(f"It is {a}."), *call("finish", {"answer": a})]
    # NOTE: both values after a space, as in the tool results that report them ("... answer: X")
    answer = f"found {answers[0]} and {answers[1]}"
    script[(goal, None)] = [thought("Combine the subagents' answers."), json.dumps({"answer": answer})]
    return Task("subagents", "subagents", {"goal": goal, "facts": facts, "subtasks": subtasks}, script,
                {"answer": answer}, _template("subagents", "facts", k, heldout), sorted({*places, *facts.values()}))


# kind -> generator(rng, heldout, index) -> Task
GENERATORS = {"react": react_task, "recall": recall_task, "coding": coding_task, "parallel": parallel_task,
              "subagents": subagents_task, "function-calling": fc_task}


def template_pools() -> dict[str, dict[str, list[str]]]:
    """What each split may draw, by pool: {pool: {"train": [...], "heldout": [...]}} (for reports
    and the split test)."""
    from .schemas import FRAMES, catalogue

    pools = {"bug kinds": list(BUG_KINDS), "react forms": list(FORMS), "relations": list(RELATIONS),
             "numeric attributes": list(NUMERIC), "recall values": list(RECALL_WHAT),
             "instructions": list(INSTRUCTIONS), "request phrasings": list(FRAMES)}
    for kind, qs in QUESTIONS.items():
        if kind != "compare":
            pools[f"{kind} questions"] = list(qs)
    out = {k: {"train": side(v, False), "heldout": side(v, True)} for k, v in pools.items()}
    out["react forms"] = {"train": side(FORMS, False), "heldout": list(FORMS)}  # held-out tasks use every form
    out["tool schemas"] = {"train": [s.name for s in catalogue(False)], "heldout": [s.name for s in catalogue(True)]}
    return out
