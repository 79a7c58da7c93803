"""`cedar fidelity`: what bounded replay and decoder narrowing cost in quality, measured through the
served path (a real `cedar serve`, modes flipped at run time with `/set_internal_state`).

Three modes (the server runs exact replay without narrowing: exact is the no-approximation
reference), and each approximation is compared with the mode that lacks only it:

    exact              replay the whole prefix on a hit, narrowing off
    bounded            replay the last min(W, H) tokens, narrowing off  -> bounded replay vs exact
    bounded+narrowed   bounded, and the decoder on the prompt's last W rows -> narrowing vs bounded
                       (the serving default; also reported against exact)

A case is a held-out session S (its tokens, as the endpoint sends them), a prompt end P at the
start of an assistant turn and a hit H (the radix tree holds S[:H]): H = P - NEW, the hit the
previous turn leaves, or H = W (the first bucket). Per case and mode,
on a flushed cache with snapshots off: the prefix request S[:H] (1 token); then

- greedy: S[:P] decoding 64 tokens (greedy agreement with the reference, position by position);
- gold: snapshots on, S[:P] (1 token, the hit prefill whose state is kept), then S[:P + G] with
  prompt logprobs over the gold tokens S[P:P + G]: that request restores the kept state (nothing
  replayed), so its next-token distributions are those the hit prefill left. From them: KL(ref ||
  mode) per gold position over the reference's TOP most likely tokens (see `kl`; the report gives
  the mass they cover), and the change of the gold log-likelihood.

Zero-difference controls: hits with H <= W (bounded replays the whole prefix: bit-identical), and
snapshot continuations (a cold S[:P], then S[:P + G] restored: no replay in any mode).
Task success with and without hits: held-out ReAct / recall tasks run with snapshots on (every
next turn continues exactly) and off (every next turn is a hit, replayed in the mode).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from .evaluate import run_tasks

W = 128
G = 64  # gold / greedy tokens after the prompt
TOP = 20  # next-token candidates per position the KL is taken over (the reference's most likely)
NEW = 64  # tokens of a case's prompt past its hit
MODES = {"exact": {"cedar_replay_exact": 1, "cedar_narrow": 0},
         "bounded": {"cedar_replay_exact": 0, "cedar_narrow": 0},
         "bounded+narrowed": {"cedar_replay_exact": 0, "cedar_narrow": 1}}
# (approximation, mode, its reference): each approximation against the mode without it
COMPARISONS = (("bounded replay", "bounded", "exact"), ("narrowing", "bounded+narrowed", "bounded"),
               ("both (the default)", "bounded+narrowed", "exact"))
BUCKETS = (("H<=W", 0, W), ("W<H<=4W", W, 4 * W), ("H>4W", 4 * W, 1 << 30))


class Server:
    """The few HTTP calls the report needs, on a `ServerProcess`-like object with `post`."""

    def __init__(self, srv, vocab: int) -> None:
        self.srv, self.vocab = srv, vocab

    def mode(self, name: str, snapshots: bool) -> None:
        self._ok(self.srv.post("/set_internal_state", {"server_args": {**MODES[name], "cedar_snapshots": int(snapshots)}}))

    def flush(self) -> None:
        self.srv.flush_cache()

    def generate(self, ids: list[int], new: int, **extra) -> dict:
        return self._ok(self.srv.post("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True}, **extra}))

    def gold(self, ids: list[int], P: int) -> tuple[dict, np.ndarray, dict]:
        """Prompt logprobs of ids[P:]: per gold position the TOP most likely next tokens with their
        logprobs ({"ids": (n, TOP), "lp": (n, TOP)}) and (n,) logprobs of the gold tokens."""
        out = self.generate(ids, 1, return_logprob=True, logprob_start_len=P - 1, top_logprobs_num=TOP)
        meta = out["meta_info"]
        n = len(ids) - P
        tops = meta["input_top_logprobs"][-n:]
        dist = {"ids": np.array([[tid for _, tid, *_ in row] for row in tops], dtype=np.int64),
                "lp": np.array([[lp for lp, *_ in row] for row in tops], dtype=np.float64)}
        gold = np.array([lp for lp, *_ in meta["input_token_logprobs"][-n:]], dtype=np.float64)
        return dist, gold, meta

    @staticmethod
    def _ok(res):
        status, body = res
        if status != 200:
            raise RuntimeError(f"server answered {status}: {str(body)[:300]}")
        return body


def cases(sessions: list[list[int]], assistant_id: int, per_bucket: int, seed: int) -> list[dict]:
    """(session, P, H, bucket) with P just after an `<|assistant|>` marker, P + G inside the
    session, H = P - NEW even; up to ``per_bucket`` per bucket, drawn reproducibly."""
    rng = random.Random(seed)
    pool: dict[str, list[dict]] = {b[0]: [] for b in BUCKETS}
    for s, ids in enumerate(sessions):
        for P in [i + 1 for i, t in enumerate(ids) if t == assistant_id]:
            P -= P % 2
            if P + G > len(ids):
                continue
            # the hit a previous turn leaves (NEW tokens back), and a hit of exactly W tokens
            for H in {P - NEW, W}:
                for name, lo, hi in BUCKETS:
                    if lo < H <= hi and H <= P - NEW:
                        pool[name].append({"session": s, "P": P, "H": H, "bucket": name})
    out = []
    for name in pool:
        rng.shuffle(pool[name])
        seen, picked = set(), []
        for c in pool[name]:  # one case per session first, for spread
            if c["session"] not in seen:
                seen.add(c["session"])
                picked.append(c)
        out += picked[:per_bucket]
    return out


def run_case(server: Server, ids: list[int], case: dict, mode: str, hit: bool = True) -> dict:
    """One case in one mode: greedy tokens, gold distributions, and what the server did."""
    P, H = case["P"], case["H"]
    server.flush()
    server.mode(mode, snapshots=False)
    if hit:
        server.generate(ids[:H], 1)
    greedy = server.generate(ids[:P], G)
    server.flush()
    if hit:
        server.generate(ids[:H], 1)
    server.mode(mode, snapshots=True)
    first = server.generate(ids[:P], 1)
    dist, gold, meta = server.gold(ids[:P + G], P)
    return {"greedy": greedy["output_ids"], "dist": dist, "gold": gold,
            "replayed": first["meta_info"].get("replayed_tokens"), "cached": first["meta_info"].get("cached_tokens"),
            "restored": meta.get("restored_tokens")}


def kl(ref: dict, other: dict) -> tuple[np.ndarray, np.ndarray]:
    """KL(ref || other) per position over ref's TOP most likely tokens (their mass renormalised
    out of nothing: the sum runs over those tokens only), and the mass those tokens cover.
    A token missing from other's TOP gets other's smallest listed logprob (an upper bound on its
    logprob: the term is then a lower bound). Identical inputs give exactly 0."""
    out = np.zeros(len(ref["lp"]))
    for j, (ids, lps) in enumerate(zip(ref["ids"], ref["lp"])):
        theirs = dict(zip(other["ids"][j].tolist(), other["lp"][j].tolist()))
        floor = min(theirs.values())
        q = np.array([theirs.get(t, floor) for t in ids.tolist()])
        out[j] = max(float((np.exp(lps) * (lps - q)).sum()), 0.0)
    return out, np.exp(ref["lp"]).sum(-1)


def compare(ref: dict, other: dict) -> dict:
    k, mass = kl(ref["dist"], other["dist"])
    agree = float(np.mean([a == b for a, b in zip(ref["greedy"], other["greedy"])]))
    same = all(np.array_equal(ref["dist"][x], other["dist"][x]) for x in ("ids", "lp")) and \
        np.array_equal(ref["gold"], other["gold"]) and ref["greedy"] == other["greedy"]
    return {"kl": k.tolist(), "mass": float(mass.mean()),
            "dll": float(other["gold"].sum() - ref["gold"].sum()) / len(ref["gold"]),
            "agree": agree, "identical": bool(same)}


def summarize(rows: list[dict]) -> dict:
    if not rows:
        return {"cases": 0}
    k = np.concatenate([r["kl"] for r in rows])
    return {"cases": len(rows), "kl_mean": float(k.mean()), "kl_p99": float(np.quantile(k, 0.99)),
            "top_mass": float(np.mean([r["mass"] for r in rows])),
            "dll_per_token_mean": float(np.mean([r["dll"] for r in rows])),
            "greedy_agreement": float(np.mean([r["agree"] for r in rows])),
            "identical_cases": int(sum(r["identical"] for r in rows))}


def fidelity_report(srv, sessions: list[list[int]], assistant_id: int, vocab: int, per_bucket: int,
                    tasks=None, seed: int = 0, log=print) -> dict:
    server = Server(srv, vocab)
    picked = cases(sessions, assistant_id, per_bucket, seed)
    table: dict = {}
    for i, case in enumerate(picked):
        ids = sessions[case["session"]]
        runs = {m: run_case(server, ids, case, m) for m in MODES}
        for label, m, ref in COMPARISONS:
            table.setdefault(label, {}).setdefault(case["bucket"], []).append(compare(runs[ref], runs[m]))
        case["replayed"] = {m: r["replayed"] for m, r in runs.items()}
        case["restored"] = {m: r["restored"] for m, r in runs.items()}
        if log:
            log(f"[fidelity] case {i + 1}/{len(picked)} {case['bucket']} H={case['H']} replayed {case['replayed']}")
    # NOTE: the snapshot control: a cold prompt, then its continuation restored (no replay in any mode)
    controls = []
    for case in picked[:: max(1, len(picked) // 4)]:
        ids = sessions[case["session"]]
        runs = {m: run_case(server, ids, case, m, hit=False) for m in ("exact", "bounded")}
        controls.append(compare(runs["exact"], runs["bounded"]) | {"restored": runs["bounded"]["restored"]})
    report = {"W": W, "G": G, "top": TOP, "new_tokens": NEW, "modes": MODES,
              "approximations": {m: {b: summarize(rows) for b, rows in per.items()} for m, per in table.items()},
              "snapshot_continuation": summarize(controls) | {"restored": [c["restored"] for c in controls]},
              "cases": picked}
    if tasks:
        report["tasks"] = task_modes(server, srv, tasks, log)
    server.mode("bounded+narrowed", snapshots=True)  # the serving default again
    return report


def task_modes(server: Server, srv, tasks, log) -> dict:
    """Held-out task success: snapshots on (no hit replays), and off with each mode's replay."""
    from cedar.frontend.endpoint import CedarEndpoint

    backend = CedarEndpoint(srv.url)
    out = {}
    for label, mode, snaps in (("snapshots (no replay)", "bounded+narrowed", True),
                               ("bounded hits, narrowed", "bounded+narrowed", False),
                               ("bounded hits", "bounded", False), ("exact hits", "exact", False)):
        server.flush()
        server.mode(mode, snapshots=snaps)
        res = run_tasks(backend, tasks, log=None)
        out[label] = {k: {"tasks": v["tasks"], "success": v["success"]} for k, v in res.items()}
        if log:
            log(f"[fidelity] tasks, {label}: {out[label]}")
    return out


