"""``cedar serve --replicas N``: N Cedar servers behind SGLang's own router (``sglang-router``,
cache-aware by default), so a session's turns land on the replica that holds its prefix.

The replicas are ordinary ``cedar serve`` servers on the ports after the router's, each a child
process with its own log; the router listens where a single server would. Cedar's process
supervises them: it exits when the router exits (stopping the replicas), stops everything on
SIGTERM / SIGINT, and logs a replica that dies (the router's health checks and retries route
around it). The same as two commands::

    cedar serve --port 30001 &  cedar serve --port 30002 &
    python -m sglang_router.launch_router --worker-urls http://127.0.0.1:30001 \\
        http://127.0.0.1:30002 --policy cache_aware --port 30000
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from .launch import ServeConfig
from .process import ServerProcess, free_port, spawn_group, stop_group

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    api_key: str | None = None
    # NOTE: a stopped replica answers no health check within a second: route around it fast
    health_interval_s: int = 2
    # NOTE: between a replica's death and the health check that notices it, the cache-aware
    # policy may keep choosing it (its tree holds the prefix, or its queue looks shortest) and
    # the retries, 50-125 ms apart, go there too (CI saw a request fail that way). The circuit
    # breaker takes a worker out of selection after this many failed calls in a row (two, so one
    # stray error does not bench a live replica), so a later retry lands on a live one
    breaker_failures: int = 2
    retries: int = 4
    prometheus_port: int | None = None  # the router's metrics exporter (default: a free port)

    def argv(self, worker_urls: list[str]) -> list[str]:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTER_POLICIES}, got {self.policy!r}")
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port),
                "--worker-urls", *worker_urls, "--policy", self.policy,
                "--health-check-interval-secs", str(self.health_interval_s), "--health-failure-threshold", "1",
                "--retry-max-retries", str(self.retries),
                "--cb-failure-threshold", str(self.breaker_failures), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.prometheus_port or free_port())]
        return args + (["--api-key", self.api_key] if self.api_key else [])


class Replicas:
    """``with Replicas(base, n, router) as r: r.url ...``: n replicas of ``base`` (ports router.port
    + 1 ... + n) and the router in front of them, all child processes."""

    def __init__(self, base: ServeConfig, n: int, router: RouterConfig, log_dir: Path = Path("/tmp")) -> None:
        if n < 1:
            raise ValueError(f"--replicas must be at least 1, got {n}")
        self.router_cfg, self.log_dir = router, Path(log_dir)
        # NOTE: N servers on one machine each start as many OpenMP threads as it has cores; busy
        # at once they thrash (measured: 16 concurrent requests over 2 replicas on 2 cores took 25x
        # longer than on one server); each gets its share of the cores unless told otherwise
        threads = base.threads or max(1, (os.cpu_count() or 1) // n)
        self.servers = [ServerProcess(replace(base, host="127.0.0.1", port=router.port + 1 + i, threads=threads),
                                      log_path=self.log_dir / f"cedar-replica-{router.port + 1 + i}.log")
                        for i in range(n)]
        self.router: subprocess.Popen | None = None
        self.router_log = self.log_dir / f"cedar-router-{router.port}.log"
        self.more_routers: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://{self.router_cfg.host}:{self.router_cfg.port}"

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self, timeout_s: float = 240) -> "Replicas":
        try:
            for s in self.servers:  # NOTE: one at a time: two model loads at once on 2 cores time out
                s.start()
            self.router = self._start_router(self.router_cfg, self.router_log, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def add_router(self, policy: str, timeout_s: float = 120) -> str:
        """A second router over the same replicas with another policy (to compare policies on
        one set of servers); its URL. Stopped with the rest."""
        cfg = replace(self.router_cfg, port=free_port(), policy=policy, prometheus_port=None)
        self.more_routers.append(self._start_router(cfg, self.log_dir / f"cedar-router-{cfg.port}.log", timeout_s))
        return f"http://{cfg.host}:{cfg.port}"

    def _start_router(self, cfg: RouterConfig, log_path: Path, timeout_s: float) -> subprocess.Popen:
        with open(log_path, "w") as log:  # NOTE: the child keeps its own copy of the descriptor
            proc = spawn_group(cfg.argv(self.worker_urls), log)
        deadline, url = time.time() + timeout_s, f"http://{cfg.host}:{cfg.port}"
        while time.time() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"the router exited with {proc.returncode}; log: {log_path}; it ends: "
                                   + " | ".join(tail))
            try:  # NOTE: the router answers /health before it has registered its workers
                with urllib.request.urlopen(url + "/readiness", timeout=10) as r:
                    if json.loads(r.read()).get("healthy_workers") == len(self.servers):
                        return proc
            except OSError:
                pass
            time.sleep(0.5)
        stop_group(proc)
        raise TimeoutError(f"the router is not ready after {timeout_s} s; log: {log_path}")

    def stop(self) -> None:
        for proc in self.more_routers:
            stop_group(proc, timeout_s=20)
        stop_group(self.router, timeout_s=20)
        for s in self.servers:
            s.stop()

    def supervise(self) -> int:
        """Run until the router exits or a signal comes; return the exit code (cedar serve's)."""
        stop = {"signal": None}

        def on_signal(signum, frame):
            stop["signal"] = signum

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        dead: set[int] = set()
        try:
            while stop["signal"] is None and self.router.poll() is None:
                for i, s in enumerate(self.servers):
                    if i not in dead and s.proc.poll() is not None:
                        dead.add(i)
                        print(f"cedar serve: replica {s.url} exited with {s.proc.returncode} (log {s.log_path}); "
                              f"the router serves on with {len(self.servers) - len(dead)}", flush=True)
                if len(dead) == len(self.servers):
                    print("cedar serve: every replica is gone; stopping the router", flush=True)
                    return 1
                time.sleep(1.0)
            return 0 if stop["signal"] is not None else (self.router.returncode or 1)
        finally:
            self.stop()

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
