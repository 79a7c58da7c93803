"""What the server's tokenization of a chat costs a model trained on sessions cut at their gens.

A frontend program carries each gen's tokens forward (a call's name and arguments are tokens of
their own); the server tokenizes an OpenAI-API chat's history whole, so merges cross a call's
edges (`"}` + `}` becomes `"}}`). For every assistant message that follows an earlier call, this
scores the message after the history tokenized both ways, with the reference model (dense maths,
cold), and reports the summed negative log-likelihood (nats) of each and their difference per
message. A message's score is its text's: the probability of its two tokenizations (cut and
whole) summed, since a served model writes whichever it prefers.

    python scripts/tokenization_gap.py MODEL_DIR SESSIONS.jsonl [--kinds function-calling]
        [--limit 40] [--json OUT]

SESSIONS.jsonl: a run's `corpus/heldout_sessions.jsonl` (`cedar train`), one {"kind", "text"} a
line. Single-threaded, about two minutes for 40 held-out function-calling sessions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from cedar.backend.chat_template import TOOL_CALL_END
from cedar.backend.model_io import load_model
from cedar.backend.tokenizer import END, ROLE_MARKERS
from cedar.training.corpus.build import encode_session
from cedar.training.dense import DenseForward, Plan

ASSISTANT = ROLE_MARKERS["assistant"]


def message_nll(fwd: DenseForward, history: list[int], message: list[int]) -> float:
    """Summed next-token NLL (nats) of `message` after `history` (one row, padded to the window:
    the training forward takes whole window blocks)."""
    ids = history + message
    T = len(ids)
    pad = (-T) % fwd.cfg.sliding_window
    row = torch.tensor([ids + [0] * pad])
    doc = torch.tensor([[0] * T + [-1] * pad])
    with torch.no_grad():
        logits, _ = fwd.run(row, doc, Plan())
    return float(F.cross_entropy(logits[0, len(history) - 1:T - 1].float(), row[0, len(history):T], reduction="sum"))


def gap(model_dir: Path, sessions: list[dict], max_tokens: int = 4096) -> dict:
    """{"cut": {...}, "whole": {...}, "per_message": [whole - cut, ...]} over `sessions`: each mode
    is the history's tokenization (cut at gens, or whole)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    fwd = DenseForward(load_model(model_dir, quantize=False))
    scored = []  # per message: {"cut": nll, "whole": nll}
    for s in sessions:
        text = s["text"]
        first_call = text.find(TOOL_CALL_END)
        start = text.find(ASSISTANT, first_call) if first_call >= 0 else -1
        while start >= 0:
            body = start + len(ASSISTANT)
            end = text.find(END, body)
            end = len(text) if end < 0 else end + len(END)
            msg = {"kind": s["kind"], "text": text[body:end]}
            messages = {tuple(encode_session(tok, msg, whole=w)[0]) for w in (False, True)}
            head = {"kind": s["kind"], "text": text[:body]}
            if len(encode_session(tok, head)[0]) + max(map(len, messages)) > max_tokens:
                break
            scored.append({})
            for mode in ("cut", "whole"):
                history = encode_session(tok, head, whole=mode == "whole")[0]
                scores = torch.tensor([-message_nll(fwd, history, list(m)) for m in messages])
                scored[-1][mode] = -float(torch.logsumexp(scores, 0))
            start = text.find(ASSISTANT, end)
    n, diffs = len(scored), [m["whole"] - m["cut"] for m in scored]
    sums = {mode: sum(m[mode] for m in scored) for mode in ("cut", "whole")}
    return {"messages": n,
            "cut": {"nll": round(sums["cut"], 2), "per_message": round(sums["cut"] / max(n, 1), 3)},
            "whole": {"nll": round(sums["whole"], 2), "per_message": round(sums["whole"] / max(n, 1), 3)},
            "whole_minus_cut": {"mean": round(statistics.mean(diffs), 3) if diffs else None,
                                "median": round(statistics.median(diffs), 3) if diffs else None,
                                "worse_whole": sum(d > 0.01 for d in diffs), "worse_cut": sum(d < -0.01 for d in diffs)},
            "per_message": [round(d, 4) for d in diffs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("sessions", type=Path)
    p.add_argument("--kinds", nargs="+", default=["function-calling"])
    p.add_argument("--limit", type=int, default=40, help="at most this many sessions")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sessions = [s for s in map(json.loads, args.sessions.open()) if s["kind"] in args.kinds][:args.limit]
    report = {"model": str(args.model), "sessions": str(args.sessions), "kinds": args.kinds,
              "session_count": len(sessions), **gap(args.model, sessions)}
    print(json.dumps({k: v for k, v in report.items() if k != "per_message"}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
