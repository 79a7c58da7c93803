"""The decode step's byte count (``cedar bench bound``): weights once per step, the caches per
request, each part growing with batch and context as the model reads them."""

import json
import subprocess
import sys

import pytest

from cedar.backend.geometries import cedar_agent
from cedar.backend.model_io import random_model
from cedar.drivers.bench.bound import bound_report, decode_step_bytes

CFG = cedar_agent(2048)


def test_weights_are_every_parameter_once_plus_one_embedding_row_per_request():
    model = random_model(CFG, seed=0)
    params = sum(p.numel() for p in model.parameters())
    one, eight = decode_step_bytes(CFG, 512, 1), decode_step_bytes(CFG, 512, 8)
    emb = model.embed_tokens.weight
    assert one.weights == 4 * (params - emb.numel() + emb.shape[1])
    assert eight.weights - one.weights == 4 * 7 * emb.shape[1]
    assert decode_step_bytes(CFG, 512, 1, weight_bytes=2).weights * 2 == one.weights


def test_cache_reads_scale_per_request_and_saturate_where_the_model_stops_reading():
    W, k = CFG.sliding_window, CFG.index_topk
    a, b = decode_step_bytes(CFG, 4 * W, 1), decode_step_bytes(CFG, 4 * W, 3)
    assert (b.window, b.global_rows, b.index_keys) == (3 * a.window, 3 * a.global_rows, 3 * a.index_keys)
    short, long = decode_step_bytes(CFG, W // 2, 1), decode_step_bytes(CFG, 64 * W, 1)
    assert long.window == decode_step_bytes(CFG, W, 1).window > short.window  # the window stops at W rows
    # top-k entries at most per reading layer; the indexer scans every entry
    assert long.global_rows == decode_step_bytes(CFG, 32 * W, 1).global_rows
    assert long.index_keys == 2 * decode_step_bytes(CFG, 32 * W, 1).index_keys > 0
    assert decode_step_bytes(CFG, 2, 1).global_rows < long.global_rows
    assert long.total == long.weights + long.window + long.global_rows + long.index_keys


def test_the_bound_is_batch_over_bytes_per_bandwidth_and_bad_sizes_are_refused():
    rows = bound_report(CFG, [(1, 512), (8, 512)], bandwidth_gb_s=10.0)
    for r in rows:
        assert r["bound_tok_s"] == pytest.approx(r["batch"] / (r["total"] / 10e9), rel=1e-3)
    assert rows[1]["bound_tok_s"] > 7 * rows[0]["bound_tok_s"]  # weights shared by the batch
    with pytest.raises(ValueError):
        decode_step_bytes(CFG, 0, 1)


def test_cli_writes_the_report(tmp_path):
    out = tmp_path / "bound.json"
    subprocess.run([sys.executable, "-m", "cedar.cli", "bench", "bound", "--json", str(out), "--threads", "1"],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["bandwidth"]["gb_s"] > 0 and len(report["rows"]) == 4
    assert {r["context"] for r in report["rows"]} == {512, 8192}
