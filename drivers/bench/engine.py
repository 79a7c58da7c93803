"""``cedar bench engine``: Cedar's served engine against stock SGLang serving an ordinary model of
the same size, side by side in one run.

The stock model is a random Llama with Cedar's dims (hidden size, layers, heads, FFN, vocab,
MQA with one KV head of Cedar's latent width, the same tokenizer), served by SGLang's own
``LlamaForCausalLM`` with the same CPU flags. Servers alternate (Cedar, stock, Cedar by default)
so that drift in the machine's load shows up as the spread of the two Cedar runs.

Probes (every prompt fresh unless it is a hit; greedy; ``ignore_eos``):
- ``decode_b{B}_ctx{L}``: B concurrent requests with L-token prompts; output tokens/s of the batch
  over the interval in which all B are decoding (per-token stream timestamps);
- ``ttft_cold_{L}``: time to first token of one cold L-token prompt (median of repeats);
- ``hit_{P}_new{N}``: a P-token prefix served once, then P + N fresh tokens: its TTFT, and its
  ratio to a cold prompt of the same length.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cedar.backend.tokenizer import TOKENIZER_FILES
from .common import fresh_ids, machine_info, save_report, stream_body, stream_chunks, stream_generate

ENGINE_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                "--page-size", "2", "--chunked-prefill-size", "2048", "--max-total-tokens", "98304",
                "--max-running-requests", "16", "--mem-fraction-static", "0.5", "--stream-interval", "1",
                "--sleep-on-idle")


@dataclass(frozen=True)
class EngineGrid:
    decode: tuple[tuple[int, int], ...] = ((1, 512), (8, 512), (1, 8192), (8, 8192))  # (batch, context)
    decode_tokens: int = 48
    cold: tuple[int, ...] = (512, 2048, 8192)
    hits: tuple[tuple[int, int], ...] = ((4096, 16), (4096, 128))  # (prefix, new tokens)
    repeats: int = 3
    order: tuple[str, ...] = ("cedar", "stock", "cedar")


QUICK = EngineGrid(decode=((1, 256), (4, 256)), decode_tokens=24, cold=(256, 1024), hits=((1024, 16),),
                   repeats=2, order=("cedar", "stock"))


# ------------------------------------------------------------------ the stock twin
def write_llama_twin(model_dir: Path, out: Path) -> dict:
    """A random LlamaForCausalLM with the CED model's dims and tokenizer, in HF format."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cedar.backend.config import CEDConfig

    cfg = CEDConfig.load(model_dir)
    llama = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1,
                        head_dim=cfg.kv_latent_dim, max_position_embeddings=cfg.max_position_embeddings,
                        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, bos_token_id=cfg.bos_token_id,
                        eos_token_id=list(cfg.eos_token_ids), pad_token_id=cfg.pad_token_id,
                        tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama)
    model.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return {"architecture": "LlamaForCausalLM", "hidden_size": llama.hidden_size, "layers": llama.num_hidden_layers,
            "heads": llama.num_attention_heads, "kv_heads": 1, "head_dim": llama.head_dim,
            "intermediate_size": llama.intermediate_size, "vocab_size": llama.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters())}


@dataclass(frozen=True)
class StockServe:
    """Stock SGLang's server for a plain HF model (the ServerProcess interface of ServeConfig)."""

    model: str
    port: int
    host: str = "127.0.0.1"
    extra: tuple[str, ...] = field(default_factory=tuple)
    api_key = None  # the benchmark serves without one

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model, "--host", self.host,
                "--port", str(self.port), *self.extra]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "CEDAR_SGLANG_PLUGIN"}
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        return env


