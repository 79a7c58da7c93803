"""``cedar bench prefill``: TTFT of cold prefills with decoder narrowing on vs off, on the real
SGLang server (one server; the ``cedar_narrow`` switch flips the mode between requests), beside
the analytic upper bound on the speedup for the served config (:mod:`flops`).

Per prompt length, modes are interleaved repeat by repeat so that load from other processes on
a shared CPU falls on both alike; every prompt is fresh (nothing cached), one request at a time
(the seed's low-concurrency TTFT claim).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .flops import flop_estimate, narrowing_speedup_bound
from .common import fresh_ids, machine_info, save_report, set_switch, stream_body, stream_generate

MODES = ("narrow_on", "narrow_off")


def measure(srv, prompt_len: int, repeats: int, vocab_size: int, seed0: int) -> dict:
    ttft = {m: [] for m in MODES}
    for rep in range(repeats):
        for i, mode in enumerate(MODES):
            set_switch(srv, "cedar_narrow", mode == "narrow_on")
            ids = fresh_ids(seed0 + 2 * rep + i, prompt_len, vocab_size)
            sample = stream_generate(srv.cfg.host, srv.cfg.port, stream_body(ids))
            if sample.cached_tokens:
                raise RuntimeError(f"a fresh prompt hit the cache ({sample.cached_tokens} tokens)")
            ttft[mode].append(sample.ttft_ms)
    row = {"prompt_len": prompt_len}
    for m in MODES:
        row[m] = {"median_ms": round(float(np.median(ttft[m])), 2),
                  "p90_ms": round(float(np.percentile(ttft[m], 90)), 2), "ttft_ms": [round(t, 2) for t in ttft[m]]}
    row["speedup_median"] = round(row["narrow_off"]["median_ms"] / row["narrow_on"]["median_ms"], 3)
    return row


def plot(table: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, m in enumerate(MODES):
        ax.bar(x + (k - 0.5) * 0.38, [r[m]["median_ms"] for r in table], 0.38, label=m,
               yerr=[[0] * len(table), [r[m]["p90_ms"] - r[m]["median_ms"] for r in table]])
    for i, r in enumerate(table):
        ax.annotate(f"x{r['speedup_median']} (bound x{r['upper_bound']})", (i, r["narrow_off"]["median_ms"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [str(r["prompt_len"]) for r in table])
    ax.set_xlabel("prompt tokens (cold)")
    ax.set_ylabel("TTFT ms (median, whisker p90)")
    ax.set_title("Decoder narrowing: TTFT on vs off (SGLang server, CPU)")
    ax.margins(y=0.2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def run_prefill_benchmark(model_dir, out_json, plot_png=None, prompt_lens=(512, 2048, 8192), repeats=5) -> dict:
    import sglang

    from cedar.backend.config import CEDConfig
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    cfg = CEDConfig.load(Path(model_dir))
    longest = max(prompt_lens) + 16
    flags = ("--context-length", str(max(longest, 4096)), "--chunked-prefill-size", str(longest),
             "--max-prefill-tokens", str(longest), "--max-total-tokens", str(4 * longest * (repeats + 1)),
             "--stream-interval", "1")
    serve = ServeConfig(model=str(model_dir), port=free_port(), extra=flags)
    report = {"machine": machine_info(), "sglang_version": sglang.__version__,
              "model": {"dir": str(model_dir), "name": cfg.name, "layers": cfg.num_hidden_layers,
                        "decoder_start": cfg.decoder_start, "window": cfg.sliding_window},
              "server_flags": serve.argv()[3:], "repeats": repeats, "table": [],
              "notes": ["TTFT = send a streamed /generate to its first data: line; one request at a time; fresh "
                        "prompts (no cache hit); modes interleaved per repeat via /set_internal_state cedar_narrow.",
                        "--chunked-prefill-size = longest prompt: each prefill is one forward.",
                        "upper_bound = max(ratio of layer-rows run, ratio of entries scored by the indexers) untrimmed "
                        "vs narrowed (drivers/bench/flops.py): holds whatever each term costs in this implementation.",
                        "flop_estimate = untrimmed / narrowed prefill FLOPs (time proportional to FLOPs); the torch "
                        "twins' top-k sorts and masks cost more than their FLOPs, so measured speedups can exceed it."]}
    t0 = time.perf_counter()
    with ServerProcess(serve, log_path=Path(f"/tmp/cedar-bench-prefill-{serve.port}.log")) as srv:
        stream_generate(srv.cfg.host, srv.cfg.port, stream_body(fresh_ids(1, 64, cfg.vocab_size)))  # warm-up
        for i, P in enumerate(prompt_lens):
            row = measure(srv, P, repeats, cfg.vocab_size, seed0=1000 * (i + 1))
            row["upper_bound"] = round(narrowing_speedup_bound(cfg, P), 3)
            row["flop_estimate"] = round(flop_estimate(cfg, P), 3)
            report["table"].append(row)
            print(f"[bench prefill] P={P}: on {row['narrow_on']['median_ms']} / {row['narrow_on']['p90_ms']} ms, "
                  f"off {row['narrow_off']['median_ms']} / {row['narrow_off']['p90_ms']} ms, "
                  f"speedup x{row['speedup_median']} (upper bound x{row['upper_bound']}, FLOP estimate "
                  f"x{row['flop_estimate']})", flush=True)
        set_switch(srv, "cedar_narrow", True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save_report(report, out_json, plot_png, plot)
    return report
