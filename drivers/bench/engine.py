"""``cedar bench engine``: Cedar's served engine against the engines a CPU user would pick instead,
each serving an ordinary model of the same size, side by side in one run.

The twin is a random Llama with Cedar's dims (hidden size, layers, heads, FFN, vocab, MQA with one
KV head of Cedar's latent width, the same tokenizer). Stock SGLang serves it with its own
``LlamaForCausalLM`` and the same CPU flags; the peers installed by ``make peers`` (peers.py) serve
it too: vLLM's CPU build (the HF dir) and llama.cpp's ``llama-server`` (a GGUF written from it).
Servers alternate, one at a time (by default Cedar, stock, each installed peer, Cedar), so that
drift in the machine's load shows up as the spread of the Cedar runs. A peer named in the order
but not installed (or failing) is recorded as not run, with the reason; the run goes on.

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
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from cedar.backend.tokenizer import TOKENIZER_FILES
from .common import (OUTPUT_LEN, Sample, fresh_ids, machine_info, save_report, stream_body, stream_chunks,
                     stream_generate)
from .peers import (PEER_NAMES, PEERS_ROOT, EngineClient, LlamaCppClient, LlamaCppServe, PeerProcess, PeerStatus,
                    VllmClient, VllmServe, detect_peers, write_gguf)

ENGINE_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                "--page-size", "2", "--chunked-prefill-size", "2048", "--max-total-tokens", "98304",
                "--max-running-requests", "16", "--mem-fraction-static", "0.5", "--stream-interval", "1",
                "--sleep-on-idle")


ENGINES = ("cedar", "stock", *PEER_NAMES)
LABELS = {"cedar": "Cedar", "stock": "stock SGLang", "vllm": "vLLM CPU", "llamacpp": "llama.cpp"}


@dataclass(frozen=True)
class EngineGrid:
    decode: tuple[tuple[int, int], ...] = ((1, 512), (8, 512), (1, 8192), (8, 8192))  # (batch, context)
    decode_tokens: int = 48
    cold: tuple[int, ...] = (16, 512, 2048, 8192)  # 16: an engine's per-request floor
    hits: tuple[tuple[int, int], ...] = ((4096, 16), (4096, 128))  # (prefix, new tokens)
    repeats: int = 3
    order: tuple[str, ...] | None = None  # None: default_order() of the peers installed

    def __post_init__(self) -> None:
        unknown = [e for e in self.order or () if e not in ENGINES]
        if unknown:
            raise ValueError(f"EngineGrid.order names unknown engines {unknown}; known: {list(ENGINES)}")
        if self.order is not None and "cedar" not in self.order:
            raise ValueError("EngineGrid.order must run cedar at least once (every ratio is Cedar's)")

    @property
    def max_tokens_at_once(self) -> int:
        """The most tokens the probes hold in a server's cache at one time (all of a batch)."""
        return max([b * (L + self.decode_tokens) for b, L in self.decode] + [L + OUTPUT_LEN for L in self.cold]
                   + [P + N + OUTPUT_LEN for P, N in self.hits])


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


# ------------------------------------------------------------------ which engines run
def default_order(peers: dict[str, PeerStatus]) -> tuple[str, ...]:
    """Cedar, stock SGLang, each installed peer, Cedar again (its two runs bracket the others)."""
    return ("cedar", "stock", *[n for n in PEER_NAMES if peers[n].installed], "cedar")


def peer_records(order: tuple[str, ...], peers: dict[str, PeerStatus]) -> dict[str, dict]:
    """What the report says of every peer before any server starts: installed or not, version,
    executable, and why it will not run (None: it will; the run sets ``ran`` and ``argv``)."""
    out = {}
    for name, st in peers.items():
        why = st.why_not if not st.installed else (None if name in order else "not in grid.order")
        out[name] = {"installed": st.installed, "version": st.version, "executable": st.executable,
                     "ran": False, "why_not": why, "argv": None}
    return out


# ------------------------------------------------------------------ clients
@dataclass(frozen=True)
class SGLangClient:
    """SGLang's streamed ``/generate`` (Cedar and stock), in the peers' client shape."""

    host: str
    port: int

    def stream_chunks(self, ids: list[int], max_new_tokens: int, timeout: float = 900) -> Iterator[tuple[float, int]]:
        for t, chunk in stream_chunks(self.host, self.port, stream_body(ids, max_new_tokens), timeout=timeout):
            yield t, int(chunk["meta_info"]["completion_tokens"])

    def stream_generate(self, ids: list[int], max_new_tokens: int = OUTPUT_LEN) -> Sample:
        return stream_generate(self.host, self.port, stream_body(ids, max_new_tokens))


