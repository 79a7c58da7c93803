"""``cedar bench scheduler``: where a served decode step's time goes on SGLang's scheduler thread,
through a real ``cedar serve``: Cedar's forward (the native step, the Python around it), SGLang's
LM head, sampling, decode-slot allocation, result processing and streaming, receiving requests.

    cedar bench scheduler --json OUT [--model M] [--tokens 200] [--cases 1x512,8x512]

Per case (B concurrent streamed requests on C-token prompts, greedy): decode tokens/s with the
profiler off (the engine benchmark's probe, median of ``repeats``; each repeat also runs once with
every step on the server's threads, ``decode_threads`` 0 through the runtime switch, alternating,
so the report holds the one-thread decode's gain measured side by side), then the same requests again
with every server process sampling its own main thread (:mod:`cedar.backend.serving.stack_sampler`;
the prompts were prefilled by the unsampled runs, so the sampled window is nearly all decode).
The scheduler's samples are put in one bucket each (:data:`BUCKETS`, first match wins) and
reported as shares, with the frames that hold the most samples themselves. Shares, not times:
a sample lands at the next bytecode boundary (see the sampler's note), and sampling slows the
server a little, so the tok/s figures come from the unsampled runs.

With ``--ttft L[,L...]``, per prompt length L a request's fixed costs: ``requests`` cold prompts of
L fresh tokens sent one at a time (streamed, one output token, :data:`TTFT_GAP_S` apart), their
median time to first token unsampled, then the same again sampled: the scheduler's busy time per
request (its samples outside the idle wait, ``--sleep-on-idle``'s poll, times the period) and
those samples' buckets. TTFT less the scheduler's busy time is what the request spends in the
HTTP server, the tokenizer manager, the detokenizer and between them; the model's own share is
``cedar bench step``'s cold case.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time
from pathlib import Path

from cedar.backend.serving.launch import ServeConfig
from cedar.backend.serving.process import ServerProcess, free_port
from cedar.backend.serving.stack_sampler import ENV, PERIOD_S

from cedar.backend.serving.runtime import DECODE_THREADS_SWITCH

from .common import fresh_ids, set_switch
from .engine import ENGINE_FLAGS, SGLangClient, decode_rate

# (bucket, a frame the stack must hold); the first match names a sample's bucket
BUCKETS = (
    ("LM head (SGLang's LogitsProcessor)", "logits_processor.py:forward"),
    ("sampling", "sampler.py:forward"),
    ("Cedar: native decode step (C++)", "native_step.py:native_decode"),
    ("Cedar: Python around the kernels (plan, tables, pools, commit)", "served_model.py:forward"),
    ("SGLang: decode slot allocation", "schedule_batch.py:prepare_for_decode"),
    ("SGLang: batch scheduling", "scheduler.py:get_next_batch_to_run"),
    ("SGLang: results and streaming to the detokenizer", "scheduler.py:process_batch_result"),
    ("SGLang: forward set-up (ForwardBatch, model runner)", "scheduler.py:run_batch"),
    ("SGLang: receiving requests", "scheduler.py:ingest_requests"),
)
OTHER = "other scheduler loop"
SCHEDULER_FRAME = "scheduler.py:run_scheduler_process"
IDLE_FRAME = "scheduler.py:maybe_sleep_on_idle"  # the idle wait (`--sleep-on-idle`, which ENGINE_FLAGS pass)
TTFT_GAP_S = 0.05
# the buckets of a cold request: its prefill, as well as the scheduler's own work around it
TTFT_BUCKETS = (
    ("Cedar: prefill forward (Python and kernels)", "served_model.py:forward"),
    ("SGLang: prefill scheduling and slot allocation", "scheduler.py:get_next_batch_to_run"),
    ("SGLang: results and streaming to the detokenizer", "scheduler.py:process_batch_result"),
    ("SGLang: forward set-up and sampling", "scheduler.py:run_batch"),
    ("SGLang: receiving requests", "scheduler.py:ingest_requests"),
)


def read_stacks(path: Path) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        counts[stack] += int(n)
    return counts


def bucket_of(stack: str, buckets=BUCKETS) -> str:
    frames = set(stack.split(";"))
    return next((name for name, frame in buckets if frame in frames), OTHER)


def breakdown(counts: collections.Counter, top: int = 12, buckets=BUCKETS) -> dict:
    """Shares of the samples by bucket, and the frames that hold the most samples themselves."""
    total = sum(counts.values())
    if not total:
        raise ValueError("no samples to break down")
    shares: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for stack, n in counts.items():
        shares[bucket_of(stack, buckets)] += n
        own[stack.rsplit(";", 1)[-1]] += n
    return {"samples": total,
            "buckets": {name: round(shares[name] / total, 4) for name in [b for b, _ in buckets] + [OTHER]},
            "top_self_frames": [{"frame": f, "share": round(n / total, 4)} for f, n in own.most_common(top)]}


def busy_breakdown(counts: collections.Counter, requests: int, top: int = 12) -> dict:
    """The scheduler's samples of ``requests`` cold requests: its busy time per request (the
    samples outside the idle wait, times the sampling period) and the busy samples' buckets."""
    busy = collections.Counter({stack: n for stack, n in counts.items() if IDLE_FRAME not in stack.split(";")})
    return {"busy_ms_per_request": round(1000 * PERIOD_S * sum(busy.values()) / requests, 2),
            "idle_samples": sum(counts.values()) - sum(busy.values()), **breakdown(busy, top, TTFT_BUCKETS)}


