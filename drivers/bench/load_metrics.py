"""What a closed-loop run measured (AgentX's definitions, ``../shared/notes/workloads.md``), the
workload's theoretical hit rate, and throughput read off a mode's Pareto curve at a floor.

- TTFT p50 / p90 over requests that generate (a prefill-only request has no first token).
- Output tokens/s = generated tokens / wall; total tokens/s adds every prompt token (cached
  input inflates it, so it is reported beside, never instead).
- P90 E2E-normalised interactivity: per generating request, seconds per output token = end-to-end
  latency / output tokens; the 90th percentile of that (the slow tail), inverted: tokens/s/user.
- Theoretical hit rate: for each request in send order, the longest prefix of its prompt that an
  infinite cache holds at that moment: the prompt and output of every request answered before it
  was sent (SGLang caches a finished request's prompt and all but its last output token), page
  aligned, at most ``len - 1`` (the last prompt token is always computed).
"""

from __future__ import annotations

import numpy as np

from .session_graph import Answered
from .traces import PrefixTrie, served_hit


def theoretical_hits(answered: list[Answered], page_size: int) -> list[int]:
    """Per request (index order), the tokens an infinite prefix cache serves it."""
    trie, hits = PrefixTrie(), [0] * len(answered)
    finished = sorted(answered, key=lambda a: a.done_s)
    k = 0
    for a in sorted(answered, key=lambda a: a.sent_s):
        while k < len(finished) and finished[k].done_s <= a.sent_s:
            f = finished[k]
            trie.insert(f.prompt + f.output[:-1])
            k += 1
        hits[a.index] = served_hit(trie, a.prompt, page_size)
    return hits


def run_metrics(answered: list[Answered], wall_s: float, page_size: int) -> dict:
    gen = [a for a in answered if a.output]
    ttft = np.array([a.ttft_s for a in gen]) * 1e3
    spt = np.array([a.e2e_s / len(a.output) for a in gen])
    prompt = sum(len(a.prompt) for a in answered)
    out = sum(len(a.output) for a in answered)
    cached = sum(a.cached for a in answered)
    theory = theoretical_hits(answered, page_size)
    return {
        "requests": len(answered), "generating_requests": len(gen), "wall_s": round(wall_s, 3),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 2), "ttft_ms_p90": round(float(np.percentile(ttft, 90)), 2),
        "output_tok_s": round(out / wall_s, 2), "total_tok_s": round((prompt + out) / wall_s, 2),
        "interactivity_p90": round(float(1.0 / np.percentile(spt, 90)), 3),
        "prompt_tokens": prompt, "output_tokens": out, "cached_tokens": cached,
        "measured_hit_rate": round(cached / prompt, 5), "theoretical_hit_rate": round(sum(theory) / prompt, 5),
        "requests_off_theory": sum(a.cached != h for a, h in zip(answered, theory)),
        "replayed_tokens": sum(a.replayed for a in answered), "restored_tokens": sum(a.restored for a in answered),
        "uncached_tokens": prompt - cached,
    }


def throughput_at_floor(points: list[tuple[float, float]], floor: float) -> float:
    """The most output tokens/s a mode's curve reaches with P90 interactivity >= ``floor``.

    ``points`` are (interactivity, output tok/s), one per concurrency. Between two neighbouring
    concurrencies the curve is taken as a straight line, so the answer may lie between measured
    points (where interactivity crosses the floor); 0 when no point reaches the floor."""
    pts = sorted(points, key=lambda p: -p[0])
    best = max((t for i, t in pts if i >= floor), default=0.0)
    for (i0, t0), (i1, t1) in zip(pts, pts[1:]):
        if i0 >= floor > i1:
            best = max(best, t0 + (t1 - t0) * (i0 - floor) / (i0 - i1))
    return round(best, 2)


def plot_pareto(panels: dict[str, dict[str, list[dict]]], floor: float, path) -> None:
    """One panel per workload: output tok/s against P90 interactivity, a curve per mode
    (points labelled with their concurrency), the floor as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (workload, modes) in zip(axes[0], panels.items()):
        for mode, rows in modes.items():
            rows = sorted(rows, key=lambda r: r["concurrency"])
            xs, ys = [r["interactivity_p90"] for r in rows], [r["output_tok_s"] for r in rows]
            ax.plot(xs, ys, marker="o", label=mode)
            for r, x, y in zip(rows, xs, ys):
                ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.axvline(floor, ls="--", c="grey", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("P90 E2E interactivity (output tok/s/user)")
        ax.set_ylabel("output tok/s")
        ax.set_title(workload)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