# ------------------------------------------------------------------ probes
def decode_rate(client: EngineClient, batch: int, context: int, tokens: int, vocab: int, seed: int) -> dict:
    """Output tokens/s of ``batch`` concurrent requests while all of them decode."""
    stamps = [[] for _ in range(batch)]  # per request: (arrival time, completion tokens so far)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for t, n in client.stream_chunks(fresh_ids(seed + i, context, vocab), tokens, timeout=900):
                stamps[i].append((t, n))
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


def ttft_ms(client: EngineClient, ids: list[int]) -> tuple[float, int]:
    sample = client.stream_generate(ids)
    return sample.ttft_ms, sample.cached_tokens


def run_probes(client: EngineClient, grid: EngineGrid, vocab: int, seed0: int) -> dict:
    """Every probe of the grid against one engine. NOTE: a probe that fails is an error for that
    probe (``{"error": ...}``), not for the engine's run: the other probes still run and count."""
    out = {}

    def probe(name: str, measure) -> None:
        try:
            out[name] = measure()
        except Exception as e:  # noqa: BLE001 - recorded, reported in the table as failed
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[bench engine]   {name} failed: {out[name]['error']}", flush=True)

    ttft_ms(client, fresh_ids(seed0, 64, vocab))  # warm-up
    for batch, context in grid.decode:
        def decode(batch=batch, context=context) -> dict:
            runs = [decode_rate(client, batch, context, grid.decode_tokens, vocab, seed0 + 1000 * r + 100 * batch
                                + context) for r in range(max(1, grid.repeats - 1))]
            res = {"tok_s": float(np.median([r["tok_s"] for r in runs])), "runs": runs}
            print(f"[bench engine]   decode b{batch} ctx{context}: {res['tok_s']} tok/s", flush=True)
            return res
        probe(f"decode_b{batch}_ctx{context}", decode)
    for L in grid.cold:
        def cold(L=L) -> dict:
            times = [ttft_ms(client, fresh_ids(seed0 + 50_000 + 10 * L + r, L, vocab))[0] for r in range(grid.repeats)]
            res = {"ms": round(float(np.median(times)), 2), "runs_ms": [round(t, 2) for t in times]}
            print(f"[bench engine]   cold TTFT {L}: {res['ms']} ms", flush=True)
            return res
        probe(f"ttft_cold_{L}", cold)
    for P, N in grid.hits:
        def hits(P=P, N=N) -> dict:
            hit, cold, cached = [], [], []
            for r in range(grid.repeats):
                prefix = fresh_ids(seed0 + 70_000 + 10 * P + r, P, vocab)
                ttft_ms(client, prefix + fresh_ids(seed0 + 80_000 + r, 32, vocab))  # P enters the cache
                t, c = ttft_ms(client, prefix + fresh_ids(seed0 + 90_000 + N + r, N, vocab))
                hit.append(t)
                cached.append(c)
                cold.append(ttft_ms(client, fresh_ids(seed0 + 95_000 + N + r, P + N, vocab))[0])
            res = {"ms": round(float(np.median(hit)), 2), "cold_ms": round(float(np.median(cold)), 2),
                   "of_cold": round(float(np.median(hit) / np.median(cold)), 3), "cached_tokens": cached,
                   "runs_ms": [round(t, 2) for t in hit]}
            print(f"[bench engine]   hit {P}+{N}: {res['ms']} ms ({res['of_cold']} of cold)", flush=True)
            return res
        probe(f"hit_{P}_new{N}", hits)
    return out


# ------------------------------------------------------------------ the table
def _value(probe: dict) -> float:
    return probe["tok_s"] if "tok_s" in probe else probe["ms"]


def _advantage(cedar: float, other: float, higher_better: bool) -> float:
    return round((cedar / other) if higher_better else (other / cedar), 3)