# ------------------------------------------------------------------ probes
def decode_rate(host: str, port: int, batch: int, context: int, tokens: int, vocab: int, seed: int) -> dict:
    """Output tokens/s of ``batch`` concurrent requests while all of them decode."""
    stamps = [[] for _ in range(batch)]  # per request: (arrival time, completion tokens so far)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body = stream_body(fresh_ids(seed + i, context, vocab), tokens)
            for t, chunk in stream_chunks(host, port, body, timeout=900):
                stamps[i].append((t, int(chunk["meta_info"]["completion_tokens"])))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    start = max(s[0][0] for s in stamps)  # every request has its first token
    end = min(s[-1][0] for s in stamps)  # no request has finished yet

    def count_at(s, t):
        return max([n for ts, n in s if ts <= t] or [0])

    done = sum(count_at(s, end) - count_at(s, start) for s in stamps)
    if end <= start or done == 0:
        raise RuntimeError(f"decode probe b{batch} ctx{context}: no interval with every request decoding")
    return {"tok_s": round(done / (end - start), 2), "window_s": round(end - start, 3), "tokens": done}


def ttft_ms(host: str, port: int, ids: list[int]) -> tuple[float, int]:
    sample = stream_generate(host, port, stream_body(ids))
    return sample.ttft_ms, sample.cached_tokens


def run_probes(srv, grid: EngineGrid, vocab: int, seed0: int) -> dict:
    host, port, out = srv.cfg.host, srv.cfg.port, {}
    ttft_ms(host, port, fresh_ids(seed0, 64, vocab))  # warm-up
    for batch, context in grid.decode:
        runs = [decode_rate(host, port, batch, context, grid.decode_tokens, vocab, seed0 + 1000 * r + 100 * batch
                            + context) for r in range(max(1, grid.repeats - 1))]
        out[f"decode_b{batch}_ctx{context}"] = {"tok_s": float(np.median([r["tok_s"] for r in runs])), "runs": runs}
        print(f"[bench engine]   decode b{batch} ctx{context}: {out[f'decode_b{batch}_ctx{context}']['tok_s']} tok/s",
              flush=True)
    for L in grid.cold:
        times = [ttft_ms(host, port, fresh_ids(seed0 + 50_000 + 10 * L + r, L, vocab))[0] for r in range(grid.repeats)]
        out[f"ttft_cold_{L}"] = {"ms": round(float(np.median(times)), 2), "runs_ms": [round(t, 2) for t in times]}
        print(f"[bench engine]   cold TTFT {L}: {out[f'ttft_cold_{L}']['ms']} ms", flush=True)
    for P, N in grid.hits:
        hit, cold, cached = [], [], []
        for r in range(grid.repeats):
            prefix = fresh_ids(seed0 + 70_000 + 10 * P + r, P, vocab)
            ttft_ms(host, port, prefix + fresh_ids(seed0 + 80_000 + r, 32, vocab))  # P enters the cache
            t, c = ttft_ms(host, port, prefix + fresh_ids(seed0 + 90_000 + N + r, N, vocab))
            hit.append(t)
            cached.append(c)
            cold.append(ttft_ms(host, port, fresh_ids(seed0 + 95_000 + N + r, P + N, vocab))[0])
        out[f"hit_{P}_new{N}"] = {"ms": round(float(np.median(hit)), 2), "cold_ms": round(float(np.median(cold)), 2),
                                  "of_cold": round(float(np.median(hit) / np.median(cold)), 3),
                                  "cached_tokens": cached, "runs_ms": [round(t, 2) for t in hit]}
        print(f"[bench engine]   hit {P}+{N}: {out[f'hit_{P}_new{N}']['ms']} ms "
              f"({out[f'hit_{P}_new{N}']['of_cold']} of cold)", flush=True)
    return out


# ------------------------------------------------------------------ the table
def _value(probe: dict) -> float:
    return probe["tok_s"] if "tok_s" in probe else probe["ms"]


