"""Run ``cedar serve``'s SGLang server as a child process (the demo, the tests and the benchmarks
share one per session: it takes ~20 s to start on 2 cores, and an SGLang crash kills its
parent, so it never runs in the caller's process), and talk to a running one (:class:`ServerClient`:
any URL, a router's too).

A started server (or router) never outlives its starter, whatever fails: a failed or interrupted
start stops it, interpreter exit stops whatever was not stopped, and a starter killed outright
takes it along (the kernel's parent-death signal)."""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from .launch import ServeConfig


# NOTE: a port picked here is bound later, by a child, often a minute later (a router starts after
# its replicas). A port from the kernel's ephemeral range (bind(0)) may by then be the local end of
# some connection (CI saw a router exit with "Address already in use"); SGLang picks its own
# rendezvous ports in 22000-29999. So ports come from the gap between the two
PORT_RANGE = (30000, 32767)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(count: int = 1) -> int:
    """A port p with p ... p + count - 1 free now, below the ephemeral range where it can be
    (a random one in :data:`PORT_RANGE`), else one the kernel hands out."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low() - 1)
    starts = random.sample(range(low, high - count + 2), min(64, max(0, high - count + 2 - low)))
    for p in starts + [0] * 64:  # NOTE: 0: the kernel's choice, only if the range is full
        try:
            socks = [socket.socket() for _ in range(count)]
            try:
                socks[0].bind(("127.0.0.1", p))
                p = socks[0].getsockname()[1]
                for q, s in zip(range(p + 1, p + count), socks[1:]):
                    s.bind(("127.0.0.1", q))
            finally:
                for s in socks:
                    s.close()
            return p
        except OSError:
            continue
    raise RuntimeError(f"no run of {count} free ports")


PR_SET_PDEATHSIG = 1  # prctl(2)


class ChildGroups:
    """Every process group :func:`spawn_group` started in this interpreter and no one stopped yet;
    stopped at interpreter exit (``atexit``).

    NOTE: one per process (``CHILD_GROUPS``): the exit hook must reach every server the process
    started, whoever started it. A parent killed outright (SIGKILL, a test's timeout) runs no
    exit hook: the kernel's parent-death signal covers that (see :func:`spawn_group`)."""

    def __init__(self) -> None:
        self.live: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def add(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.live[proc.pid] = proc

    def discard(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.live.pop(proc.pid, None)

    def stop_all(self) -> None:
        with self.lock:
            procs = list(self.live.values())
        for proc in procs:
            stop_group(proc, timeout_s=10)


CHILD_GROUPS = ChildGroups()
atexit.register(CHILD_GROUPS.stop_all)


def _die_with_parent():
    """A ``preexec_fn``: the child gets SIGKILL when this process dies, however it dies.

    NOTE: the kernel sends it when the *thread* that forked exits, so it is armed only for a
    child started from the main thread (a worker thread's child relies on ``atexit``). SGLang's
    scheduler and detokenizer arm the same signal against the server's main process, so the
    whole server follows. libc is looked up here, before the fork."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def spawn_group(argv: list[str], stdout, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new session (its own process group, stderr into
    ``stdout``) that never outlives this process: stopped by :func:`stop_group`, at interpreter
    exit, or by the kernel when this process is killed."""
    proc = subprocess.Popen(argv, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent())
    CHILD_GROUPS.add(proc)
    return proc


def stop_group(proc: subprocess.Popen | None, timeout_s: float = 30) -> None:
    """SIGTERM a child started by :func:`spawn_group` and its whole group; SIGKILL after
    ``timeout_s``. A leader already gone: SIGKILL whatever is left of its group."""
    if proc is None:
        return
    CHILD_GROUPS.discard(proc)
    if proc.poll() is not None:
        _killpg(proc.pid, signal.SIGKILL)
        return
    _killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    _killpg(proc.pid, signal.SIGKILL)  # NOTE: members may outlive a leader that exited on SIGTERM
    proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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
        """Start the server and wait until it answers; on any failure here (exit, timeout,
        KeyboardInterrupt) the server's whole process group is stopped before the error goes on."""
        with open(self.log_path, "w") as log:  # NOTE: the child keeps its own copy of the descriptor
            self.proc = spawn_group(self.argv or self.cfg.argv(), log, self.cfg.env())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cedar server exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (OSError, http.client.HTTPException):
                # NOTE: BadStatusLine("GET /health_generate ...") is the poll talking to itself: with
                # nothing bound yet, a loopback connect to a port in the ephemeral range can pick
                # that port as its own source (TCP self-connect) and read its request back
                time.sleep(1.0)
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
