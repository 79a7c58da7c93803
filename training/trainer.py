"""The training loop: packed rows, a share of steps under simulated bounded replay, AdamW with a
cosine schedule, resumable checkpoints, the loss curve as JSON and PNG.

Inputs are token arrays (``ids`` uint16, ``weight`` uint8 = 1 on assistant tokens, ``doc_start``
offsets), produced by whoever built the corpus (``cedar.training.corpus``). Every step's batch and
plan are a function of (seed, step), so a resumed run takes the same steps as an unbroken one.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cedar.backend.config import CEDConfig
from cedar.backend.model import CEDModel

from .dense import DenseForward, Plan
from .probes import ProbeSuite

CHECKPOINT = "checkpoint.pt"
UNTRAINED = 2  # token weight: the token is input only (a copy row's first statement)
VALUE_START = 3  # token weight: an assistant token that starts a copied value (``value_start_weight``)
DECISION = 4  # token weight: an assistant message's first token after a tool message (``decision_weight``)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 3  # packed rows per step
    seq_len: int = 2048  # tokens per row (a multiple of W)
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.05
    context_weight: float = 0.3  # loss weight of non-assistant tokens (assistant tokens: 1)
    aux_weight: float = 0.1  # indexer distillation loss
    replay_share: float = 0.35  # steps with an encoder-side hit (and a narrowed prompt end)
    narrow_share: float = 0.25  # steps with decoder narrowing only
    dense_share: float = 0.0  # a first share of steps attends every visible global entry (indexer warm-up)
    checkpoint_every: int = 50
    eval_every: int = 100
    seed: int = 0
    bf16: bool = False  # matmuls under CPU autocast to bfloat16 (weights, optimizer and loss stay f32)
    init: str = ""  # warm start: an HF model folder whose weights replace the random init
    copy_share: float = 0.0  # chance that a step's last row is synthetic copying (see copy_row)
    recall_share: float = 0.0  # of those copy rows, the share that are recall rows (see recall_row)
    copy_vocab: tuple[int, int] = (8, 2046)  # token ids copy rows draw from (no special tokens)
    keyed_share: float = 0.0  # of the copy rows that are not recall rows, the share that are keyed rows
    exchange_share: float = 0.0  # chance that a step's first row packs value-copying exchanges (exchange_spans)
    value_start_weight: float = 1.0  # loss weight of a VALUE_START token (other assistant tokens: 1)
    decision_weight: float = 1.0  # loss weight of a DECISION token: after a result, call again or answer


def init_model(cfg: CEDConfig, seed: int) -> CEDModel:
    """Training init: N(0, 0.02) weights, output projections scaled by 1/sqrt(2L), sinks 0."""
    gen = torch.Generator().manual_seed(seed)
    model = CEDModel(cfg, quantize=False)
    scale = 1 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sink"):
                p.zero_()
            elif p.dim() >= 2:
                std = 0.02 * (scale if name.endswith(("wo.weight", "down_proj.weight")) else 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def pack_rows(doc_start: np.ndarray, seq_len: int) -> list[list[tuple[int, int]]]:
    """First-fit packing of documents (pieces of at most seq_len tokens) into rows; each piece
    starts at an even offset. Returns rows as lists of (start, end) token ranges."""
    pieces = []
    for a, b in zip(doc_start[:-1].tolist(), doc_start[1:].tolist()):
        for s in range(a, b, seq_len):
            pieces.append((s, min(b, s + seq_len)))
    return pack_pieces(pieces, seq_len)


def exchange_spans(arrays: dict, user_id: int, end_id: int, seq_len: int) -> list[tuple[int, int]]:
    """The corpus's exchanges that copy a value, cut out of their sessions: from the marker of the
    user message before a VALUE_START token to the end of the assistant message holding it (the
    request, any turns between, the call), at most ``seq_len`` tokens, without the system prompt
    and the turns before. Packed many to a row they are the short-context copy curriculum in the
    agent format itself (``exchange_share``): several value starts per hundred tokens, where a
    whole session has a few per thousand. -> sorted (start, end) token ranges, end exclusive."""
    ids, w, starts = arrays["ids"], arrays["weight"], arrays["doc_start"]
    at = np.flatnonzero(w == VALUE_START)
    users = np.flatnonzero(ids == user_id)
    ends = np.flatnonzero((ids == end_id) & (w == 1))  # an assistant message's end
    u = np.searchsorted(users, at) - 1
    e = np.searchsorted(ends, at)
    keep = (u >= 0) & (e < len(ends))
    u, e = users[u[keep]], ends[e[keep]] + 1
    same_doc = np.searchsorted(starts, u, side="right") == np.searchsorted(starts, e - 1, side="right")
    keep = same_doc & (e - u <= seq_len)
    last: dict[int, int] = {}  # NOTE: one span per user message, to its last copying answer (no overlaps)
    for a, b in zip(u[keep].tolist(), e[keep].tolist()):
        last[a] = max(b, last.get(a, b))
    return sorted(last.items())


def pack_pieces(pieces: list[tuple[int, int]], seq_len: int) -> list[list[tuple[int, int]]]:
    """First-fit packing of (start, end) token ranges of at most seq_len tokens into rows, each
    at an even offset, longest first."""
    pieces = sorted(pieces, key=lambda p: p[0] - p[1])  # longest first
    rows: list[list[tuple[int, int]]] = []
    free: list[int] = []
    for a, b in pieces:
        n = b - a + (b - a) % 2
        # NOTE: first fit among the last rows opened only (bounded search; near-full rows close)
        for r in range(max(0, len(rows) - 64), len(rows)):
            if free[r] >= n:
                rows[r].append((a, b))
                free[r] -= n
                break
        else:
            rows.append([(a, b)])
            free.append(seq_len - n)
    return rows


def make_batch(arrays: dict, rows: list[list[tuple[int, int]]], which: list[int], seq_len: int,
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> ids (B, T) int64, doc (B, T) int64 (-1 = pad), weight (B, T) uint8."""
    B = len(which)
    ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    doc = torch.full((B, seq_len), -1, dtype=torch.long)
    w = torch.zeros((B, seq_len), dtype=torch.uint8)
    for i, r in enumerate(which):
        at = 0
        for d, (a, b) in enumerate(rows[r]):
            n = b - a
            ids[i, at:at + n] = torch.from_numpy(arrays["ids"][a:b].astype(np.int64))
            w[i, at:at + n] = torch.from_numpy(arrays["weight"][a:b])
            doc[i, at:at + n] = d
            at += n + n % 2
    return ids, doc, w


