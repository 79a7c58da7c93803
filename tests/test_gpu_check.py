"""``scripts/gpu_check.sh --dry-run``: every stage of the GPU check runs on the CPU at tiny sizes
through the same code the GPU run takes (Triton interpreted, the served path on the CPU's
kernels against the torch twins, the decode step split as the CUDA graphs hold it), and writes
its JSON; a stage that runs out of time is recorded, not lost; a comparison can fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(out: Path, *args: str, limits: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GPU_CHECK_LIMITS", None)
    if limits is not None:
        env["GPU_CHECK_LIMITS"] = limits
    return subprocess.run(["bash", str(SCRIPT), *args, str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _stage(out: Path, name: str) -> dict:
    return json.loads(next(out.glob(f"*-{name}.json")).read_text())


def test_dry_run_writes_every_stage_and_its_comparisons_pass(tmp_path):
    proc = _run(tmp_path, "--dry-run")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["1-env.json", "2-kernels.json", "3-served.json", "4-replay.json", "5-graphs.json",
                     "log.txt", "summary.json"], files  # at most 8 files come back from the device
    env = _stage(tmp_path, "env")
    assert env["status"] == "pass" and env["torch"] == torch.__version__ and env["dry_run"] is True
    assert env["modules"]["triton"][0].isdigit()

    kernels = _stage(tmp_path, "kernels")
    assert kernels["status"] == "pass" and kernels["mode"] == "interpreter"
    assert kernels["checked"] == 14 and all(r["ok"] for r in kernels["rows"])
    assert {r["op"] for r in kernels["rows"]} >= {"window_attention", "sparse_attention", "quantize_scatter_global"}
    assert all(e <= r["tol"] for r in kernels["rows"] for e in r["max_err"].values())

    served = _stage(tmp_path, "served")
    assert served["status"] == "pass" and served["greedy_equal"]
    assert len(served["max_abs_logit_err_per_forward"]) == 2 + served["sizes"]["decode"]
    assert max(served["max_abs_logit_err_per_forward"]) <= served["tol"]

    replay = _stage(tmp_path, "replay")
    assert replay["status"] == "pass" and replay["greedy_equal"] and replay["max_abs_logit_err"] <= replay["tol"]
    assert replay["replayed_rows"]["in_forward"] == replay["replayed_rows"]["per_request"] == [128, 128]

    graphs = _stage(tmp_path, "graphs")
    assert graphs["status"] == "skipped" and graphs["reason"].startswith("skipped: no CUDA")
    assert graphs["split_max_abs_logit_err"] <= 2e-3 and graphs["split_state_equals_served_step"]

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["all_passed"] and summary["stages"]["graphs"]["status"] == "skipped"
    assert "served   pass" in proc.stdout


def test_a_stage_past_its_limit_is_recorded_and_the_run_fails(tmp_path):
    """A 1 s limit cannot even import torch: the script writes the stage's JSON itself, goes on,
    and the summary marks the stages that never ran as missing."""
    proc = _run(tmp_path, "--dry-run", limits="kernels:1 graphs:30", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    kernels = _stage(tmp_path, "kernels")
    assert kernels["status"] == "timeout" and kernels["limit_s"] == 1 and kernels["returncode"] == 124
    assert _stage(tmp_path, "graphs")["status"] == "skipped"  # the next stage still ran
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"]["served"]["status"] == "missing" and not summary["all_passed"]


def test_usage_errors():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry-run stage runs on the CPU")
def test_a_kernel_that_disagrees_with_its_twin_fails_the_stage(monkeypatch):
    """The comparison has teeth: a twin shifted by 0.01 fails its op, and only it."""
    from cedar.backend import gpu_stages
    from cedar.kernels import gpu_check

    real = gpu_check.op_calls

    def shifted(geo, x, backend):
        calls = real(geo, x, backend)
        if backend == "torch":
            merge = calls["merge_states"]
            calls["merge_states"] = lambda: tuple(t + 0.01 for t in merge())
        return calls

    monkeypatch.setattr(gpu_check, "op_calls", shifted)
    result = gpu_stages.stage_kernels(gpu_stages.Ctx(dry=True, device=torch.device("cpu")))
    assert result["status"] == "fail"
    bad = {r["op"] for r in result["rows"] if not r["ok"]}
    assert bad == {"merge_states"}, bad
