"""What the benchmarks share: fresh prompts, a streamed request timed to its first token, the
mode switches of a running server, the machine description and the report files."""

from __future__ import annotations

import http.client
import json
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

FIRST_ID = 8  # token ids 0-7 are special
OUTPUT_LEN = 2  # NOTE: >1 so the first streamed chunk is a first token, not the finished request


def fresh_ids(seed: int, n: int, vocab_size: int) -> list[int]:
    """n ids drawn from ``seed``; the first page (2 ids) spells the seed, so prompts of distinct
    seeds (< (vocab_size - 8)^2) never share a cached page, not even by chance."""
    span = vocab_size - FIRST_ID
    rng = random.Random(seed)
    head = [FIRST_ID + (seed // span) % span, FIRST_ID + seed % span]
    return (head + [rng.randrange(FIRST_ID, vocab_size) for _ in range(n - 2)])[:n]


@dataclass(frozen=True)
class Sample:
    ttft_ms: float
    cached_tokens: int
    replayed_tokens: int
    restored_tokens: int = 0


def data_chunks(resp) -> Iterator[dict]:
    """The parsed ``data:`` lines of a streamed SGLang answer (an http.client response), up to
    its ``[DONE]``."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            yield json.loads(line[5:])


def stream_chunks(host: str, port: int, body: bytes, timeout: float = 600,
                  headers: dict[str, str] | None = None) -> Iterator[tuple[float, dict]]:
    """POST a streamed /generate; yield (time.perf_counter() at arrival, chunk) per data line."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/generate returned {resp.status}: {resp.read()[:300]!r}")
        for chunk in data_chunks(resp):
            if "error" in chunk:
                raise RuntimeError(f"/generate streamed an error: {chunk['error']}")
            yield time.perf_counter(), chunk
    finally:
        conn.close()


def stream_generate(host: str, port: int, body: bytes) -> Sample:
    """POST a streamed /generate; TTFT is measured to its first ``data:`` line."""
    t0, ttft_s, last = time.perf_counter(), None, None
    for t, last in stream_chunks(host, port, body):
        ttft_s = t - t0 if ttft_s is None else ttft_s
    if last is None:
        raise RuntimeError("/generate streamed no data line")
    meta = last["meta_info"]
    return Sample(ttft_s * 1e3, int(meta["cached_tokens"]), int(meta.get("replayed_tokens") or 0),
                  int(meta.get("restored_tokens") or 0))


def stream_body(ids: list[int], max_new_tokens: int = OUTPUT_LEN) -> bytes:
    return json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}).encode()


def set_switch(srv, key: str, on: bool) -> None:
    """Flip a Cedar runtime switch (/set_internal_state) and check the server took it."""
    from cedar.backend.serving.runtime import SWITCHES

    status, out = srv.post("/set_internal_state", {"server_args": {key: int(on)}})
    flags = srv.cedar_state()["flags"]
    if status != 200 or any(flags[k] != v for k, v in SWITCHES[key](on).items()):
        raise RuntimeError(f"switch {key} did not take: {status} {out} {flags}")


def machine_info() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_avg_1_5_15_at_start": list(os.getloadavg())}


def save_report(report: dict, out_json, plot_png, plot: Callable[[list, Path], None]) -> None:
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(report, indent=1) + "\n")
    if plot_png:
        Path(plot_png).parent.mkdir(parents=True, exist_ok=True)
        plot(report["table"], Path(plot_png))