def copy_row(tc: TrainConfig, step: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row of synthetic copying documents, a function of (seed, step): each is a random token
    string of 8-48 ids from ``tc.copy_vocab`` said 2-4 times; the repeats carry the loss (weight
    1), the first statement none. Predicting a repeat takes attending to the earlier statement
    by content (an induction head), the skill agent tasks need to copy names, keys and values
    from a request or a tool result and that the agent corpus alone is slow to teach. The first
    statement is random, so it is input only (weight UNTRAINED).
    -> ids (T,) int64, doc (T,) int64 (-1 = pad), weight (T,) uint8."""
    rng = random.Random(f"{tc.seed}:copy:{step}")
    ids = torch.zeros(seq_len, dtype=torch.long)
    doc = torch.full((seq_len,), -1, dtype=torch.long)
    w = torch.zeros(seq_len, dtype=torch.uint8)
    at, d = 0, 0
    while True:
        s = [rng.randrange(*tc.copy_vocab) for _ in range(rng.randint(8, 48))]
        k = rng.randint(2, 4)
        n = len(s) * k
        if at + n > seq_len:
            return ids, doc, w
        ids[at:at + n] = torch.tensor(s * k)
        doc[at:at + n] = d
        w[at:at + len(s)] = UNTRAINED
        w[at + len(s):at + n] = 1
        at, d = at + n + n % 2, d + 1


def recall_row(tc: TrainConfig, step: int, seq_len: int,
               repeat_p: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row of one document that states random strings (8-32 distinct ids each, input only) and
    repeats earlier ones at every distance the row allows: each item is, with chance
    ``repeat_p``, a repeat of a string stated anywhere before (chosen uniformly, so distances
    spread from 0 to the row's length), else a new string. A repeat's first id names which string
    is meant and is not predictable (UNTRAINED); the ids after it carry the loss (weight 1). This
    is the distance curriculum: past the 128-token window a repeat is reachable only through the
    global entries the indexer selects, so training it trains that path.
    -> ids (T,) int64, doc (T,) int64 (-1 = pad), weight (T,) uint8."""
    rng = random.Random(f"{tc.seed}:recall:{step}")
    ids = torch.zeros(seq_len, dtype=torch.long)
    doc = torch.full((seq_len,), -1, dtype=torch.long)
    w = torch.zeros(seq_len, dtype=torch.uint8)
    stated: list[list[int]] = []
    at = 0
    while True:
        if stated and rng.random() < repeat_p:
            s, first = rng.choice(stated), False
        else:
            s, first = rng.sample(range(*tc.copy_vocab), rng.randint(8, 32)), True
        if at + len(s) > seq_len:
            return ids, doc, w
        ids[at:at + len(s)] = torch.tensor(s)
        doc[at:at + len(s)] = 0
        w[at:at + (len(s) if first else 1)] = UNTRAINED
        w[at + (len(s) if first else 1):at + len(s)] = 1
        if first:
            stated.append(s)
        at += len(s)


def keyed_row(tc: TrainConfig, step: int, seq_len: int,
              query_p: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row of one document of key-value statements and queries, in one made-up syntax per row
    (two random separator ids, ``eq`` and ``end``): a statement is ``key eq value end`` (keys 1-3
    random ids, values 2-8; input only), a query, with chance ``query_p`` once four keys are
    stated, names a key stated anywhere before (chosen uniformly, so distances spread over the
    row) and is answered with its value. The key of a query is not predictable (UNTRAINED); its
    value's first id, the one that needs the key looked up, is VALUE_START, the rest of the answer
    carries weight 1. This is the skill an agent's call needs and a repeat does not train: which
    stated span to copy, chosen by what names it (`"city": "` -> the city in the request), where
    `recall_row` only continues a string whose first id is given.
    -> ids (T,) int64, doc (T,) int64 (-1 = pad), weight (T,) uint8."""
    rng = random.Random(f"{tc.seed}:keyed:{step}")
    eq, end = rng.sample(range(*tc.copy_vocab), 2)
    vocab = [t for t in range(*tc.copy_vocab) if t not in (eq, end)]
    ids = torch.zeros(seq_len, dtype=torch.long)
    doc = torch.full((seq_len,), -1, dtype=torch.long)
    w = torch.zeros(seq_len, dtype=torch.uint8)
    stated: dict[tuple[int, ...], list[int]] = {}
    at = 0
    while True:
        if len(stated) >= 4 and rng.random() < query_p:
            key = rng.choice(list(stated))
            value, query = stated[key], True
        else:
            key = tuple(rng.sample(vocab, rng.randint(1, 3)))
            if key in stated:
                continue
            value, query = rng.sample(vocab, rng.randint(2, 8)), False
        item = [*key, eq, *value, end]
        if at + len(item) > seq_len:
            return ids, doc, w
        ids[at:at + len(item)] = torch.tensor(item)
        doc[at:at + len(item)] = 0
        v = at + len(key) + 1  # the value's first id
        if query:
            w[at:at + len(key)] = UNTRAINED
            w[at + len(key)] = 0  # `eq` after a key: the format, context weight
            w[v] = VALUE_START
            w[v + 1:at + len(item)] = 1
        else:
            w[at:at + len(item)] = UNTRAINED
            stated[key] = value
        at += len(item)


def synthetic_row(tc: TrainConfig, step: int, seq_len: int):
    """The synthetic row of a step that has one (``copy_share``): a recall row (``recall_share``),
    else a keyed row (``keyed_share`` of the rest), else a copy row; a function of (seed, step)."""
    if tc.recall_share and random.Random(f"{tc.seed}:recall-step:{step}").random() < tc.recall_share:
        return recall_row(tc, step, seq_len)
    if tc.keyed_share and random.Random(f"{tc.seed}:keyed-step:{step}").random() < tc.keyed_share:
        return keyed_row(tc, step, seq_len)
    return copy_row(tc, step, seq_len)


def step_plan(tc: TrainConfig, step: int, seq_len: int, W: int) -> Plan:
    rng = random.Random(f"{tc.seed}:plan:{step}")
    dense = step < tc.dense_share * tc.steps
    u = rng.random()
    blocks = seq_len // W
    if u < tc.replay_share and blocks >= 4:
        hit = rng.randrange(2, blocks - 1) * W
        end = rng.randrange(hit // W + 1, blocks + 1) * W
        return Plan(hit=hit, narrow_end=end, dense_global=dense)
    if u < tc.replay_share + tc.narrow_share:
        return Plan(narrow_end=rng.randrange(1, blocks + 1) * W, dense_global=dense)
    return Plan(dense_global=dense)


def token_losses(logits: torch.Tensor, ids: torch.Tensor, doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V), ids, doc (B, T) -> next-token CE (B, T-1) and the mask of real targets
    (same document as the row before it, not padding)."""
    valid = (doc[:, 1:] >= 0) & (doc[:, 1:] == doc[:, :-1])
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return ce.view_as(valid), valid


def bf16_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without it, CPU
    autocast to bfloat16 emulates: measured on an AVX2-only EPYC (2 threads, the shipped geometry,
    16 x 256 rows, forward + backward), 50 s a step against 3.1 s in float32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def loss_of(forward: DenseForward, ids, doc, weight, plan: Plan, tc: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token loss (and the plain mean over real tokens, for reporting). ``weight``:
    1 = assistant token, 0 = context (``tc.context_weight``), UNTRAINED = no loss at all,
    VALUE_START = an assistant token weighted ``tc.value_start_weight``, DECISION = one weighted
    ``tc.decision_weight``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16):
        logits, aux = forward.run(ids, doc, plan)
    logits = logits.float()
    ce, valid = token_losses(logits, ids, doc)
    valid = valid & (weight[:, 1:] != UNTRAINED)
    target = weight[:, 1:]
    w = torch.where(target > 0, 1.0, tc.context_weight)
    w = torch.where(target == VALUE_START, tc.value_start_weight, torch.where(target == DECISION, tc.decision_weight, w)) * valid
    total = (ce * w).sum() / w.sum().clamp_min(1) + tc.aux_weight * aux
    return total, ((ce * valid).sum() / valid.sum().clamp_min(1)).detach()


@torch.no_grad()
def heldout_loss(model: CEDModel, arrays: dict, tc: TrainConfig, pad_id: int, max_rows: int = 8) -> dict:
    """Mean next-token loss over real tokens and over assistant tokens of held-out rows (cold)."""
    rows = pack_rows(arrays["doc_start"], tc.seq_len)[:max_rows]
    fwd = DenseForward(model)
    tot = ast = n = na = 0.0
    for i in range(0, len(rows), tc.batch):
        ids, doc, w = make_batch(arrays, rows, list(range(i, min(i + tc.batch, len(rows)))), tc.seq_len, pad_id)
        logits, _ = fwd.run(ids, doc, Plan())
        ce, valid = token_losses(logits, ids, doc)
        a = valid & (w[:, 1:] > 0) & (w[:, 1:] != UNTRAINED)  # assistant tokens
        tot, n = tot + float((ce * valid).sum()), n + float(valid.sum())
        ast, na = ast + float((ce * a).sum()), na + float(a.sum())
    return {"loss": tot / max(n, 1), "assistant_loss": ast / max(na, 1), "tokens": int(n)}


def lr_at(tc: TrainConfig, step: int) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def train(cfg: CEDConfig, arrays: dict, heldout: dict | None, tc: TrainConfig, out: Path,
          progress: bool = True, until: int | None = None,
          probes: ProbeSuite | None = None, markers: tuple[int, int] | None = None) -> tuple[CEDModel, dict]:
    """Train (or resume from ``out/checkpoint.pt``) and return the model and the curve.
    ``markers``: the user-message and end token ids, which ``tc.exchange_share`` needs.
    ``until``: stop after that step (checkpointed), as an interrupted run would. At every eval
    (each ``tc.eval_every`` steps and the last) the held-out loss goes to ``curve["heldout"]``
    (with ``heldout`` given) and the copy probes' figures to ``curve["probes"]`` (with
    ``probes`` given), each entry tagged with its step."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)
    model = init_model(cfg, tc.seed)
    if tc.init:
        from cedar.backend.model_io import load_model

        # NOTE: strict: a folder of another geometry fails here, naming the mismatched tensors
        model.load_state_dict(load_model(Path(tc.init), quantize=False).state_dict())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    curve = {"config": asdict(tc), "train": [], "heldout": [], "probes": [], "seconds": 0.0}
    start = 0
    ck = out / CHECKPOINT
    if ck.is_file():
        state = torch.load(ck, weights_only=False)
        if state["config"] != asdict(tc):
            raise ValueError(f"{ck} was written by another training config; use another --out or the same flags")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        curve, start = state["curve"], state["step"]
        curve.setdefault("probes", [])  # a checkpoint written before the probes existed
    rows = pack_rows(arrays["doc_start"], tc.seq_len)
    exchanges: list[list[tuple[int, int]]] = []
    if tc.exchange_share:
        if markers is None:
            raise ValueError("exchange_share needs the user and end marker ids (train(markers=...))")
        exchanges = pack_pieces(exchange_spans(arrays, *markers, tc.seq_len), tc.seq_len)
        if not exchanges:
            raise ValueError("exchange_share: the corpus has no exchange that copies a value (no VALUE_START)")
    order = random.Random(f"{tc.seed}:order")
    perm: list[int] = []
    while len(perm) < tc.steps * tc.batch:
        block = list(range(len(rows)))
        order.shuffle(block)
        perm += block
    fwd = DenseForward(model)
    model.train()
    bar = tqdm(range(start, min(tc.steps, until or tc.steps)), initial=start, total=tc.steps, disable=not progress, desc="train")
    t0 = time.time() - curve["seconds"]
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(tc, step)
        ids, doc, w = make_batch(arrays, rows, perm[step * tc.batch:(step + 1) * tc.batch], tc.seq_len, cfg.pad_token_id)
        if tc.copy_share and random.Random(f"{tc.seed}:copy-step:{step}").random() < tc.copy_share:
            ids[-1], doc[-1], w[-1] = synthetic_row(tc, step, tc.seq_len)
        pick = random.Random(f"{tc.seed}:exchange-step:{step}")
        if exchanges and pick.random() < tc.exchange_share:
            e_ids, e_doc, e_w = make_batch(arrays, exchanges, [pick.randrange(len(exchanges))], tc.seq_len,
                                           cfg.pad_token_id)
            ids[0], doc[0], w[0] = e_ids[0], e_doc[0], e_w[0]
        plan = step_plan(tc, step, tc.seq_len, cfg.sliding_window)
        loss, plain = loss_of(fwd, ids, doc, w, plan, tc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve["train"].append({"step": step, "loss": round(float(plain), 4), "objective": round(float(loss.detach()), 4),
                               "hit": plan.hit, "narrow_end": plan.narrow_end})
        bar.set_postfix(loss=f"{float(plain):.3f}")
        done = step + 1
        if done % tc.eval_every == 0 or done == tc.steps:
            model.eval()
            if heldout is not None:
                curve["heldout"].append({"step": done, **heldout_loss(model, heldout, tc, cfg.pad_token_id)})
            if probes is not None:
                curve["probes"].append({"step": done, **probes.run(model)})
            model.train()
        if done % tc.checkpoint_every == 0 or done in (tc.steps, until):
            curve["seconds"] = time.time() - t0
            save_checkpoint(ck, model, opt, curve, done, tc)
            write_curve(curve, out)
    model.eval()
    return model, curve


def save_checkpoint(path: Path, model, opt, curve, step: int, tc: TrainConfig) -> None:
    atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "curve": curve, "step": step,
                 "config": asdict(tc)}, path)


def atomic_save(obj, path: Path) -> None:
    """torch.save through a temporary file: a run killed while saving keeps its last checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_curve(curve: dict, out: Path) -> None:
    """``out/loss_curve.json`` and ``out/loss_curve.png``: the loss panel and, once probes ran,
    the probe panels (repeat accuracy per gap, value accuracy per distance, indexer recall)."""
    (out / "loss_curve.json").write_text(json.dumps(curve) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = curve.get("probes") or []
    if probes:
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
        ax = axes[0, 0]
        plot_probes(probes, axes[0, 1], axes[1, 0], axes[1, 1])
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    tr = curve["train"]
    if tr:
        k = max(1, len(tr) // 100)
        xs = [p["step"] for p in tr][k - 1::k]
        ys = np.convolve([p["loss"] for p in tr], np.ones(k) / k, mode="valid")[::k]
        ax.plot(xs[:len(ys)], ys, label="train (all tokens, mean of %d steps)" % k)
    if curve["heldout"]:
        ax.plot([p["step"] for p in curve["heldout"]], [p["loss"] for p in curve["heldout"]], "o-", label="held-out (all tokens)")
        ax.plot([p["step"] for p in curve["heldout"]], [p["assistant_loss"] for p in curve["heldout"]], "s-",
                label="held-out (assistant tokens)")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=100)
    plt.close(fig)


def plot_probes(probes: list[dict], repeat_ax, value_ax, recall_ax) -> None:
    """Probe figures per eval step (``curve["probes"]``) as curves on three axes."""
    steps = [p["step"] for p in probes]
    for gap in probes[-1]["repeat"]:
        repeat_ax.plot(steps, [p["repeat"].get(gap, np.nan) for p in probes], "o-", label=f"gap {gap}")
    repeat_ax.set_title("repeat probe: top-1 on the repeat")
    for dist in probes[-1].get("value", {}):
        value_ax.plot(steps, [p.get("value", {}).get(dist, np.nan) for p in probes], "o-", label=f"~{dist} tokens")
    value_ax.set_title("value in the agent format: top-1 on the call's value tokens")
    for layer in probes[-1]["recall"]:
        gaps = list(probes[-1]["recall"][layer])
        far = gaps[-1]
        line, = recall_ax.plot(steps, [p["recall"].get(layer, {}).get(far, np.nan) for p in probes], "o-",
                               label=f"{layer}, gap {far}")
        recall_ax.plot(steps, [p["recall_chance"].get(layer, {}).get(far, np.nan) for p in probes], "--",
                       color=line.get_color(), label=f"{layer}, random top-k")
    recall_ax.set_title("indexer recall@k of the entry holding the copied token")
    for ax in (repeat_ax, value_ax, recall_ax):
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
