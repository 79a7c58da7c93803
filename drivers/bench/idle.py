"""What SGLang's `--sleep-on-idle` changes for `cedar serve` on CPU: the server's idle CPU, a
short prompt's latency and decode speed, alternating servers with and without the flag (the
tests pass it; `cedar serve` does not by default).

    cedar bench idle [--model models/cedar-tiny] [--rounds 2] [--json OUT]

Prints one JSON line per server run (with --json, all of them as one report): idle CPU % of the
server's process tree over 5 s, the median latency of 25 one-token requests on 64-token prompts
sent 0.2 s apart, and decode tokens/s of three 64-token generations after 512-token prompts.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

import psutil

from cedar.backend.serving.launch import ServeConfig
from cedar.backend.serving.process import ServerProcess, free_port


def post(url: str, ids: list[int], n: int) -> None:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                             "ignore_eos": True}}).encode()
    urllib.request.urlopen(urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"}),
                           timeout=300).read()


def probe(model: str, sleep_on_idle: bool) -> dict:
    extra = ("--sleep-on-idle",) if sleep_on_idle else ()
    with ServerProcess(ServeConfig(model=model, port=free_port(), extra=extra)) as srv:
        time.sleep(3)
        procs = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        for p in procs:
            p.cpu_percent(None)
        time.sleep(5)
        idle = sum(p.cpu_percent(None) for p in procs)
        for i in range(3):
            post(srv.url, [9 + i, 10, 11], 1)
        lat = []
        for i in range(25):
            time.sleep(0.2)
            t0 = time.perf_counter()
            post(srv.url, [(i * 7 + j) % 500 + 8 for j in range(64)], 1)
            lat.append(time.perf_counter() - t0)
        decode = []
        for i in range(3):
            t0 = time.perf_counter()
            post(srv.url, [(i * 3 + j) % 500 + 8 for j in range(512)], 64)
            decode.append(64 / (time.perf_counter() - t0))
    return {"sleep_on_idle": sleep_on_idle, "idle_cpu_percent": round(idle, 1),
            "latency_ms_median": round(statistics.median(lat) * 1000, 1),
            "decode_tok_s": [round(d, 1) for d in decode]}


def run_idle_probe(model: str, rounds: int) -> dict:
    """Alternating servers without and with ``--sleep-on-idle``, ``rounds`` times: {"runs": [...]}."""
    runs = []
    for _ in range(rounds):
        for flag in (False, True):
            runs.append(probe(model, flag))
            print(json.dumps(runs[-1]), flush=True)
    return {"model": model, "runs": runs}
