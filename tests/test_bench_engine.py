"""``cedar bench engine``: the stock twin has Cedar's dims, both servers get the same flags, the
table's ratios point the right way, and a tiny end-to-end run serves both models for real."""

from __future__ import annotations

import json

import pytest
import torch

from cedar.drivers.bench.engine import EngineGrid, StockServe, format_table, run_engine_benchmark, table
from cedar.backend.config import CEDConfig
from cedar.backend.cli import DEFAULT_MODEL_DIR

TINY = EngineGrid(decode=((2, 64),), decode_tokens=8, cold=(64,), hits=((256, 16),), repeats=1,
                  order=("cedar", "stock"))


def test_table_ratios_say_how_much_better_cedar_is():
    runs = [{"engine": "cedar", "probes": {"decode_b1_ctx8": {"tok_s": 120.0}, "ttft_cold_8": {"ms": 50.0},
                                           "hit_8_new2": {"ms": 10.0, "of_cold": 0.2}}},
            {"engine": "stock", "probes": {"decode_b1_ctx8": {"tok_s": 100.0}, "ttft_cold_8": {"ms": 100.0},
                                           "hit_8_new2": {"ms": 20.0, "of_cold": 0.4}}}]
    rows = {r["probe"]: r for r in table(runs)}
    assert rows["decode_b1_ctx8"]["cedar_advantage"] == [1.2]  # a rate: Cedar / stock
    assert rows["ttft_cold_8"]["cedar_advantage"] == [2.0]  # a time: stock / Cedar
    assert rows["hit_8_new2"]["cedar_of_cold"] == [0.2] and rows["hit_8_new2"]["stock_of_cold"] == 0.4
    assert "2.00x" in format_table(table(runs))


def test_a_failed_probe_is_that_probes_error_and_the_engines_other_probes_count(tmp_path):
    """An engine whose b8 decode probe failed keeps its other figures; the failed cell says so,
    the best peer is chosen among the engines that measured it, and the plot still draws."""
    from cedar.drivers.bench.engine import plot

    runs = [{"engine": "cedar", "probes": {"decode_b8_ctx8": {"tok_s": 120.0}, "ttft_cold_8": {"ms": 50.0}}},
            {"engine": "stock", "probes": {"decode_b8_ctx8": {"tok_s": 100.0}, "ttft_cold_8": {"ms": 100.0}}},
            {"engine": "vllm", "probes": {"decode_b8_ctx8": {"error": "RuntimeError: no interval"},
                                          "ttft_cold_8": {"ms": 25.0}}}]
    rows = {r["probe"]: r for r in table(runs)}
    dec, cold = rows["decode_b8_ctx8"], rows["ttft_cold_8"]
    assert dec["vllm"] is None and dec["failed"] == ["vllm"] and dec["best_peer"] == "stock"
    assert dec["cedar_vs_best"] == [1.2]
    assert cold["vllm"] == 25.0 and cold["best_peer"] == "vllm" and cold["cedar_vs_best"] == [0.5] and "failed" not in cold
    text = format_table(table(runs))
    assert "| failed |" in text and "0.50x (vLLM CPU)" in text
    plot(table(runs), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_stock_server_never_loads_cedar_plugin(monkeypatch):
    monkeypatch.setenv("CEDAR_SGLANG_PLUGIN", "1")
    serve = StockServe(model="/m", port=1, extra=("--device", "cpu"))
    assert "CEDAR_SGLANG_PLUGIN" not in serve.env() and serve.env()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert serve.argv()[-2:] == ["--device", "cpu"]


@pytest.mark.slow
def test_tiny_run_serves_cedar_and_a_same_dims_llama(tmp_path):
    out = tmp_path / "engine.json"
    report = run_engine_benchmark(DEFAULT_MODEL_DIR, out, tmp_path / "engine.png", TINY)
    assert json.loads(out.read_text())["table"] == report["table"] and (tmp_path / "engine.png").stat().st_size
    cfg = CEDConfig.load(DEFAULT_MODEL_DIR)
    twin = report["stock_model"]
    assert (twin["hidden_size"], twin["layers"], twin["heads"], twin["intermediate_size"], twin["vocab_size"]) == \
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size)
    cedar, stock = report["runs"]
    assert (cedar["engine"], stock["engine"]) == ("cedar", "stock")

    def flags(argv):  # the SGLang flags after the model path, host and port
        return [a for i, a in enumerate(argv) if i > 0 and argv[i - 1] not in ("--model-path", "--port")
                and a not in ("--model-path", "--port")]
    common = set(flags(stock["server_argv"])) - {"-m", "sglang.launch_server"}
    assert common <= set(flags(cedar["server_argv"]))  # Cedar adds only its own (model args, tool parser)
    for run in report["runs"]:
        p = run["probes"]
        assert p["decode_b2_ctx64"]["tok_s"] > 0 and p["ttft_cold_64"]["ms"] > 0
        assert p["hit_256_new16"]["cached_tokens"] == [256]  # the prefix hit, for both engines
    assert [r["probe"] for r in report["table"]] == ["decode_b2_ctx64", "ttft_cold_64", "hit_256_new16"]
    assert torch.isfinite(torch.tensor(report["table"][0]["cedar_advantage"])).all()
