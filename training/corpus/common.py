"""What every task generator shares: the `Task`, the split rules (which templates are held out),
generated names, and the text of scripted gens.

Splits. `make_tasks(seed, split, counts)` takes one of `SPLITS`:

- ``"train"`` and ``"in-template"`` draw only from training templates (``"in-template"`` from its
  own seed stream: new tasks of trained templates, scored apart);
- ``"heldout"`` draws only from held-out templates: bug kinds, tool schemas (names, parameter
  names, enum values), fact bases (relations, entities) and phrasings that no training task uses.

A pool of templates (phrasings, forms, bug kinds) is cut by index (`side`: every `HELD_EVERY`-th
item is held out); generated words (entity names, tool and parameter names, enum values) by a hash
of the word (`held_word`), so a word's side never depends on the order it was drawn in.

Copying. A value the model must copy is written, where it is stated (a user message, a tool
result), so that it tokenizes as it will where it is copied (inside a call's JSON): the byte-level
BPE splits text into pre-tokens first (letters, digits, punctuation, each with at most one leading
space), so a value in a JSON string follows a quote (no leading space: quote it in the text too)
and a JSON number follows ``": "`` (a leading space: keep one in the text). `copying.py` measures it.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field

SPLITS = ("train", "heldout", "in-template")
HELD_EVERY = 4  # every 4th template of a pool, and a quarter of generated words, are held out

SYLLABLES = ("ka", "lo", "mi", "ren", "sa", "tor", "vel", "zu", "dra", "fen", "gal", "hor", "is", "jun",
             "kel", "mor", "nas", "ol", "pra", "quin", "rus", "sel", "tam", "ur", "vos", "wen", "yar", "zel")
WORDS = ("amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
         "umber", "violet", "willow", "xenon", "yonder", "zephyr", "maple", "copper", "silver", "cedar",
         "lotus", "aspen", "comet", "dune", "fjord", "glacier", "heron", "ivory", "jasper", "kiln")


@dataclass
class Task:
    agent: str  # react | coding | parallel | subagents | function-calling
    kind: str  # the generator: react, recall, coding, parallel, subagents, function-calling
    inputs: dict
    script: dict = field(default_factory=dict)  # (first user message, branch) -> answers
    expect: dict = field(default_factory=dict)
    template: str = ""  # "<kind>/<family>": the template the task instantiates
    values: list[str] = field(default_factory=list)  # random values it states (as text), for copy checks

    def to_json(self) -> dict:
        return {"agent": self.agent, "kind": self.kind, "template": self.template, "inputs": self.inputs,
                "expect": self.expect}


def check_split(split: str) -> bool:
    """True for the held-out split; ValueError for an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    return split == "heldout"


def side(pool, heldout: bool) -> list:
    """The part of a template pool one split may use (every HELD_EVERY-th item is held out)."""
    return [x for i, x in enumerate(pool) if (i % HELD_EVERY == HELD_EVERY - 1) == heldout]


def held_word(word: str) -> bool:
    """Is a generated word (a name, an entity) held out? A fixed hash, a quarter of all words."""
    return zlib.crc32(word.encode()) % HELD_EVERY == 0


def word_of(rng: random.Random, heldout: bool, make) -> str:
    """`make(rng)` drawn until the word falls on the split's side."""
    for _ in range(1000):
        w = make(rng)
        if held_word(w) == heldout:
            return w
    raise RuntimeError("no word on the requested side")  # pragma: no cover - 1000 draws at p >= 1/4


def name(rng: random.Random, parts: int = 2, heldout: bool | None = None) -> str:
    """A made-up proper name (`parts` syllables); on the split's side when `heldout` is given."""
    make = lambda r: "".join(r.choice(SYLLABLES) for _ in range(parts)).capitalize()  # noqa: E731
    return make(rng) if heldout is None else word_of(rng, heldout, make)


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