def scheduler_stacks(directory: Path, timeout_s: float = 5.0) -> collections.Counter:
    """The samples of the scheduler process (the one whose stacks start in its entry point), once
    its sampler has seen the control file gone and written them."""
    deadline = time.monotonic() + timeout_s
    while True:
        for path in sorted(directory.glob("stacks-*.txt")):
            counts = read_stacks(path)
            if any(SCHEDULER_FRAME in stack for stack in counts):
                return counts
        if time.monotonic() > deadline:
            raise RuntimeError(f"no scheduler samples in {directory} (is the plugin loaded in the scheduler?)")
        time.sleep(10 * PERIOD_S)


def sampled(sample_dir: Path, run):
    """``run()`` with every server process sampling its stack: (its result, the scheduler's samples);
    the stack files are removed for the next window."""
    (sample_dir / "on").touch()
    try:
        result = run()
    finally:
        (sample_dir / "on").unlink()
    counts = scheduler_stacks(sample_dir)
    for done in sample_dir.glob("stacks-*.txt"):
        done.unlink()
    return result, counts


def ttft_case(client, sample_dir: Path, length: int, requests: int, vocab: int, seed: int) -> dict:
    """One ``--ttft`` length (see the module doc)."""
    def run(seed: int) -> list[float]:
        times = []
        for i in range(requests):
            time.sleep(TTFT_GAP_S)
            times.append(client.stream_generate(fresh_ids(seed + i, length, vocab), max_new_tokens=1).ttft_ms)
        return times

    times = run(seed)
    sampled_times, counts = sampled(sample_dir, lambda: run(seed + requests))  # NOTE: fresh prompts again
    return {"case": f"cold ttft {length}", "prompt_tokens": length, "requests": requests,
            "ttft_ms": round(statistics.median(times), 2), "ttft_ms_runs": [round(t, 2) for t in times],
            "ttft_ms_while_sampled": round(statistics.median(sampled_times), 2),
            "scheduler": busy_breakdown(counts, requests)}


