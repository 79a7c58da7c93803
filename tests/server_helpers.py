"""What the tests of the real server share: prompts, a greedy /generate with logprobs, the
reference's answer for it (cold or bounded replay after a hit; the ``ref`` fixture is in conftest).

Outputs are compared as greedy token ids (exact) and their log-probabilities (LOGPROB_ATOL:
the served batch runs the same layer code over differently shaped batches; quantized caches).
"""

import os

import psutil
import torch

from cedar.backend.replay import reference_greedy

W = 128
NEW = 6
LOGPROB_ATOL = 2e-3


def prompt(n, seed):
    return torch.randint(8, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(server, ids, n=NEW, **extra):
    status, out = server.post("/generate", {
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}})
    assert status == 200, out
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], logprobs, out["meta_info"]


def reference(ref, ids, hit=0, donor_ids=None, n=NEW):
    """Greedy continuation of the reference model, cold or after a hit of ``hit`` tokens on the
    global KV a cold run of ``donor_ids`` produced: (tokens, log-probability of the first)."""
    toks, logits = reference_greedy(ref, ids, n, hit, donor_ids)
    return toks, float(torch.log_softmax(logits, -1)[toks[0]])


def assert_matches(served, expected):
    (ids, lps, _), (ref_ids, ref_lp) = served, expected
    assert ids == ref_ids
    assert abs(lps[0] - ref_lp) <= LOGPROB_ATOL, (lps[0], ref_lp)


# Every process a test session starts carries this variable (set by conftest.py) with the pytest
# process's pid, so one left behind is found even after its parent died and it was re-parented.
SESSION_MARK = "CEDAR_TEST_SESSION"
# Helpers Python itself ends when the interpreter exits (not ours to stop).
EXIT_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")


def leftover_processes(session_pid: int) -> list[psutil.Process]:
    """Live processes (zombies aside) started from the test session ``session_pid``: its
    descendants and any process carrying its SESSION_MARK, but not the session itself."""
    found = {p.pid: p for p in psutil.Process(session_pid).children(recursive=True)}
    for p in psutil.process_iter():
        try:
            if p.pid != session_pid and p.environ().get(SESSION_MARK) == str(session_pid):
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return [p for p in found.values() if _alive_and_ours(p)]


def _alive_and_ours(p: psutil.Process) -> bool:
    try:
        cmdline = " ".join(p.cmdline())
        return p.status() != psutil.STATUS_ZOMBIE and not any(h in cmdline for h in EXIT_HELPERS)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def group_processes(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


def kill_processes(procs: list[psutil.Process]) -> None:
    """SIGKILL each process and its group (never this process's own group)."""
    own = os.getpgid(0)
    for p in procs:
        try:
            pgid = os.getpgid(p.pid)
            if pgid != own:
                os.killpg(pgid, 9)
            p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