def table_markdown(report: dict) -> str:
    lines = ["| approximation | hit bucket | cases | mean KL (nats) | p99 KL | Δ gold log-lik / token | greedy agreement (64 tok) | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for m, per in report["approximations"].items():
        for b, s in per.items():
            lines.append(f"| {m} | {b} | {s['cases']} | {s['kl_mean']:.2e} | {s['kl_p99']:.2e} | "
                         f"{s['dll_per_token_mean']:+.4f} | {s['greedy_agreement']:.3f} | {s['identical_cases']}/{s['cases']} |")
    s = report["snapshot_continuation"]
    lines.append(f"| snapshot continuation (bounded vs exact) | cold + restore | {s['cases']} | {s['kl_mean']:.2e} | "
                 f"{s['kl_p99']:.2e} | {s['dll_per_token_mean']:+.4f} | {s['greedy_agreement']:.3f} | "
                 f"{s['identical_cases']}/{s['cases']} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    buckets = [b[0] for b in BUCKETS]
    for m, per in report["approximations"].items():
        xs = [b for b in buckets if b in per]
        per = {b: v for b, v in per.items() if v["cases"]}
        axes[0].plot(xs, [max(per[b]["kl_mean"], 1e-12) for b in xs], "o-", label=f"{m}: mean")
        axes[0].plot(xs, [max(per[b]["kl_p99"], 1e-12) for b in xs], "x--", label=f"{m}: p99")
        axes[1].plot(xs, [per[b]["greedy_agreement"] for b in xs], "o-", label=m)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL(exact || mode), nats (1e-12 = identical)")
    axes[1].set_ylabel(f"greedy agreement over {G} tokens")
    axes[1].set_ylim(0, 1.05)
    for ax in axes:
        ax.set_xlabel("hit length")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


