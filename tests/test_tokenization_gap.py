"""scripts/tokenization_gap.py: history cut at gens vs tokenized whole, scored by the reference model."""

import importlib.util
from pathlib import Path

import pytest

from cedar.training.corpus.build import make_tasks, run_scripted

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "cedar-agent"


def _script():
    spec = importlib.util.spec_from_file_location("tokenization_gap", ROOT / "scripts" / "tokenization_gap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="no shipped model")
def test_the_gap_is_zero_where_both_tokenizations_agree_and_not_where_calls_merge():
    gap = _script().gap
    task = make_tasks(3, "train", {"function-calling": 1})[0]
    text = run_scripted(task)[0]
    served = gap(MODEL, [{"kind": "function-calling", "text": text}])
    assert served["messages"] >= 2
    assert any(abs(d) > 1e-3 for d in served["per_message"])  # the whole history is other tokens
    same = gap(MODEL, [{"kind": "plain", "text": text}])  # plain text is one piece either way
    assert same["messages"] == served["messages"] and all(d == 0.0 for d in same["per_message"])