def table(runs: list[dict]) -> list[dict]:
    """One row per probe: Cedar's runs, every other engine's median (keyed by its name; None where
    its probe failed, listed in ``failed``), Cedar / stock (``cedar_advantage``) and Cedar / the
    best other engine of the probe (``best_peer``, ``cedar_vs_best``); >1 = Cedar better.
    ``engines``: those that ran, in ENGINES' order."""
    by = {e: [r["probes"] for r in runs if r["engine"] == e] for e in ENGINES}
    ran = [e for e in ENGINES if by[e]]
    cedar, others = by["cedar"], [e for e in ran if e != "cedar"]

    def ok(probes: list[dict], name: str) -> list[dict]:
        return [p[name] for p in probes if name in p and "error" not in p[name]]

    rows = []
    for name in cedar[0]:
        higher_better = name.startswith("decode")
        c = [_value(p) for p in ok(cedar, name)]
        row = {"probe": name, "unit": "tok/s" if higher_better else "ms", "engines": ran, "cedar": c}
        for e in others:
            vals = [_value(p) for p in ok(by[e], name)]
            row[e] = float(np.median(vals)) if vals else None
        failed = [e for e in ran if (row[e] if e != "cedar" else c) in (None, [])]
        if failed:
            row["failed"] = failed
        valid = [e for e in others if row[e] is not None]
        if "stock" in valid and c:
            row["cedar_advantage"] = [_advantage(v, row["stock"], higher_better) for v in c]
        if valid and c:
            best = (max if higher_better else min)(valid, key=lambda e: row[e])
            row["best_peer"] = best
            row["cedar_vs_best"] = [_advantage(v, row[best], higher_better) for v in c]
        if name.startswith("hit"):
            row["cedar_of_cold"] = [p["of_cold"] for p in ok(cedar, name)]
            for e in valid:
                row[f"{e}_of_cold"] = float(np.median([p["of_cold"] for p in ok(by[e], name)]))
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    others = [e for e in rows[0]["engines"] if e != "cedar"]
    head = ["probe", "Cedar", *[LABELS[e] + (", same-dims Llama" if e == "stock" else "") for e in others]]
    if "stock" in others:
        head.append("Cedar advantage")
    if others:
        head.append("Cedar vs best other")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = " / ".join(f"{v:g}" for v in r["cedar"]) or "failed"
        extra = f" ({'/'.join(f'{v:.2f}' for v in r['cedar_of_cold'])} of cold vs {r['stock_of_cold']:.2f})" \
            if r.get("cedar_of_cold") and "stock_of_cold" in r else ""
        cells = [f"{r['probe']} ({r['unit']})", f"{c}{extra}",
                 *["failed" if r[e] is None else f"{r[e]:g}" for e in others]]
        if "stock" in others:
            cells.append(" / ".join(f"{v:.2f}x" for v in r["cedar_advantage"]) if "cedar_advantage" in r else "-")
        if others:
            cells.append(" / ".join(f"{v:.2f}x" for v in r["cedar_vs_best"]) + f" ({LABELS[r['best_peer']]})"
                         if "cedar_vs_best" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_vs_cedar(row: dict) -> dict[str, float]:
    """Each engine's speed on the probe relative to Cedar's median (>1: faster than Cedar)."""
    higher_better = row["unit"] == "tok/s"
    if not row["cedar"]:
        return {e: float("nan") for e in row["engines"]}
    ref = float(np.median(row["cedar"]))
    return {e: (1.0 if e == "cedar" else float("nan") if row[e] is None else
                round((row[e] / ref) if higher_better else (ref / row[e]), 3)) for e in row["engines"]}


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    engines = rows[0]["engines"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x, width = np.arange(len(rows)), 0.8 / len(engines)
    colors = {"cedar": "tab:green", "stock": "tab:gray", "vllm": "tab:blue", "llamacpp": "tab:orange"}
    for j, e in enumerate(engines):
        speeds = [speed_vs_cedar(r)[e] for r in rows]
        ax.bar(x + (j - (len(engines) - 1) / 2) * width, speeds, width, label=LABELS[e], color=colors[e])
    ref = [float(np.median(r["cedar"])) if r["cedar"] else 1.0 for r in rows]  # Cedar's spread (machine drift)
    lo = [min([v / m if r["unit"] == "tok/s" else m / v for v in r["cedar"]] or [1.0]) for r, m in zip(rows, ref)]
    hi = [max([v / m if r["unit"] == "tok/s" else m / v for v in r["cedar"]] or [1.0]) for r, m in zip(rows, ref)]
    cx = x + (engines.index("cedar") - (len(engines) - 1) / 2) * width
    ax.errorbar(cx, [1.0] * len(rows), yerr=[np.subtract(1.0, lo), np.subtract(hi, 1.0)], fmt="none", ecolor="black")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([2.0 ** k for k in range(-6, 7)]))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(x, [r["probe"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed relative to Cedar (>1: faster)")
    ax.set_title("Cedar vs the CPU engines a user would pick instead (same-dims Llama)")
    ax.legend(fontsize=8, ncol=len(engines), loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# ------------------------------------------------------------------ the run
def stock_kernels_note() -> str:
    """How stock SGLang's layers run here: with sgl_kernel's CPU kernels or without (the stand-in)."""
    from importlib import metadata

    try:
        metadata.distribution("cedar-sgl-kernel-cpu-standin")
    except metadata.PackageNotFoundError:
        try:
            return f"Stock SGLang runs with sgl_kernel {metadata.version('sgl-kernel')}."
        except metadata.PackageNotFoundError:
            return "Stock SGLang runs without an sgl_kernel package."
    return ("Stock SGLang runs without sgl_kernel's CPU kernels: sgl_kernel is Cedar's CPU stand-in here, so "
            "every layer of its Llama takes the pure-torch forward_native path (attention: torch_native). "
            "The peers (vLLM CPU, llama.cpp) run their own native CPU kernels.")


PEER_DTYPES = {"float32": "f32", "bfloat16": "bf16"}  # the peers' dtype -> the GGUF's outtype


def peer_serve(engine: str, twin: Path, gguf: Path, port: int, grid: EngineGrid, peers: dict[str, PeerStatus],
               dtype: str = "float32"):
    """(server config, client) of one peer's run on the twin (its HF dir; llama.cpp: its GGUF,
    written in ``dtype``)."""
    if engine == "vllm":
        serve = VllmServe(model=str(twin), port=port, python=peers["vllm"].executable, dtype=dtype)
        return serve, VllmClient(serve.host, port, serve.model)
    # NOTE: one unified KV cache for all slots: it must hold a whole batch of the grid at once
    ctx = max(16384, -(-grid.max_tokens_at_once // 1024) * 1024)
    serve = LlamaCppServe(model=str(gguf), port=port, binary=peers["llamacpp"].executable, ctx_size=ctx)
    return serve, LlamaCppClient(serve.host, port)


def _peer_run(engine: str, record: dict, twin_dir: Path, port: int, grid: EngineGrid, peers: dict[str, PeerStatus],
              vocab: int, seed0: int, log: Path, dtype: str = "float32") -> dict:
    """One peer's run: its model (the GGUF written once, beside the twin's HF dir), its server
    (argv into ``record``) and the probes through its client."""
    gguf = twin_dir.parent / f"twin-{PEER_DTYPES[dtype]}.gguf"
    if engine == "llamacpp" and not gguf.exists():
        write_gguf(twin_dir, gguf, Path(peers["llamacpp"].executable).parents[1], outtype=PEER_DTYPES[dtype])
    serve, client = peer_serve(engine, twin_dir, gguf, port, grid, peers, dtype)
    record["argv"] = serve.argv()
    with PeerProcess(serve, log_path=log):
        return {"engine": engine, "server_argv": serve.argv(), "probes": run_probes(client, grid, vocab, seed0)}


def try_peer(engine: str, record: dict, attempt: Callable[[], dict], runs: list[dict], log: Path) -> None:
    """Run one peer's ``attempt`` (start its server, run the probes): its run goes into ``runs`` and
    ``record["ran"]`` becomes True; an Exception is recorded as ``record["why_not"]`` instead, and
    the benchmark goes on (KeyboardInterrupt and the like still stop it)."""
    try:
        run = attempt()
    except Exception as e:  # noqa: BLE001 - recorded in the report
        record["why_not"] = f"failed: {type(e).__name__}: {str(e)[:600]} (log: {log})"
        print(f"[bench engine]   {engine} failed: {record['why_not']}", flush=True)
        return
    runs.append(run)
    record["ran"] = True


def run_engine_benchmark(model_dir: Path, out_json, plot_png=None, grid: EngineGrid = EngineGrid(),
                         peers_root: Path = PEERS_ROOT, flags=None, peer_dtype: str = "float32") -> dict:
    """flags: Cedar's ServingFlags (they travel in its server_argv); None: the defaults.
    peer_dtype: the peers' weights and compute ("float32", or "bfloat16": vLLM's --dtype and
    llama.cpp's GGUF; the yardstick for Cedar's --weights bf16-matmul). Stock SGLang stays float32."""
    if peer_dtype not in PEER_DTYPES:
        raise ValueError(f"peer_dtype must be one of {list(PEER_DTYPES)}, got {peer_dtype!r}")
    import sglang

    from cedar.backend.config import CEDConfig
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    cfg = CEDConfig.load(model_dir)
    peers = detect_peers(peers_root)
    order = grid.order if grid.order is not None else default_order(peers)
    tmp = Path(tempfile.mkdtemp(prefix="cedar-llama-twin-"))
    twin_dir = tmp / "hf"
    t0 = time.perf_counter()
    try:
        twin_dir.mkdir()
        twin = write_llama_twin(model_dir, twin_dir)
        report = {"machine": machine_info(), "sglang_version": sglang.__version__,
                  "cedar_model": {"dir": str(model_dir), "name": cfg.name, "hidden_size": cfg.hidden_size,
                                  "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                                  "latent": cfg.kv_latent_dim, "intermediate_size": cfg.intermediate_size,
                                  "vocab_size": cfg.vocab_size},
                  "stock_model": twin, "grid": {**{k: getattr(grid, k) for k in grid.__dataclass_fields__},
                                                "order": order},
                  "peers": peer_records(order, peers), "peer_dtype": peer_dtype,
                  "cedar_weights": "float32" if flags is None else flags.weights, "runs": [], "notes": [
                      "Same SGLang server flags for Cedar and stock (server_argv per run); servers alternate in "
                      "grid.order, one at a time; the client runs on the same 2 cores.",
                      stock_kernels_note(),
                      f"Peers (make peers): vLLM's CPU build serves the twin's HF dir ({peer_dtype}, prefix "
                      f"caching); llama.cpp's llama-server serves a {PEER_DTYPES[peer_dtype].upper()} GGUF written "
                      "from it (8 slots, one unified KV "
                      "cache sized to the grid's largest batch); both get the same token ids. peers.<name> "
                      "says whether each ran, why not, its version and argv.",
                      "decode tok/s: output tokens of the batch per second over the interval in which every "
                      "request of the batch is decoding (per-chunk stream timestamps, one token a chunk).",
                      "TTFT: a streamed request to its first token. Cedar advantage: other / Cedar for times, "
                      "Cedar / other for rates; cedar_vs_best: against the best other engine of the probe."]}
        for k, engine in enumerate(order):
            record = report["peers"].get(engine)
            if record is not None and record["why_not"] is not None:
                print(f"[bench engine] run {k + 1}/{len(order)}: {engine} skipped ({record['why_not']})", flush=True)
                continue
            port, seed0 = free_port(), 10_000_000 * (k + 1)
            log = Path(f"/tmp/cedar-bench-engine-{engine}-{port}.log")
            print(f"[bench engine] run {k + 1}/{len(order)}: {engine}", flush=True)
            if engine in ("cedar", "stock"):
                serve = (ServeConfig(model=str(model_dir), port=port, extra=ENGINE_FLAGS,
                                     **({} if flags is None else {"flags": flags})) if engine == "cedar"
                         else StockServe(model=str(twin_dir), port=port, extra=ENGINE_FLAGS))
                with ServerProcess(serve, log_path=log) as srv:
                    run = {"engine": engine, "server_argv": serve.argv()[1:],
                           "probes": run_probes(SGLangClient(serve.host, serve.port), grid, cfg.vocab_size, seed0)}
                    if engine == "cedar":  # the model's own share of each step (the rest is SGLang's)
                        run["model_forward_ms"] = srv.cedar_state()["forward_ms"]
                report["runs"].append(run)
                continue

            attempt = partial(_peer_run, engine, report["peers"][engine], twin_dir, port, grid, peers,
                              cfg.vocab_size, seed0, log, peer_dtype)
            try_peer(engine, report["peers"][engine], attempt, report["runs"], log)
        report["table"] = table(report["runs"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save_report(report, out_json, plot_png, plot)
    return report
