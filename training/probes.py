"""Copy probes: does the model read its context? Seconds on CPU; the trainer runs them at every
eval and ``cedar train --probe-only MODEL_DIR`` on a model folder.

- **repeat**: a random string of 16-32 distinct token ids (uniform over the non-special vocab),
  random filler ids (none of the string's), the string again: top-1 accuracy on the repeat
  (its first token excluded: nothing predicts it) per gap of filler.
- **value**: a conversation in the served chat markup: tools in the system message, a user
  message stating a random value (a number or a made-up word), filler rounds (a search call and
  its tool result) of about d tokens, then the assistant's call carrying the value: top-1
  accuracy on the value's tokens in the call (and the share of calls with every value token
  right) per distance bucket.
- **recall**: on the repeat probe, for every scored query, whether the indexer's top-k (the
  model's ``index_topk``) includes the compressed entry holding the statement token being
  copied; per gap and per index producer ``L<layer>`` (on cedar-tiny / cedar-agent: L1 = the
  encoder's KV source, ratio 2; L4 = the decoder's, ratio 1; L6 = a re-index over L4's
  entries; Reuse layers attend their producer's choice), beside the recall a random choice of
  k visible entries would get (``recall_chance``).

Every case is scored through :class:`~cedar.training.dense.DenseForward`, the trainer's
forward, with bounded replay simulated as serving does it (:func:`served_plan`): the prompt of a
case is its tokens up to where the model starts writing (the repeat, the call); its last W rows
are a narrowed prefill after an encoder-side prefix hit at ``prompt_end - W`` (when that is at
least 2W); the tokens after it are teacher-forced, which equals decoding them one by one
(tests/test_training.py holds the forward to the served replay and decode).

NOTE: differences from the served path: weights and caches stay float32 (serving stores global
entries in FP4 and window rows in FP8; the model is loaded with ``quantize=False``), scoring is
teacher-forced (a wrong token does not derail the next one), and each case is left-padded
(padding is another document, invisible to it) so its prompt ends on a multiple of W; RoPE makes
the shift invisible. A prompt end at an odd position moves one token earlier (documents start at
even offsets so compression groups never straddle two of them); that token is then decoded.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from cedar.backend.chat_template import system_text, tool_call_text
from cedar.backend.config import CEDConfig
from cedar.backend.model import CEDModel
from cedar.backend.tokenizer import END, ROLE_MARKERS, SPECIAL_TOKENS, BOS

from .dense import DenseForward, Plan


@dataclass(frozen=True)
class ProbeConfig:
    gaps: tuple[int, ...] = (0, 64, 120, 200, 500, 1000)  # repeat probe: filler tokens between
    cases: int = 4  # cases per gap (and per distance bucket), fixed seeds
    string_len: tuple[int, int] = (16, 32)  # repeat probe: string length range (inclusive)
    distances: tuple[int, ...] = (32, 128, 256, 512, 1000)  # value probe: statement-to-call tokens
    seed: int = 0
    token_range: tuple[int, int] | None = None  # ids strings and filler draw from; None: [specials, vocab)

    def __post_init__(self) -> None:
        lo, hi = self.string_len
        if self.cases < 1 or not 2 <= lo <= hi:
            raise ValueError(f"need cases >= 1 and 2 <= string_len[0] <= string_len[1], got {self}")
        if self.token_range and self.token_range[1] - self.token_range[0] <= hi:
            raise ValueError(f"token_range {self.token_range} holds no {hi + 1} distinct ids (a string and filler)")
        if any(g < 0 for g in self.gaps) or any(d < 1 for d in self.distances):
            raise ValueError(f"gaps must be >= 0 and distances >= 1, got {self.gaps}, {self.distances}")


QUICK = ProbeConfig(gaps=(0, 200), cases=2, distances=(32, 256))  # a smoke run (tests, --probe-quick)


@dataclass(frozen=True)
class ProbeCase:
    """One document. Token ``ids[t]`` for t in ``targets`` is scored from the logits at t - 1;
    ``sources[i]`` is where the token ``targets[i]`` copies was stated earlier."""

    ids: tuple[int, ...]
    prompt_end: int  # even; tokens from here on are written by the model (teacher-forced)
    targets: tuple[int, ...]
    sources: tuple[int, ...]
    distance: int  # tokens between the end of the statement and the first copied token
    same_tokens: bool = True  # the copied tokens equal the stated ones (else the model must translate)


@dataclass(frozen=True)
class ProbeBatch:
    ids: Tensor  # (B, T) int64
    doc: Tensor  # (B, T) int64, 0 = the case, -1 = padding
    plan: Plan
    offsets: tuple[int, ...]  # row b's case starts at this position (even)


@dataclass(frozen=True)
class Selection:
    """One index producer's top-k at every row: ``entry_pos`` (B, T, k) int64 the last position of
    each selected entry's group (-1: no entry), ``num_visible`` (B, T) int64, and the ratio
    of its KV source (an entry holds the ``ratio`` tokens ending at its position) and its lag
    (:meth:`CEDConfig.global_lag`: an entry is selectable from its position + lag on)."""

    entry_pos: Tensor
    num_visible: Tensor
    ratio: int
    topk: int
    lag: int = 0


@dataclass(frozen=True)
class ProbeOutput:
    logits: Tensor  # (B, T, V) f32
    selections: dict[int, Selection] | None  # per index producer layer; None: not an indexed model


# what the probes run: a batch -> logits (and the indexer's choices when the model has them)
ProbeForward = Callable[[ProbeBatch], ProbeOutput]


def served_plan(prompt_end: int, W: int) -> Plan:
    """A prompt ending at ``prompt_end`` (a multiple of W) served as a prefix hit on all but its
    last W tokens (when the hit is at least 2W) and a prefill narrowed to those W rows."""
    hit = prompt_end - W if prompt_end - W >= 2 * W else 0
    return Plan(hit=hit, narrow_end=prompt_end)


def layout(cases: list[ProbeCase], W: int, pad_id: int) -> ProbeBatch:
    """Left-pad each case so every prompt ends at the same multiple of W; right-pad to a
    multiple of W."""
    P = max(-(-c.prompt_end // W) * W for c in cases)
    offsets = tuple(P - c.prompt_end for c in cases)
    T = -(-max(o + len(c.ids) for o, c in zip(offsets, cases)) // W) * W
    ids = torch.full((len(cases), T), pad_id, dtype=torch.long)
    doc = torch.full((len(cases), T), -1, dtype=torch.long)
    for b, (o, c) in enumerate(zip(offsets, cases)):
        ids[b, o:o + len(c.ids)] = torch.tensor(c.ids)
        doc[b, o:o + len(c.ids)] = 0
    return ProbeBatch(ids, doc, served_plan(P, W), offsets)


def dense_forward(model: CEDModel) -> ProbeForward:
    """The trainer's forward (float32, no autocast) as a :data:`ProbeForward`."""
    # NOTE: the indexer's distillation loss is not needed here; one aux row keeps its cost nil
    fwd, cfg = DenseForward(model, aux_stride=1 << 30), model.cfg

    @torch.no_grad()
    def run(batch: ProbeBatch) -> ProbeOutput:
        B, T = batch.ids.shape
        logits = torch.empty(B, T, cfg.vocab_size)
        sel = {layer: Selection(torch.full((B, T, cfg.index_topk), -1, dtype=torch.long),
                                torch.zeros(B, T, dtype=torch.long), cfg.compress_ratios[layer], cfg.index_topk,
                                cfg.global_lag(cfg.kv_source_of(layer)))
               for layer in cfg.index_source_layer_ids}
        for p in fwd.run_passes(batch.ids, batch.doc, batch.plan):
            rows = slice(p.start, p.start + p.logits.shape[1])  # a later pass overwrites, as ``run`` merges
            logits[:, rows] = p.logits
            pos, doc = torch.arange(rows.start, rows.stop), batch.doc[:, rows]
            for layer, (idx, valid) in p.selections.items():
                ent = p.entries[cfg.kv_source_of(layer)]
                sel[layer].entry_pos[:, rows, :idx.shape[-1]] = torch.where(valid, ent.pos[idx], -1)
                visible = (ent.visible_from[None, None, :] <= pos[None, :, None]) & (ent.doc[:, None, :] == doc[:, :, None])
                sel[layer].num_visible[:, rows] = visible.sum(-1)
        return ProbeOutput(logits, sel)

    return run


