"""``cedar bench step``: the in-process served step. Its hit case must really hit (the forward
runs the replayed window and the new rows, not the whole prompt), its decode case one row per
request, its cold case every prompt row (nothing to hit), and the report names the ops a step
issues."""

import json
import subprocess
import sys

from cedar.backend.config import CEDConfig
from cedar.drivers.bench.step import QUICK_CASES

MATMULS = ("aten::mm", "aten::addmm", "cedar_cpu::linear", "cedar_cpu::layer_tail", "cedar_cpu::layer_project",
           "cedar_cpu::decode_step")


def test_bench_step_runs_hits_as_hits_and_reports_the_ops(tiny_model_dir, tmp_path):
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "step", "--quick", "--repeats", "2", "--threads", "1",
                    "--model", str(tiny_model_dir), "--json", str(out)], check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    W = CEDConfig.load(tiny_model_dir).sliding_window
    assert [c["case"] for c in report["cases"]] == [c.name for c in QUICK_CASES]
    for case, got in zip(QUICK_CASES, report["cases"]):
        want_rows = {"decode": case.batch, "cold": case.context}.get(case.kind, min(W, case.context) + case.new)
        assert got["rows"] == want_rows, got
        assert 0 < got["ms_best"] <= got["ms_median"] and got["aten_ops"] > 0
        # the matmuls: ATen's, or inside the fast backend's one-call ops on a decode step (a layer or the whole step)
        assert any(o["op"].startswith(MATMULS) for o in got["top_ops"]), got["top_ops"]
    assert report["kernels"] in ("fast", "torch") and report["machine"]["cpu_count"] >= 1
