"""Build the training corpus offline and deterministically from a seed.

1. Generated tasks (`tasks.py`) run through Cedar's own agent programs (`cedar.agents.runs`) on a
   `ScriptedBackend`: real tools, real sandboxes, the served chat markup. A run whose outcome is
   not the task's `expect` (or whose script is not used up) is an error, never silently kept.
2. Plain code: Python standard-library sources of this machine (PSF licence), a tenth of the text.
3. A held-out split: tasks drawn only from held-out templates (`common.py`: bug kinds, tool
   schemas, fact bases and phrasings no training task uses), written to `heldout.json`; a
   training task whose prompt equals a held-out one is dropped.

Function-calling sessions are the conversation as an OpenAI-API loop renders it: the calls, their
results, and a text answer that ends each turn (`schemas.loop_text`).

`tokenize_corpus` then cuts every session at the boundaries of its gens (a thought, a tool name,
its arguments) and tokenizes the pieces apart, exactly as `CedarEndpoint` sends a session to the
server (the context as text, each gen's output as its own tokens); a chosen share of the
function-calling sessions is tokenized whole instead, as the server tokenizes an OpenAI-API chat
(`served_whole`, `cedar train --served-share`). It marks assistant tokens for
full loss weight, and a random value's first statement and a wrong call (a session's
``untrained`` spans, `schemas.loop_render`) for none.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cedar.backend.chat_template import CALL_HEAD, CALL_MID, CALL_TAIL
from cedar.backend.tokenizer import END, ROLE_MARKERS

from cedar.frontend.calls import ConstrainedCallError

from cedar.agents.function_calling import whole_value
from cedar.agents.outcome import outcome_ok
from cedar.agents.runs import AGENTS
from .common import check_split
from .schemas import check_calls, loop_render, loop_text
from .scripted import ScriptedBackend
from .tasks import GENERATORS, Task

# sessions per generator in the training split (scaled by `scale`) and in the held-out split
TRAIN_MIX = {"react": 2400, "recall": 1400, "coding": 1300, "function-calling": 2400, "parallel": 500, "subagents": 500}
HELDOUT = {"react": 40, "recall": 40, "coding": 30, "function-calling": 40, "parallel": 15, "subagents": 15}
PLAIN_SHARE = 0.1  # share of characters from plain code
GEN_PIECES = re.compile("(Thought: )([^\n<]*\n)()|(" + re.escape(CALL_HEAD) + ")(.*?)(" + re.escape(CALL_MID) + ")(.*?)("
                        + re.escape(CALL_TAIL) + ")", re.S)


class CorpusError(RuntimeError):
    """A scripted run did not end as its task expects."""


def make_tasks(seed: int, split: str, counts: dict[str, int], fresh_share: float = 0.0,
               mistakes: float = 0.0) -> list[Task]:
    """`counts[kind]` tasks of each kind for `split` (see `common.SPLITS`): ``"heldout"`` draws only
    held-out templates; ``"train"`` and ``"in-template"`` only training templates, each from its
    own seed stream. Deterministic from (seed, split, kind, index). ``fresh_share`` (the
    ``"train"`` split only): the share of function-calling tasks over fresh schemas
    (`schemas.fresh_schema`: tools, parameters and enum values made up for the task); the other
    tasks are what they are without it. ``mistakes`` (the ``"train"`` split only): the share of
    function-calling turns that make a wrong call and give up (`schemas.vary_loops`)."""
    heldout = check_split(split)
    if fresh_share and split != "train":
        raise ValueError(f"fresh schemas are drawn for the train split only, not {split!r}")
    if mistakes and split != "train":
        raise ValueError(f"mistakes are made in the train split only, not {split!r}")
    tasks = []
    for kind, n in counts.items():
        if kind not in GENERATORS:
            raise ValueError(f"unknown task kind {kind!r}; kinds: {', '.join(GENERATORS)}")
        for i in range(n):
            fresh = kind == "function-calling" and fresh_share > 0
            extra = {"fresh": random.Random(f"{seed}:{split}:fresh:{i}").random() < fresh_share} if fresh else {}
            if kind == "function-calling" and mistakes:
                extra["mistakes"] = mistakes
            task = GENERATORS[kind](random.Random(f"{seed}:{split}:{kind}:{i}"), heldout, i, **extra)
            if kind == "function-calling":
                task.inputs["name"] = f"{split}-fc-{i}"
            tasks.append(task)
    return tasks


DEMO = {"function-calling": 1, "coding": 1}  # the held-out tasks `make demo` runs
DEMO_SEED = 21


def demo_tasks() -> list[Task]:
    """The tasks `make demo` runs (``agents/tasks/demo_heldout.json``, written by
    ``scripts/write_demo_tasks.py``): held-out templates only, a tool schema and a bug kind that no
    training task uses."""
    return make_tasks(DEMO_SEED, "heldout", DEMO)


def prompt_key(task: Task) -> str:
    """A task's identity: all its inputs but its name (a training task equal to a held-out one
    in every input is dropped; a shared question with other facts is a different task)."""
    return json.dumps({k: v for k, v in task.inputs.items() if k != "name"}, sort_keys=True)


def run_scripted(task: Task) -> list[str]:
    """Run one task's agent on its script; returns the texts of every program it ran.

    A function-calling task's program text must equal `loop_text(inputs, answers=False)` (the
    served markup) and its calls must validate; what is returned is the conversation with the
    turns' text answers (`loop_text`), as an OpenAI-API loop that ends its turns renders it."""
    backend = ScriptedBackend(task.script)
    try:
        result = AGENTS[task.agent](backend, task.inputs)
    except (ConstrainedCallError, KeyError) as e:  # a gen the script could not answer
        raise CorpusError(f"{task.kind}: {e}") from None
    if backend.leftover():
        raise CorpusError(f"{task.kind}: unused script answers {backend.leftover()}")
    if not outcome_ok(task, result):
        raise CorpusError(f"{task.kind}: the scripted run did not reach {task.expect}: {json.dumps(result)[:400]}")
    texts = backend.texts()
    if task.agent == "function-calling":
        try:
            check_calls(task.inputs)
        except ValueError as e:
            raise CorpusError(f"{task.template}: {e}") from None
        if texts != [loop_text(task.inputs, answers=False)]:
            raise CorpusError(f"{task.template}: the program's text is not the task's conversation")
        return [loop_text(task.inputs)]
    return texts