@dataclass(frozen=True)
class Scores:
    top1: list[float]  # per case: share of its targets predicted top-1
    exact: list[bool]  # per case: every target right
    first: list[bool]  # per case: its first target right (for a value: choosing what to copy)
    recall: dict[int, float]  # per index producer layer: share of queries whose top-k holds the source entry
    chance: dict[int, float]  # per layer: mean min(1, k / visible entries) at those queries (0 where
    # the entry is not selectable yet)


def score(forward: ProbeForward, cases: list[ProbeCase], W: int, pad_id: int) -> Scores:
    """Run ``cases`` as one batch and score them."""
    batch = layout(cases, W, pad_id)
    out = forward(batch)
    top1, exact, first = [], [], []
    hits: dict[int, list[float]] = {}
    chance: dict[int, list[float]] = {}
    for b, (o, c) in enumerate(zip(batch.offsets, cases)):
        q = torch.tensor(c.targets) + o - 1  # query rows
        right = out.logits[b, q].argmax(-1) == batch.ids[b, q + 1]
        top1.append(float(right.float().mean()))
        exact.append(bool(right.all()))
        first.append(bool(right[0]))
        for layer, s in (out.selections or {}).items():
            src = torch.tensor(c.sources) + o
            want = src - src % s.ratio + s.ratio - 1  # the entry holding the source token
            hits.setdefault(layer, []).extend((s.entry_pos[b, q] == want[:, None]).any(-1).float().tolist())
            vis = s.num_visible[b, q].clamp_min(1).float()
            # NOTE: no chance where the entry is not yet selectable (a lagged source's window)
            selectable = want + s.lag <= q
            chance.setdefault(layer, []).extend(torch.where(selectable, (s.topk / vis).clamp(max=1.0), 0.0).tolist())
    return Scores(top1, exact, first, {k: _mean(v) for k, v in hits.items()}, {k: _mean(v) for k, v in chance.items()})


