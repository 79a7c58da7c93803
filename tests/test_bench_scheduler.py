"""``cedar bench scheduler``: each sample lands in the first bucket whose frame its stack holds,
and through a real server the scheduler's samples are found and fall in Cedar's forward; a cold
request's busy time leaves out the scheduler's idle wait."""

import collections
import json
import subprocess
import sys

import pytest

from cedar.drivers.bench.scheduler import BUCKETS, IDLE_FRAME, OTHER, PERIOD_S, TTFT_BUCKETS, breakdown, bucket_of, \
    busy_breakdown

LOOP = "process.py:run;scheduler.py:run_scheduler_process;scheduler.py:event_loop_overlap"


def test_a_sample_goes_to_the_first_bucket_its_stack_holds():
    native = f"{LOOP};scheduler.py:run_batch;served_model.py:forward;native_step.py:native_decode;_ops.py:__call__"
    lm_head = f"{LOOP};scheduler.py:run_batch;served_model.py:forward;logits_processor.py:forward;x.py:mm"
    around = f"{LOOP};scheduler.py:run_batch;served_model.py:forward;batch_tables.py:build"
    alloc = f"{LOOP};scheduler.py:get_next_batch_to_run;schedule_batch.py:prepare_for_decode;paged.py:alloc_decode"
    assert bucket_of(native) == "Cedar: native decode step (C++)"
    assert bucket_of(lm_head) == "LM head (SGLang's LogitsProcessor)"  # inside Cedar's forward, but SGLang's
    assert bucket_of(around).startswith("Cedar: Python around")
    assert bucket_of(alloc) == "SGLang: decode slot allocation"  # not "batch scheduling", which holds it
    assert bucket_of(LOOP) == OTHER
    out = breakdown(collections.Counter({native: 6, around: 2, alloc: 1, LOOP: 1}))
    assert out["samples"] == 10 and abs(sum(out["buckets"].values()) - 1) < 1e-9
    assert out["buckets"]["Cedar: native decode step (C++)"] == 0.6 and out["buckets"][OTHER] == 0.1
    assert out["top_self_frames"][0] == {"frame": "_ops.py:__call__", "share": 0.6}
    with pytest.raises(ValueError):
        breakdown(collections.Counter())


def test_a_cold_requests_busy_time_leaves_out_the_idle_wait():
    idle = f"{LOOP};scheduler.py:on_idle;{IDLE_FRAME};idle_sleeper.py:maybe_sleep;poll.py:poll"
    prefill = f"{LOOP};scheduler.py:run_batch;served_model.py:forward;_ops.py:__call__"
    alloc = f"{LOOP};scheduler.py:get_next_batch_to_run;schedule_batch.py:prepare_for_extend"
    out = busy_breakdown(collections.Counter({idle: 90, prefill: 8, alloc: 2}), requests=2)
    assert out["idle_samples"] == 90 and out["samples"] == 10
    assert out["busy_ms_per_request"] == round(1000 * PERIOD_S * 10 / 2, 2)
    assert set(out["buckets"]) == {b for b, _ in TTFT_BUCKETS} | {OTHER}
    assert out["buckets"]["Cedar: prefill forward (Python and kernels)"] == 0.8
    assert out["buckets"]["SGLang: prefill scheduling and slot allocation"] == 0.2


def test_bench_scheduler_profiles_a_real_servers_scheduler(tiny_model_dir, tmp_path):
    out = tmp_path / "sched.json"
    subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "scheduler", "--model", str(tiny_model_dir),
                    "--cases", "1x128", "--tokens", "60", "--repeats", "1", "--ttft", "32", "--ttft-requests", "4",
                    "--json", str(out),
                    "--plot", str(tmp_path / "sched.png")],
                   check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    assert (tmp_path / "sched.png").stat().st_size > 0
    (case,) = report["cases"]
    assert case["case"] == "decode b1 ctx128" and case["tok_s"] > 0 and case["tok_s_while_sampled"] > 0
    assert len(case["tok_s_runs_decode_on_server_threads"]) == 1 and case["tok_s_decode_on_server_threads"] > 0
    sched = case["scheduler"]
    assert sched["samples"] >= 20 and set(sched["buckets"]) == {b for b, _ in BUCKETS} | {OTHER}
    cedar = sum(v for k, v in sched["buckets"].items() if k.startswith("Cedar"))
    assert cedar > 0.1, sched  # the decode steps ran Cedar's forward on the scheduler's thread
    (cold,) = report["ttft_cases"]
    assert cold["case"] == "cold ttft 32" and len(cold["ttft_ms_runs"]) == 4 and cold["ttft_ms"] > 0
    busy = cold["scheduler"]
    assert 0 < busy["busy_ms_per_request"] < cold["ttft_ms_while_sampled"], cold  # the scheduler's share of a TTFT
    assert busy["idle_samples"] > 0 and busy["buckets"]["Cedar: prefill forward (Python and kernels)"] > 0.1, busy


def test_bench_scheduler_refuses_a_malformed_case_with_a_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "scheduler", "--cases", "8",
                           "--json", str(tmp_path / "x.json")], timeout=120, capture_output=True, text=True)
    assert done.returncode != 0 and "--cases: expected BATCHxCONTEXT" in done.stderr
    done = subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "scheduler", "--ttft", "16,x",
                           "--json", str(tmp_path / "x.json")], timeout=120, capture_output=True, text=True)
    assert done.returncode != 0 and "--ttft: expected LENGTH" in done.stderr
    assert not (tmp_path / "x.json").exists()