def run_scheduler_bench(model_dir: Path, cases: tuple[tuple[int, int], ...] = ((1, 512), (8, 512)),
                        tokens: int = 200, repeats: int = 2, log=print, flags=None, ttft: tuple[int, ...] = (),
                        ttft_requests: int = 30) -> dict:
    """flags: the server's ServingFlags (None: the defaults). ttft: prompt lengths of the cold
    requests' cases (see the module doc), ``ttft_requests`` requests each."""
    from cedar.backend.config import CEDConfig

    vocab = CEDConfig.load(model_dir).vocab_size
    port = free_port()
    sample_dir = Path(f"/tmp/cedar-stacks-{port}")
    sample_dir.mkdir(parents=True, exist_ok=True)
    for old in sample_dir.glob("*"):
        old.unlink()
    cfg = ServeConfig(model=str(model_dir), port=port, extra=ENGINE_FLAGS, **({} if flags is None else {"flags": flags}))
    saved = os.environ.get(ENV)
    os.environ[ENV] = str(sample_dir)  # NOTE: the server's processes inherit it (ServeConfig.env)
    report = {"model": str(model_dir), "server_argv": cfg.argv()[1:], "flags": dataclasses.asdict(cfg.flags),
              "tokens": tokens, "repeats": repeats,
              "cases": []}
    try:
        with ServerProcess(cfg, log_path=sample_dir / "server.log") as srv:
            client = SGLangClient(cfg.host, cfg.port)
            decode_rate(client, 1, 64, 16, vocab, seed=7)  # warm-up
            for batch, context in cases:
                seed = 1000 * batch + context
                rates, server_threads = [], []
                for _ in range(repeats):  # NOTE: the server's setting (one decode thread) last, as sampled
                    for one, out in ((False, server_threads), (True, rates)):
                        set_switch(srv, DECODE_THREADS_SWITCH, one)
                        out.append(decode_rate(client, batch, context, tokens, vocab, seed)["tok_s"])
                while_sampled, counts = sampled(sample_dir,
                                                lambda: decode_rate(client, batch, context, tokens, vocab, seed)["tok_s"])
                tok_s = statistics.median(rates)
                case = {"case": f"decode b{batch} ctx{context}", "batch": batch, "context": context,
                        "tok_s": tok_s, "tok_s_runs": rates, "ms_per_step": round(1000 * batch / tok_s, 2),
                        "tok_s_decode_on_server_threads": statistics.median(server_threads),
                        "tok_s_runs_decode_on_server_threads": server_threads,
                        "tok_s_while_sampled": while_sampled, "scheduler": breakdown(counts)}
                report["cases"].append(case)
                log(f"[bench scheduler] {case['case']}: {case['tok_s']} tok/s ({case['ms_per_step']} ms a step; every "
                    f"step on the server's threads: {case['tok_s_decode_on_server_threads']} tok/s); "
                    + ", ".join(f"{k} {v:.0%}" for k, v in case["scheduler"]["buckets"].items() if v >= 0.02))
            report["ttft_cases"] = []
            for length in ttft:
                case = ttft_case(client, sample_dir, length, ttft_requests, vocab, 50_000 + 1000 * length)
                report["ttft_cases"].append(case)
                sched = case["scheduler"]
                log(f"[bench scheduler] {case['case']}: TTFT {case['ttft_ms']} ms, the scheduler busy "
                    f"{sched['busy_ms_per_request']} ms a request (sampled: TTFT {case['ttft_ms_while_sampled']} ms); "
                    + ", ".join(f"{k} {v:.0%}" for k, v in sched["buckets"].items() if v >= 0.02))
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
    return report


def plot_report(report: dict, png: Path) -> None:
    """One bar a case: the scheduler thread's samples by bucket, stacked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [b for b, _ in BUCKETS] + [OTHER]
    cases = report["cases"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    left = [0.0] * len(cases)
    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(names):
        shares = [c["scheduler"]["buckets"][name] for c in cases]
        ax.barh([f"{c['case']}\n{c['tok_s']:.0f} tok/s" for c in cases], shares, left=left, label=name,
                color=colors[i % len(colors)])
        left = [a + b for a, b in zip(left, shares)]
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the scheduler thread's samples")
    ax.set_title("cedar bench scheduler: a served decode step on SGLang's scheduler thread")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