def _run_scripted_twice(task: Task) -> list[str]:
    """`run_scripted`, once more if it fails: a scripted run is deterministic but for the sandbox's
    clock (a coding task's test run past its limit while the machine was busy stopped a corpus
    build at session 4,000); a task that fails twice is a corpus error."""
    try:
        return run_scripted(task)
    except CorpusError:
        return run_scripted(task)


def task_sessions(task: Task) -> list[dict]:
    """A training task's sessions for the corpus: ``{"kind", "text", "values"}`` per scripted
    text, with ``untrained`` (start, end) character spans where a loop turn made a wrong call."""
    spans = loop_render(task.inputs)[1] if task.agent == "function-calling" else []
    return [{"kind": task.kind, "text": t, "values": task.values, **({"untrained": spans} if spans else {})}
            for t in _run_scripted_twice(task)]


def plain_texts(max_chars: int, piece_chars: int = 3000) -> list[str]:
    """Pieces of this interpreter's standard-library sources (PSF licence), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        for s in range(0, len(text), piece_chars):
            out.append(text[s:s + piece_chars])
            total += len(out[-1])
            if total >= max_chars:
                return out
    return out


@dataclass
class Corpus:
    sessions: list[dict]  # {"kind", "text"}
    heldout: list[Task]


def train_tasks(seed: int, scale: float, heldout: list[Task], fresh_share: float = 0.0,
                mistakes: float = 0.0) -> list[Task]:
    """The training split: the mix scaled, minus any task equal to a held-out one."""
    held_keys = {prompt_key(t) for t in heldout}
    counts = {k: max(1, round(n * scale)) for k, n in TRAIN_MIX.items()}
    return [t for t in make_tasks(seed, "train", counts, fresh_share, mistakes) if prompt_key(t) not in held_keys]


def build_corpus(seed: int = 0, scale: float = 1.0, log=print, fresh_share: float = 0.0,
                 mistakes: float = 0.0) -> Corpus:
    heldout = make_tasks(seed, "heldout", HELDOUT)
    train = train_tasks(seed, scale, heldout, fresh_share, mistakes)
    sessions = []
    for i, task in enumerate(train):
        sessions += task_sessions(task)
        if log and (i + 1) % 500 == 0:
            log(f"[corpus] {i + 1}/{len(train)} scripted sessions")
    chars = sum(len(s["text"]) for s in sessions)
    sessions += [{"kind": "plain", "text": t} for t in plain_texts(int(chars * PLAIN_SHARE / (1 - PLAIN_SHARE)))]
    random.Random(seed).shuffle(sessions)
    return Corpus(sessions, heldout)


def save_corpus(corpus: Corpus, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.jsonl").open("w") as f:
        for s in corpus.sessions:
            f.write(json.dumps(s) + "\n")
    (out / "heldout.json").write_text(json.dumps([t.to_json() for t in corpus.heldout], indent=1) + "\n")


def load_sessions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train.jsonl").open()]


def served_whole(session: dict, share: float) -> bool:
    """Whether `tokenize_corpus` tokenizes this session in one piece, as the server tokenizes a chat
    sent to `/v1/chat/completions` (its template's text, whole): function-calling sessions only,
    the share `share` of them, chosen by a hash of the text (the same sessions on every build)."""
    return session["kind"] == "function-calling" and zlib.crc32(session["text"].encode()) % 10_000 < share * 10_000


def encode_session(tok, session: dict, whole: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """A session's token ids and each token's (start, end) characters in its text, cut at its
    gens as `split_at_gens` cuts it (plain text, and `whole`, in one piece).

    Cut, a call's name and arguments are tokens of their own, as `CedarEndpoint` carries a gen's
    output forward; whole, merges cross those edges (the arguments' last `"}` and the tail's `}`
    are one token, `"}}`), as in the history the server tokenizes for an OpenAI-API chat."""
    text = session["text"]
    parts = split_at_gens(text) if session["kind"] != "plain" and not whole else [text]
    ids, offsets, base = [], [], 0
    for part, enc in zip(parts, tok.encode_batch(parts, add_special_tokens=False)):
        ids += enc.ids
        offsets += [(base + a, base + b) for a, b in enc.offsets]
        base += len(part)
    return ids, offsets


def value_at(text: str, value: str, start: int = 0) -> int:
    """Where `value` first occurs in `text` from `start` as a whole value (not inside a longer
    word or number), or -1."""
    m = whole_value(value).search(text, start)
    return m.start() if m else -1


def value_spans(text: str, value: str, start: int = 0):
    """Yield where `value` occurs in `text` from `start` as a whole value (see `value_at`)."""
    while (at := value_at(text, value, start)) >= 0:
        yield at
        start = at + len(value)


def tokenize_corpus(sessions: list[dict], tokenizer_dir: Path, served_share: float = 0.0) -> dict[str, np.ndarray]:
    """-> {"ids": (N,) uint16, "weight": (N,) uint8, "doc_start": (D+1,) int64}.

    Sessions are cut at their gens (`encode_session`), except the share `served_share` of the
    function-calling ones (`served_whole`), tokenized whole as the server tokenizes a chat: the
    model meets both in serving (a frontend program's history, an OpenAI-API chat's).

    Weights (see `cedar.training.trainer.loss_of`): 1 = assistant token (full loss);
    0 = context (user, tool and system text, plain code: the trainer's small `context_weight`);
    UNTRAINED = no loss: the tokens of a random value's first statement (a session's ``values``,
    where the first occurrence is outside an assistant message): it is noise there, and only its
    copies can be predicted; and every token touching one of a session's ``untrained`` (start,
    end) character spans (a wrong call: the model learns to stop after it, not to make it);
    VALUE_START = the first token of an assistant's copy of such a value
    (an assistant token whose loss the trainer can weigh up: choosing which stated span to copy is
    the step a small model learns last, `cedar train --value-start-weight`); DECISION = the first
    token of an assistant message after a tool message (another call, or the text answer that ends
    the loop: `cedar train --decision-weight`)."""
    from tokenizers import Tokenizer

    from cedar.training.trainer import DECISION, UNTRAINED, VALUE_START

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    start_id, end_id = tok.token_to_id(ROLE_MARKERS["assistant"]), tok.token_to_id(END)
    tool_id = tok.token_to_id(ROLE_MARKERS["tool"])
    roles = {tok.token_to_id(m) for m in ROLE_MARKERS.values()}
    ids_all, weights, starts = [], [], [0]
    for s in sessions:
        ids, offsets = encode_session(tok, s, served_whole(s, served_share))
        w, inside, role, first = np.zeros(len(ids), np.uint8), False, None, False
        for j, t in enumerate(ids):
            if t == start_id:
                inside, first = True, role == tool_id and tool_id is not None
            elif inside:
                # NOTE: after a result, the first token picks another call or the answer (an empty
                # message's END stays 1: exchange_spans finds message ends by it)
                w[j] = DECISION if first and t != end_id else 1
                first = False
                if t == end_id:
                    inside = False
            if t in roles:
                role = t
        for a, b in s.get("untrained", ()):
            w[[j for j, (lo, hi) in enumerate(offsets) if lo < b and hi > a]] = UNTRAINED
        if s.get("values"):
            ends = np.asarray([b for _, b in offsets])
            for value in s["values"]:
                at = value_at(s["text"], value)
                if at < 0:
                    continue
                lo = int(np.searchsorted(ends, at, side="right"))  # first token ending after `at`
                hi = lo
                while hi < len(ids) and offsets[hi][0] < at + len(value):
                    hi += 1
                if not w[lo:hi].any():  # a statement (not an assistant's copy)
                    w[lo:hi] = UNTRAINED
                for copy in value_spans(s["text"], value, at + len(value)):
                    j = int(np.searchsorted(ends, copy, side="right"))
                    if j < len(ids) and w[j] == 1:  # an assistant's copy: its first token picks the span
                        w[j] = VALUE_START
        ids_all.append(np.asarray(ids, np.uint16))
        weights.append(w)
        starts.append(starts[-1] + len(ids))
    return {"ids": np.concatenate(ids_all), "weight": np.concatenate(weights), "doc_start": np.asarray(starts, np.int64)}


def token_sessions(sessions: list[dict], tokenizer_dir: Path) -> list[list[int]]:
    """Each session's token ids (as `tokenize_corpus` cuts and tokenizes them), one list apiece."""
    arrays = tokenize_corpus(sessions, tokenizer_dir)
    starts = arrays["doc_start"].tolist()
    return [arrays["ids"][a:b].astype(int).tolist() for a, b in zip(starts[:-1], starts[1:])]


def split_at_gens(text: str) -> list[str]:
    """A session cut where its gens start and end: [context, gen, context, gen, ..., context].

    Gens are a thought (after "Thought: ", up to and with its newline), a tool name (between CALL_HEAD
    and CALL_MID) and its arguments (between CALL_MID and CALL_TAIL); everything else is context
    and is tokenized in one piece between two gens, as the endpoint sends it."""
    out, last = [], 0
    for m in GEN_PIECES.finditer(text):
        if m.group(2) is not None:  # a thought
            cuts = [(m.start(2), m.end(2))]
        else:
            cuts = [(m.start(5), m.end(5)), (m.start(7), m.end(7))]
        for a, b in cuts:
            out.append(text[last:a])
            out.append(text[a:b])
            last = b
    out.append(text[last:])
    return [p for p in out if p]
