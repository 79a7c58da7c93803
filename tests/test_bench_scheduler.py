"""``cedar bench scheduler``: each sample lands in the first bucket whose frame its stack holds,
and through a real server the scheduler's samples are found and fall in Cedar's forward."""

import collections
import json
import subprocess
import sys

import pytest

from cedar.drivers.bench.scheduler import BUCKETS, OTHER, breakdown, bucket_of

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


def test_bench_scheduler_profiles_a_real_servers_scheduler(tiny_model_dir, tmp_path):
    out = tmp_path / "sched.json"
    subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "scheduler", "--model", str(tiny_model_dir),
                    "--cases", "1x128", "--tokens", "60", "--repeats", "1", "--json", str(out),
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


def test_bench_scheduler_refuses_a_malformed_case_with_a_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "scheduler", "--cases", "8",
                           "--json", str(tmp_path / "x.json")], timeout=120, capture_output=True, text=True)
    assert done.returncode != 0 and "--cases: expected BATCHxCONTEXT" in done.stderr
    assert not (tmp_path / "x.json").exists()
