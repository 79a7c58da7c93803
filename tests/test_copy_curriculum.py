"""``cedar curriculum`` (``training/curriculum.py``), the curriculum the shipped model's copying is trained with: a
stopped run resumes from its checkpoint (written atomically), its logs keep each step once, and
``--export`` writes a model folder that loads."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from cedar.backend.model_io import load_model

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, *extra: str) -> None:
    argv = [sys.executable, "-m", "cedar.cli", "curriculum", "--init", "models/cedar-agent", "--out", str(out),
            "--seq-len", "128", "--batch", "1", "--precision", "fp32", *extra]
    subprocess.run(argv, check=True, cwd=ROOT, timeout=600, capture_output=True)


def test_a_stopped_curriculum_resumes_from_its_checkpoint(tmp_path):
    _run(tmp_path, "--steps", "2")
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 2
    # a run stopped between checkpoints had logged a step it will redo: the resume drops it
    with open(tmp_path / "curve.jsonl", "a") as log:
        log.write(json.dumps({"step": 2, "loss": 0.0, "repeat_acc": 0.0, "seconds": 0.0}) + "\n")
    _run(tmp_path, "--steps", "3")
    curve = [json.loads(line) for line in (tmp_path / "curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [0, 1, 2] and curve[-1]["loss"] > 0
    assert [json.loads(line)["step"] for line in (tmp_path / "probes.jsonl").read_text().splitlines()] == [2, 3]
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 3
    assert not (tmp_path / "state.tmp").exists()
    _run(tmp_path, "--export", str(tmp_path / "model"))
    model = load_model(tmp_path / "model", quantize=False)
    saved = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
