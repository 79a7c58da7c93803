"""Shared pytest set-up.

NOTE: Triton reads TRITON_INTERPRET when a ``@triton.jit`` kernel is defined, so on a machine
without CUDA it must be set here, before any test module imports a ``*_triton`` kernel module.

No test may leave a process behind (an idle SGLang server busy-polls a core): every process the
session starts inherits SESSION_MARK, and the session fails, loudly, if one outlives it (after it
is killed).
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from server_helpers import SESSION_MARK, kill_processes, leftover_processes  # noqa: E402

os.environ[SESSION_MARK] = str(os.getpid())
LEFTOVER_GRACE_S = 10  # a group stopped in the last teardown may take a moment to go


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the session if a process it started is still alive at its end (then kill it)."""
    deadline = time.time() + LEFTOVER_GRACE_S
    while (left := leftover_processes(os.getpid())) and time.time() < deadline:
        time.sleep(0.5)
    if not left:
        return
    lines = []
    for p in left:
        try:
            lines.append(f"  pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:200]}")
        except Exception:  # noqa: BLE001 - it went while we looked
            lines.append(f"  pid {p.pid}")
    kill_processes(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(left)} process(es) started by the tests outlived them (now killed):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_line("ERROR: " + message, red=True, bold=True)
    else:
        print("ERROR: " + message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A runtime's decode step leaves the process on its decode threads (as a server should):
    every test starts on the threads the session started with."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The shipped geometry with random weights (seed 0), built once per session."""
    from cedar.backend.model_io import init_model_dir

    out = tmp_path_factory.mktemp("cedar-tiny")
    init_model_dir("cedar-tiny", out, seed=0)
    return out


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The reference on the kernels the server runs (the fast CPU backend where its C++ kernels
    build): the served path then agrees with it bit for bit up to batch shapes; the kernels
    themselves are held to the pure-torch twins in test_kernels_fast.py."""
    from cedar.backend.model_io import load_model
    from cedar.kernels.dispatch import KernelSet

    return load_model(tiny_model_dir).use_kernels(KernelSet.for_device("cpu"))


def start_server(model_dir: Path, *extra: str, **kw):
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    # NOTE: an idle SGLang scheduler busy-polls a whole core (101% CPU idle, 1% with the flag,
    # `cedar bench idle`); the tests run a server beside the reference model and sometimes a
    # second server on 2 cores. Not a serving default: a sleeping scheduler answers a sparse
    # request a few ms later and decoded ~5% slower in the same probe.
    cfg = ServeConfig(model=str(model_dir), port=free_port(), extra=("--sleep-on-idle", *extra), **kw)
    return ServerProcess(cfg, log_path=Path(f"/tmp/cedar-test-server-{cfg.port}.log")).start()


def wait_idle_and_check(server, timeout_s: float = 30.0) -> dict:
    """Wait until no request holds a slot, then return the integrity report (asserting it)."""
    state = server.wait_idle(timeout_s)["integrity"]
    idle = state["request_slots"]["free"] == state["request_slots"]["total"]
    assert state["tokens_ok"], f"token pool integrity broken: {state}"
    assert state["slots_ok"], f"Cedar's slot / snapshot invariants broken: {state['slots_broken']}"
    assert idle, f"request slots leaked: {state}"
    assert state["tokens"]["in_use"] == 0 and state["tokens"]["protected"] == 0, state
    return state


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """One real SGLang server with the CED model for the whole session (a child process)."""
    srv = start_server(tiny_model_dir, "--context-length", "4096", "--enable-metrics", "--enable-cache-report")
    yield srv
    srv.stop()


@pytest.fixture
def checked_server(server):
    """The shared server; after the test, the pools must be consistent and nothing leaked."""
    yield server
    wait_idle_and_check(server)