def table(runs: list[dict]) -> list[dict]:
    """One row per probe: Cedar's runs, stock's, and Cedar / stock (>1 = Cedar better)."""
    cedar = [r["probes"] for r in runs if r["engine"] == "cedar"]
    stock = [r["probes"] for r in runs if r["engine"] == "stock"]
    rows = []
    for name in cedar[0]:
        c, s = [_value(p[name]) for p in cedar], float(np.median([_value(p[name]) for p in stock]))
        higher_better = name.startswith("decode")
        ratio = [round((v / s) if higher_better else (s / v), 3) for v in c]
        row = {"probe": name, "unit": "tok/s" if higher_better else "ms", "cedar": c, "stock": s,
               "cedar_advantage": ratio}
        if name.startswith("hit"):
            row["cedar_of_cold"] = [p[name]["of_cold"] for p in cedar]
            row["stock_of_cold"] = float(np.median([p[name]["of_cold"] for p in stock]))
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| probe | Cedar | stock SGLang, same-dims Llama | Cedar advantage |", "|---|---|---|---|"]
    for r in rows:
        c = " / ".join(f"{v:g}" for v in r["cedar"])
        a = " / ".join(f"{v:.2f}x" for v in r["cedar_advantage"])
        extra = f" ({'/'.join(f'{v:.2f}' for v in r['cedar_of_cold'])} of cold vs {r['stock_of_cold']:.2f})" \
            if "cedar_of_cold" in r else ""
        lines.append(f"| {r['probe']} ({r['unit']}) | {c}{extra} | {r['stock']:g} | {a} |")
    return "\n".join(lines)


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(rows))
    lo = [min(r["cedar_advantage"]) for r in rows]
    hi = [max(r["cedar_advantage"]) for r in rows]
    ax.bar(x, hi, color=["tab:green" if v >= 1 else "tab:red" for v in lo], alpha=0.8)
    ax.bar(x, lo, color="none", edgecolor="black")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [r["probe"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("Cedar advantage over stock (x; >1 better)")
    ax.set_title("Cedar vs stock SGLang, same-dims Llama, same CPU flags")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def run_engine_benchmark(model_dir: Path, out_json, plot_png=None, grid: EngineGrid = EngineGrid()) -> dict:
    import sglang

    from cedar.backend.config import CEDConfig
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    cfg = CEDConfig.load(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="cedar-llama-twin-"))
    t0 = time.perf_counter()
    try:
        twin = write_llama_twin(model_dir, tmp)
        report = {"machine": machine_info(), "sglang_version": sglang.__version__,
                  "cedar_model": {"dir": str(model_dir), "name": cfg.name, "hidden_size": cfg.hidden_size,
                                  "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                                  "latent": cfg.kv_latent_dim, "intermediate_size": cfg.intermediate_size,
                                  "vocab_size": cfg.vocab_size},
                  "stock_model": twin, "grid": {k: getattr(grid, k) for k in grid.__dataclass_fields__},
                  "runs": [], "notes": [
                      "Same SGLang server flags for both engines (server_argv per run); servers alternate in "
                      "grid.order, one at a time; the client runs on the same 2 cores.",
                      "decode tok/s: output tokens of the batch per second over the interval in which every "
                      "request of the batch is decoding (stream timestamps, --stream-interval 1).",
                      "TTFT: a streamed /generate to its first data line. Cedar advantage: stock / Cedar for "
                      "times, Cedar / stock for rates."]}
        for k, engine in enumerate(grid.order):
            port = free_port()
            serve = (ServeConfig(model=str(model_dir), port=port, extra=ENGINE_FLAGS) if engine == "cedar"
                     else StockServe(model=str(tmp), port=port, extra=ENGINE_FLAGS))
            print(f"[bench engine] run {k + 1}/{len(grid.order)}: {engine}", flush=True)
            with ServerProcess(serve, log_path=Path(f"/tmp/cedar-bench-engine-{engine}-{port}.log")) as srv:
                probes = run_probes(srv, grid, cfg.vocab_size, seed0=10_000_000 * (k + 1))
                run = {"engine": engine, "server_argv": serve.argv()[1:], "probes": probes}
                if engine == "cedar":  # the model's own share of each step (the rest is SGLang's)
                    run["model_forward_ms"] = srv.cedar_state()["forward_ms"]
            report["runs"].append(run)
        report["table"] = table(report["runs"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save_report(report, out_json, plot_png, plot)
    return report
