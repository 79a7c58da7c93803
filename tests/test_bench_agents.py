"""`cedar bench agents --quick` end to end: the shipped model's agents recorded and replayed, a short
AgentX-shaped trace, shipped vs the prefix-cache-off baseline at concurrency 1 and 2, each mode on
a real server.

Tolerance: at concurrency 1 the measured prefix-hit rate must equal the workload's theoretical
(infinite cache) rate within 0.5 points. The server's pool holds the working set and every prompt
is in the tree once its request is answered, so the two are equal request by request there; the
half point leaves room only for a request that shares a prefix with one still running (a fork's
branches), which the theoretical count does not credit."""

import json
import subprocess
import sys

import pytest

TOLERANCE = 0.005


@pytest.mark.slow
def test_quick_agent_benchmark(tmp_path):
    out = tmp_path / "agents.json"
    proc = subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "agents", "--quick", "--json", str(out),
                           "--plot", str(tmp_path / "agents.png"), "--sessions", str(tmp_path / "sessions.jsonl")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bench agents:" in proc.stderr  # the progress bar
    report = json.loads(out.read_text())
    rows = report["table"]
    assert {(r["workload"], r["mode"], r["concurrency"]) for r in rows} == {
        (w, m, c) for w in ("agents", "trace") for m in ("shipped", "prefix_cache_off") for c in (1, 2)}
    assert report["sglang_version"] and report["machine"]["cpu_count"] and "--disable-radix-cache" in \
        report["server_argv"]["prefix_cache_off"] and "--disable-radix-cache" not in report["server_argv"]["cedar"]
    assert (tmp_path / "agents.png").stat().st_size > 10_000 and (tmp_path / "sessions.jsonl").exists()
    for r in rows:
        assert r["requests"] > 0 and r["output_tok_s"] > 0 and r["interactivity_p90"] > 0
        if r["mode"] == "prefix_cache_off":
            assert r["measured_hit_rate"] == 0 and r["replayed_tokens"] == r["restored_tokens"] == 0, r
        elif r["concurrency"] == 1:
            assert r["theoretical_hit_rate"] > 0.5, r
            assert abs(r["measured_hit_rate"] - r["theoretical_hit_rate"]) <= TOLERANCE, r
    shipped = {w: next(r for r in rows if r["workload"] == w and r["mode"] == "shipped" and r["concurrency"] == 1)
               for w in ("agents", "trace")}
    assert shipped["agents"]["restored_tokens"] > 0  # multi-turn agent sessions continue from snapshots
    assert shipped["trace"]["replayed_tokens"] > 0  # trace turns re-send other tokens than generated: replay
    assert set(report["headline"]) == {"agents", "trace"}
    # both sessions' workloads are the same in both modes: the same prompt and output token counts
    for w in ("agents", "trace"):
        sizes = {(r["prompt_tokens"], r["output_tokens"]) for r in rows if r["workload"] == w}
        assert len(sizes) == 1, sizes
