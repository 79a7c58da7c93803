"""Run ``cedar serve``'s SGLang server as a child process (the demo, the tests and the benchmarks
share one per session: it takes ~20 s to start on 2 cores, and an SGLang crash kills its
parent, so it never runs in the caller's process), and talk to a running one (:class:`ServerClient`:
any URL, a router's too)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from .launch import ServeConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen | None, timeout_s: float = 30) -> None:
    """SIGTERM a child started with ``start_new_session`` and its whole group; SIGKILL after
    ``timeout_s``. A no-op for a process that is gone."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class ServerClient:
    """Small HTTP helpers for a running server at ``url`` (with its ``--api-key``, if any)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url, self.api_key = url.rstrip("/"), api_key
        parts = urllib.parse.urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port

    def headers(self) -> dict[str, str]:
        """JSON content type, and the bearer token where the server wants an API key."""
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"Content-Type": "application/json", **auth}

    def post(self, path: str, payload: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(), headers=self.headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except json.JSONDecodeError:
                return e.code, {"raw": body.decode(errors="replace")}

    def flush_cache(self, timeout_s: int = 60) -> None:
        """Empty the server's prefix cache; SGLang waits up to ``timeout_s`` for running requests
        to finish first (it answers in text, not JSON)."""
        req = urllib.request.Request(f"{self.url}/flush_cache?timeout={timeout_s}", data=b"", headers=self.headers())
        with urllib.request.urlopen(req, timeout=timeout_s + 60) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.url}/flush_cache answered {r.status}: {r.read()[:200]!r}")

    def cedar_state(self) -> dict:
        req = urllib.request.Request(self.url + "/get_server_info", headers=self.headers())
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["internal_states"][0]["cedar"]

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Poll until no request holds a slot (or ``timeout_s`` passed); the last cedar state."""
        deadline = time.time() + timeout_s
        while True:
            state = self.cedar_state()
            slots = state["integrity"]["request_slots"]
            if (slots["free"] == slots["total"] and state["integrity"]["tokens_ok"]) or time.time() > deadline:
                return state
            time.sleep(0.5)


class ServerProcess(ServerClient):
    """``with ServerProcess(cfg) as srv: srv.url ...``; the log goes to ``log_path``."""

    def __init__(self, cfg: ServeConfig, log_path: Path | None = None, timeout_s: float = 180,
                 argv: list[str] | None = None) -> None:
        """argv: the command to run instead of ``cfg.argv()`` (e.g. ``cedar serve ...``, which
        becomes the same SGLang server); cfg still names its host, port and API key."""
        super().__init__(f"http://{cfg.host}:{cfg.port}", cfg.api_key)
        self.cfg, self.timeout_s, self.argv = cfg, timeout_s, argv
        self.log_path = Path(log_path or f"/tmp/cedar-server-{cfg.port}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv or self.cfg.argv(), env=self.cfg.env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cedar server exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"cedar server not ready after {self.timeout_s} s; log: {self.log_path}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop_group(self.proc)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