# ---------------------------------------------------------------------------------- the cases
def repeat_cases(gap: int, pc: ProbeConfig, vocab_size: int) -> list[ProbeCase]:
    """``pc.cases`` repeat cases with ``gap`` filler ids between the statement and the repeat."""
    lo, hi = pc.token_range or (len(SPECIAL_TOKENS), vocab_size)
    cases = []
    for c in range(pc.cases):
        rng = random.Random(f"{pc.seed}:repeat:{gap}:{c}")
        n = rng.randint(*pc.string_len)
        s = rng.sample(range(lo, hi), n)  # NOTE: distinct, so "what followed it before" is one token
        taken = set(s)
        filler = []
        while len(filler) < gap:
            t = rng.randrange(lo, hi)
            if t not in taken:
                filler.append(t)
        R = n + gap  # the repeat starts here
        cases.append(ProbeCase(tuple(s + filler + s), R + 1 - (R + 1) % 2, tuple(range(R + 1, R + n)),
                               tuple(range(1, n)), gap))
    return cases


_WORDS = ("the", "file", "result", "found", "line", "value", "list", "item", "open", "report", "status",
          "error", "check", "data", "table", "page", "count", "total", "name", "entry", "index", "node",
          "user", "record", "field", "match", "query", "output", "summary", "next", "from", "with")
