"""What a newcomer trips over, held in place: `make clean` removes only what was built; no
server outlives the test, script or parent that started it, whatever fails; a normal server
start logs no warning; the benchmark doc cites only keys its JSON has; the package builds
without setuptools warnings; the set-up prints one line per step and a failing step's output."""

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from cedar.backend.serving.launch import ServeConfig
from cedar.backend.serving.process import ServerProcess, free_port
from server_helpers import group_processes, kill_processes

ROOT = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = 30  # a killed parent's server: the kernel's signal, then SGLang's children follow


def wait_gone(pgid: int, timeout_s: float = GONE_WITHIN_S) -> list:
    """The processes of group ``pgid`` still alive after ``timeout_s`` (empty once all went)."""
    deadline = time.time() + timeout_s
    while (left := group_processes(pgid)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise TimeoutError(f"no line from the child in {timeout_s} s")
    return proc.stdout.readline()


# ---- make clean --------------------------------------------------------------------------------

def test_make_clean_removes_what_was_built_and_no_tracked_file(tmp_path):
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "models/cedar-agent/model.safetensors" in tracked
    for rel in tracked:  # the tracked tree, as empty files, beside what setup and the tests build
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    built = [".venv/bin/python", ".pytest_cache/v/x", "cedar.egg-info/PKG-INFO", "build/lib/x.py",
             "backend/__pycache__/cli.cpython-311.pyc", "tests/__pycache__/conftest.cpython-311.pyc"]
    for rel in built:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    (tmp_path / "models/cedar-tiny").mkdir()  # what `cedar init-model --out models/cedar-tiny` wrote
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    subprocess.run(["make", "-s", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert [rel for rel in tracked if not (tmp_path / rel).exists()] == []
    assert [rel for rel in built if (tmp_path / rel).exists()] == []
    assert (tmp_path / "models/cedar-tiny").is_dir()


# ---- no server left behind ---------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port
    model, log, how = sys.argv[1:]
    srv = ServerProcess(ServeConfig(model=model, port=free_port(), extra=("--sleep-on-idle",)), log_path=Path(log))
    srv.start()  # NOTE: no `with`, no stop: as a test that fails half-way leaves it
    print(srv.proc.pid, flush=True)
    if how == "fail":
        raise AssertionError("a test failing while its server runs")
    time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fail", "sigkill"])
def test_no_server_outlives_its_parent(tiny_model_dir, tmp_path, how):
    """A script starts a real server and then fails (exception, interpreter exit) or is killed
    outright (SIGKILL: a test's timeout); no process of the server's group remains. The failing
    run's log, a normal start's, has no warning line."""
    log = tmp_path / "server.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dir), str(log), how],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pgid = None
    try:
        pgid = int(read_line(parent, 400))
        assert len(group_processes(pgid)) >= 2  # SGLang's main process and at least its scheduler
        if how == "sigkill":
            os.killpg(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=120) != 0
        assert wait_gone(pgid) == []
    finally:
        kill_processes([*group_processes(parent.pid), *(group_processes(pgid) if pgid else [])])
        parent.wait()
    if how == "fail":
        assert "a test failing while its server runs" in parent.stderr.read()
        assert_no_warnings(log.read_text())


def test_ctrl_c_while_a_server_starts_stops_it(tiny_model_dir, tmp_path):
    srv = ServerProcess(ServeConfig(model=str(tiny_model_dir), port=free_port()), log_path=tmp_path / "s.log")
    ctrl_c = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            srv.start()  # about 20 s or more to ready: the interrupt lands while it waits
        ctrl_c.cancel()
        assert srv.proc is not None and srv.proc.poll() is not None  # start() stopped it, then re-raised
        assert wait_gone(srv.proc.pid, 5) == []
    finally:
        ctrl_c.cancel()
        if srv.proc is not None:
            kill_processes(group_processes(srv.proc.pid))
            srv.stop()


def test_a_spawned_group_dies_with_a_killed_parent_and_at_exit():
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    # SIGKILL of the parent: the kernel's parent-death signal
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, time
        from cedar.backend.serving.process import spawn_group
        print(spawn_group({sleeper!r}, subprocess.DEVNULL).pid, flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = None
    try:
        child = int(read_line(parent, 120))
        assert group_processes(child)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        assert wait_gone(child) == []
    finally:
        kill_processes([*group_processes(parent.pid), *(group_processes(child) if child else [])])
        parent.wait()
    # interpreter exit without a stop: the exit hook. In a child interpreter, spawned from a worker
    # thread (no parent-death signal there), so only the hook can stop it. NOTE: never call
    # CHILD_GROUPS.stop_all() here: in this process it would stop the session's shared servers.
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, threading
        from cedar.backend.serving.process import CHILD_GROUPS, spawn_group
        started = []
        t = threading.Thread(target=lambda: started.append(spawn_group({sleeper!r}, subprocess.DEVNULL)))
        t.start(); t.join()
        assert started[0].pid in CHILD_GROUPS.live
        print(started[0].pid, flush=True)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = None
    try:
        child = int(read_line(parent, 120))
        assert parent.wait(timeout=60) == 0
        assert wait_gone(child) == []
    finally:
        kill_processes([*group_processes(parent.pid), *(group_processes(child) if child else [])])
        parent.wait()


LEAKY_TEST = textwrap.dedent("""
    import os, subprocess, sys
    def test_leaks_a_process():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        open(os.environ["LEAKED_PID_FILE"], "w").write(str(proc.pid))
""")


def test_a_session_that_leaves_a_process_behind_fails_and_kills_it(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "LEAKED_PID_FILE": str(tmp_path / "leaked.pid")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "--rootdir", str(tmp_path),
                          "-p", "no:cacheprovider",
                          str(tmp_path / "test_leaky.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    pid = int((tmp_path / "leaked.pid").read_text()) if (tmp_path / "leaked.pid").exists() else None
    assert pid is not None, out.stdout[-2000:] + out.stderr[-2000:]
    try:
        assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout[-2000:] + out.stderr[-2000:]
        assert "1 passed" in out.stdout and "outlived them (now killed)" in out.stdout and f"pid {pid} " in out.stdout
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        kill_processes([psutil.Process(pid)] if psutil.pid_exists(pid) else [])


# ---- a normal server start logs no warning ---------------------------------------------------

# a word starting "warn" (not gc_warning_threshold), a Python warning category, torch's C++ log
WARNING_LINE = re.compile(r"(?i:(?<!\w)warn)|Warning:|(?:^|\]:)W\d{4} \d\d:\d\d:\d\d")


def assert_no_warnings(log: str) -> None:
    """No line of a server log is a warning: Python's (``UserWarning``, ``warnings.warn``),
    logging's (``WARNING``) or torch's C++-style (``W1202 04:17:23...``)."""
    assert [line for line in log.splitlines() if WARNING_LINE.search(line)] == []


def test_the_warning_check_sees_each_kind():
    for line in ["x.py:53: UserWarning: Only CUDA, HIP and XPU support AWQ currently.",
                 "[rank0]:W1202 04:17:23.280000 8849 torch/utils/cpp_extension.py:183] No CUDA runtime",
                 "[2026-12-02 04:16:03] WARNING server_args.py: something"]:
        with pytest.raises(AssertionError):
            assert_no_warnings("[2026-12-02 04:16:03] Init parallel begin.\n" + line)
    assert_no_warnings("[2026-12-02 04:17:25] KV Cache is allocated. dtype: torch.float32\n")


def test_a_client_loads_the_tokenizer_without_a_model_type_warning():
    """A process that is not an SGLang server (an endpoint, `cedar generate`) loads the model's
    tokenizer without transformers' "model of type `cedar_ced`" warning (nor any other)."""
    code = ("import sys\n"
            "from cedar.backend.serving.hf_config import load_tokenizer\n"
            "print(load_tokenizer(sys.argv[1]).eos_token)\n")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "models/cedar-agent")],
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout, out.stderr) == (0, "<|end|>\n", "")


def test_the_server_environment_ignores_only_sglangs_cpu_platform_notices():
    env = ServeConfig(model=str(ROOT / "models/cedar-agent")).env()
    if "SGLANG_USE_CPU_ENGINE" not in env:
        pytest.skip("CUDA: SGLang's CPU platform notices do not apply")
    code = ("import warnings\n"
            "warnings.warn('Only CUDA, HIP and XPU support AWQ currently.')\n"
            "warnings.warn('Triton is not supported on current platform, roll back to CPU.')\n"
            "warnings.warn('Only a test of another warning.')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert [line for line in out.stderr.splitlines() if "Warning" in line] == \
        ["<string>:4: UserWarning: Only a test of another warning."]


# ---- the benchmark doc cites what its JSON has -------------------------------------------------

NOT_JSON_KEYS = {"ignore_eos": "a sampling parameter the replay sends"}


def json_keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in json_keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in json_keys(v)}
    return set()


def test_the_agents_benchmark_doc_cites_only_keys_its_json_has():
    doc = (ROOT / "docs/bench/agents.md").read_text()
    keys = json_keys(json.loads((ROOT / "docs/bench/bench_agents.json").read_text()))
    cited = set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+|[a-z]+)`", doc))  # snake_case names in backticks
    assert {"table", "scale_out", "prefix_cache_off"} <= cited  # the pattern sees the doc's citations
    assert sorted(cited - keys - set(NOT_JSON_KEYS)) == []


# ---- packaging and the set-up log --------------------------------------------------------------

@pytest.mark.slow
def test_the_package_builds_without_setuptools_warnings_and_ships_its_data(tmp_path):
    src = tmp_path / "src"  # NOTE: a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "models", "__pycache__", "build",
                                                             "*.egg-info", ".pytest_cache"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    noise = [line for line in (out.stdout + out.stderr).splitlines()
             if "BuildBackendWarning" in line or "absent from the `packages`" in line or "SetuptoolsDeprecation" in line]
    assert noise == []
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("cedar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"cedar/agents/tasks/function_calling.json", "cedar/kernels/csrc/cedar_cpu.cpp"} <= names


def run_steps(tmp_path, script: str) -> subprocess.CompletedProcess:
    log = tmp_path / "setup.log"
    return subprocess.run(["bash", "-c", f"set -euo pipefail; SETUP_LOG={log}; "
                           f"source {ROOT / 'scripts/setup_steps.sh'}; {script}"],
                          capture_output=True, text=True)


def test_a_set_up_step_prints_one_line_and_logs_the_rest(tmp_path):
    ok = run_steps(tmp_path, 'step "torch" bash -c "echo pip chatter; echo WARNING: noise >&2"; echo "[setup] done"')
    assert ok.returncode == 0 and ok.stdout == "[setup] torch\n[setup] done\n" and ok.stderr == ""
    assert "pip chatter" in (tmp_path / "setup.log").read_text() and "WARNING: noise" in (tmp_path / "setup.log").read_text()


def test_a_failing_set_up_step_prints_its_output_and_stops(tmp_path):
    bad = run_steps(tmp_path, 'step "SGLang" bash -c "echo resolving; echo ERROR: no wheel >&2; exit 3"; '
                    'echo "[setup] done"')
    assert bad.returncode == 3 and bad.stdout == "[setup] SGLang\n"  # nothing after the failure ran
    assert "resolving" in bad.stderr and "ERROR: no wheel" in bad.stderr and str(tmp_path / "setup.log") in bad.stderr


def test_free_ports_come_from_outside_the_kernels_and_sglangs_ranges_and_skip_busy_ones(monkeypatch):
    # a port handed to a child is bound a minute later: from the ephemeral range (bind(0)) it may
    # by then be the local end of a connection (a router once exited "Address already in use")
    import socket

    from cedar.backend.serving import process

    ports = [free_port(3) for _ in range(20)]
    assert all(process.PORT_RANGE[0] <= p and p + 2 <= process.PORT_RANGE[1] for p in ports)
    with socket.socket() as s:  # every start but one busy: the one free run is found
        s.bind(("127.0.0.1", 30101))
        order = [30100, 30101, 30102]  # a run of 2 from 30100 or 30101 holds the busy port
        monkeypatch.setattr(process.random, "sample", lambda r, k: [p for p in order if p in r][:k])
        assert free_port(2) == 30102
        monkeypatch.setattr(process, "PORT_RANGE", (30101, 30101))  # the range full: the kernel's choice
        assert free_port() >= process._ephemeral_low()
