"""Weights on disk: `cedar init-model` writes an HF-style folder that loads back bit-identically;
wrong or truncated files are rejected with a clear error."""

import json
import subprocess
import sys

import pytest
import torch

from cedar.backend.config import CEDConfig
from cedar.backend.model_io import WeightsError, load_model, random_model, save_model
from cedar.backend.geometries import cedar_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, "-m", "cedar.cli", "init-model", "--geometry", "cedar-tiny",
                    "--out", str(out)], check=True, capture_output=True)
    return out


def test_init_model_writes_hf_folder(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["CedarForCausalLM"]
    tok = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in tok
    assert cfg["eos_token_id"] == json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]


def test_load_is_bit_identical(model_dir, tmp_path):
    model = load_model(model_dir)
    save_model(model, tmp_path)
    again = load_model(tmp_path)
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    # the same seed gives the same weights; the loaded model is the one that was written
    fresh = random_model(CEDConfig.load(model_dir), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_truncated_file_is_rejected(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        load_model(tmp_path)


def test_wrong_geometry_is_rejected(model_dir, tmp_path):
    other = random_model(cedar_tiny(vocab_size=600), seed=0)
    save_model(other, tmp_path)
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(WeightsError, match="embed_tokens.weight"):
        load_model(tmp_path)


def test_missing_weights_file_is_rejected(model_dir, tmp_path):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(WeightsError):
        load_model(tmp_path)


def test_cli_generate_reference(model_dir):
    out = subprocess.run([sys.executable, "-m", "cedar.cli", "generate", "--model", str(model_dir),
                          "--prompt", "hello", "--max-new-tokens", "5"], check=True, capture_output=True, text=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(d["token_ids"]) == 5 and isinstance(d["text"], str)


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "cedar.cli", "--help"], capture_output=True, text=True).stdout
    for cmd in ("init-model", "memory", "generate", "demo"):
        assert cmd in out