_SYLLABLES = ("ka", "zo", "rin", "vel", "tu", "mar", "qi", "bex", "lo", "dra", "sen", "fu", "gor", "pi")
_TOOLS = [
    {"type": "function", "function": {"name": "get_record", "description": "Fetch a record by its id.",
     "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}},
    # NOTE: not a parameter called `name`: every schema above writes `"name": "<function>"`, the same
    # three tokens a call writes before that argument, and a model that matches them copies a
    # function name from the tool list instead of the request's value (measured: 0/20 strings)
    {"type": "function", "function": {"name": "lookup", "description": "Look a note up by its entry.",
     "parameters": {"type": "object", "properties": {"entry": {"type": "string"}}, "required": ["entry"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the notes.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]


class ValueCases:
    """The value probe's cases for one tokenizer (``tokenizer.json`` of a model folder)."""

    def __init__(self, tokenizer_dir: Path, pc: ProbeConfig) -> None:
        from tokenizers import Tokenizer

        self.tok, self.pc = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")), pc

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def span(self, text: str, value: str) -> tuple[list[int], int, int]:
        """Tokens of ``text`` and the token range [a, b) overlapping the last ``value`` in it."""
        enc = self.tok.encode(text, add_special_tokens=False)
        c0 = text.rindex(value)
        c1 = c0 + len(value)
        over = [i for i, (x, y) in enumerate(enc.offsets) if x < c1 and y > c0]
        return enc.ids, over[0], over[-1] + 1

    def cases(self, distance: int) -> list[ProbeCase]:
        return [self.case(distance, c) for c in range(self.pc.cases)]

    def case(self, distance: int, c: int) -> ProbeCase:
        rng = random.Random(f"{self.pc.seed}:value:{distance}:{c}")
        if c % 2 == 0:  # a number for get_record(id)
            value = str(rng.randrange(100, 1_000_000))
            # NOTE: the number after a space, as in the call (`"id": 52`): this tokenizer merges a
            # space with the digits after it, so `id=52` would state other tokens than the copy
            user = rng.choice(("Fetch the record with id {v} please.", "I need record number {v}: what does it say?",
                               "Please get the record (id {v}) and tell me its status."))
            name, args = "get_record", {"id": int(value)}
        else:  # a made-up word for lookup(entry)
            value = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
            user = rng.choice(('Look up the entry "{v}".', 'What do the notes say about the entry "{v}"?',
                               'Find the entry "{v}" for me, please.'))
            name, args = "lookup", {"entry": value}
        head = self.encode(BOS + ROLE_MARKERS["system"] + system_text(None, _TOOLS) + END)
        user_ids, a, b = self.span(ROLE_MARKERS["user"] + user.format(v=value) + END, value)
        # NOTE: the arguments as json.dumps writes them (`{"id": 52}`), as the chat template and every
        # training call do: `{"id":52}` (no space) put the value's first token where the model had
        # only ever seen a space there
        call_ids, ca, cb = self.span(ROLE_MARKERS["assistant"] + tool_call_text(name, args) + END, value)
        base = len(user_ids) - b + ca
        rounds: list[int] = []
        while base + len(rounds) < distance:
            rounds += self._round(rng, distance - base - len(rounds))
        ids = head + user_ids + rounds + call_ids
        start = len(head) + len(user_ids) + len(rounds)  # the final assistant message
        stated = range(len(head) + a, len(head) + b)
        prompt_end = start + 1  # after <|assistant|>: the model writes the call
        # NOTE: a value tokenized differently where it is copied is scored on the call's tokens;
        # its sources then point at the statement's tokens position by position, clipped
        targets = tuple(range(start + ca, start + cb))
        sources = tuple(stated[min(i, len(stated) - 1)] for i in range(len(targets)))
        same = [ids[t] for t in targets] == [ids[t] for t in stated]
        return ProbeCase(tuple(ids), prompt_end - prompt_end % 2, targets, sources, targets[0] - stated[-1] - 1, same)

    def _round(self, rng: random.Random, want: int) -> list[int]:
        """A search call and its tool result, about ``want`` tokens (at most ~200)."""
        call = self.encode(ROLE_MARKERS["assistant"] + tool_call_text("search", {"query": rng.choice(_WORDS)}) + END)
        words: list[str] = []
        budget = min(max(want, 1), 200) - len(call)
        result = self.encode(ROLE_MARKERS["tool"] + END)
        while len(result) < budget:
            words.append(rng.choice(_WORDS) if rng.random() < 0.85 else str(rng.randrange(1000)))
            result = self.encode(ROLE_MARKERS["tool"] + " ".join(words) + END)
        return call + result


# ---------------------------------------------------------------------------------- the suite
class ProbeSuite:
    """Every probe's cases, built once (fixed seeds), run on a model at each call."""

    def __init__(self, cfg: CEDConfig, pc: ProbeConfig = ProbeConfig(), tokenizer_dir: Path | None = None) -> None:
        self.cfg, self.pc = cfg, pc
        self.repeat = {g: repeat_cases(g, pc, cfg.vocab_size) for g in pc.gaps}
        values = ValueCases(tokenizer_dir, pc) if tokenizer_dir is not None else None
        self.value = {d: values.cases(d) for d in pc.distances} if values else {}
        top = max((max(c.ids) for cases in self.value.values() for c in cases), default=0)
        if top >= cfg.vocab_size:
            raise ValueError(f"the tokenizer in {tokenizer_dir} writes id {top}, beyond the model's "
                             f"vocabulary of {cfg.vocab_size}")

    def run(self, model: CEDModel) -> dict:
        """Probe figures of ``model`` (left in its train/eval mode), JSON-ready."""
        was_training = model.training
        model.eval()
        try:
            return self.run_forward(dense_forward(model))
        finally:
            model.train(was_training)

    def run_forward(self, forward: ProbeForward) -> dict:
        t0 = time.time()
        W, pad = self.cfg.sliding_window, self.cfg.pad_token_id
        out: dict = {"repeat": {}, "recall": {}, "recall_chance": {}}
        for g, cases in self.repeat.items():
            s = score(forward, cases, W, pad)
            out["repeat"][str(g)] = round(_mean(s.top1), 4)
            for layer in s.recall:
                out["recall"].setdefault(f"L{layer}", {})[str(g)] = round(s.recall[layer], 4)
                out["recall_chance"].setdefault(f"L{layer}", {})[str(g)] = round(s.chance[layer], 4)
        if self.value:
            for key in ("value", "value_exact", "value_first", "value_distance", "value_same_tokens"):
                out[key] = {}
            for d, cases in self.value.items():
                s = score(forward, cases, W, pad)
                out["value"][str(d)] = round(_mean(s.top1), 4)
                out["value_exact"][str(d)] = round(_mean([float(x) for x in s.exact]), 4)
                out["value_first"][str(d)] = round(_mean([float(x) for x in s.first]), 4)
                out["value_distance"][str(d)] = round(_mean([c.distance for c in cases]), 1)
                out["value_same_tokens"][str(d)] = round(_mean([float(c.same_tokens) for c in cases]), 4)
        out["seconds"] = round(time.time() - t0, 2)
        return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
