"""``cedar bench trace``: replay a request trace (:mod:`traces`) closed-loop against a server and
set the measured prefix-hit rate beside the trace's theoretical one.

Closed loop: ``concurrency`` workers; a Mooncake trace's requests are taken in file order (each
worker sends the next when its last one is answered); a session trace runs each root session on
one worker, its requests in order, a subagent session run right after the parent request that
precedes it in the file (joined before the parent's next request), think time kept (capped).
At concurrency 1 the server sees the trace's own order, so with a pool that holds the working
set the measured rate must equal the theoretical one (the prompt of a request is in the tree
once it is answered).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

from .common import machine_info, stream_chunks
from .traces import TokenMap, TraceRequest, load_trace, theoretical_hits


def _work_units(trace: list[TraceRequest]) -> list[list[int]]:
    """Indices of the trace grouped into what one worker runs in order: a Mooncake request alone,
    or a root session with its subagents' requests spliced in after the parent request that
    precedes them."""
    if all(r.session is None for r in trace):
        return [[i] for i in range(len(trace))]
    units: dict[str, list[int]] = {}
    root_of: dict[str, str] = {}
    for i, r in enumerate(trace):
        if r.session is None:
            raise ValueError(f"request {i}: a session trace needs a session on every request")
        root = root_of.setdefault(r.session, root_of.get(r.parent, r.parent) if r.parent else r.session)
        units.setdefault(root, []).append(i)
    return list(units.values())


def replay_trace(url: str, trace: list[TraceRequest], tokens: TokenMap, page_size: int, concurrency: int = 1,
                 think_cap_s: float = 1.0) -> dict:
    from ..serving.process import ServerClient

    client = ServerClient(url)
    prompts = [tokens.prompt(r) for r in trace]
    theory = theoretical_hits(prompts, page_size)
    units = _work_units(trace)
    results: dict[int, dict] = {}
    lock, next_unit = threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                if next_unit[0] >= len(units):
                    return
                unit, next_unit[0] = units[next_unit[0]], next_unit[0] + 1
            for i in unit:
                time.sleep(min(trace[i].think_s, think_cap_s))
                body = json.dumps({"input_ids": prompts[i], "stream": True, "sampling_params": {
                    "max_new_tokens": tokens.output_len(trace[i]), "temperature": 0, "ignore_eos": True}}).encode()
                t0, first, last = time.perf_counter(), None, None
                for t, last in stream_chunks(client.host, client.port, body):
                    first = t if first is None else first
                meta = last["meta_info"]
                results[i] = {"ttft_s": first - t0, "e2e_s": time.perf_counter() - t0,
                              "cached": int(meta["cached_tokens"]), "replayed": int(meta.get("replayed_tokens") or 0),
                              "restored": int(meta.get("restored_tokens") or 0), "out": len(last["output_ids"])}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rows = [results[i] for i in range(len(trace))]
    total_in = sum(len(p) for p in prompts)
    cached = sum(r["cached"] for r in rows)
    ttft = sorted(r["ttft_s"] for r in rows)
    return {
        "requests": len(trace), "concurrency": concurrency, "wall_s": round(wall, 2),
        "input_tokens": total_in, "theoretical_hit_rate": sum(theory) / total_in, "measured_hit_rate": cached / total_in,
        "requests_off_theory": sum(r["cached"] != h for r, h in zip(rows, theory)),
        "replayed_tokens": sum(r["replayed"] for r in rows), "restored_tokens": sum(r["restored"] for r in rows),
        "uncached_tokens": total_in - cached,
        "ttft_ms_p50": round(1e3 * statistics.median(ttft), 2), "ttft_ms_p90": round(1e3 * ttft[int(0.9 * (len(ttft) - 1))], 2),
        "output_tok_s": round(sum(r["out"] for r in rows) / wall, 2),
    }


def run_trace_benchmark(model_dir: Path, trace_path: Path, out_json: Path, limit: int | None, concurrency: int,
                        server_url: str | None = None, tokens_per_block: int = 4) -> dict:
    import sglang

    from ..config import CEDConfig
    from ..serving.launch import ServeConfig
    from ..serving.process import ServerProcess, free_port

    cfg = CEDConfig.load(model_dir)
    trace = load_trace(trace_path, limit)
    tokens = TokenMap(cfg.vocab_size, tokens_per_block)
    srv = None
    if server_url is None:
        serve = ServeConfig(model=str(model_dir), port=free_port(), extra=("--sleep-on-idle",))
        srv = ServerProcess(serve, log_path=Path(f"/tmp/cedar-trace-{serve.port}.log")).start()
        server_url = srv.url
    try:
        result = replay_trace(server_url, trace, tokens, cfg.page_size, concurrency)
    finally:
        if srv is not None:
            srv.stop()
    report = {"what": "closed-loop trace replay: measured vs theoretical (infinite cache) prefix-hit rate",
              "trace": str(trace_path), "limit": limit, "tokens_per_block": tokens_per_block,
              "machine": machine_info(), "sglang_version": sglang.__version__, "model": str(model_dir),
              "server_argv": srv.cfg.argv() if srv is not None else None, **result}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    return report
