"""`cedar stage`: a training stage kept in float16 and restored as the model it was trained as."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from cedar.backend.config import CEDConfig
from cedar.backend.model_io import load_model, save_model
from cedar.training.stages import average, restore, save


def _flagged_copy(src, dst):
    """``src``'s model with ``decoder_global_beyond_window`` set: a flag that changes no tensor."""
    model = load_model(src, quantize=False)
    model.cfg = replace(model.cfg, decoder_global_beyond_window=True)
    shutil.copytree(src, dst)
    save_model(model, dst)
    return model


def test_restore_keeps_the_stage_config_and_its_weights(tiny_model_dir, tmp_path):
    trained = _flagged_copy(tiny_model_dir, tmp_path / "stage")
    save(tmp_path / "stage", tmp_path / "stage.safetensors", note="a test stage")
    # restored beside a model without the flag (the shipped one is the default --like)
    restore(tmp_path / "stage.safetensors", tmp_path / "restored", like=tiny_model_dir)
    cfg = CEDConfig.load(tmp_path / "restored")
    assert cfg.decoder_global_beyond_window and cfg == trained.cfg
    assert not CEDConfig.load(tiny_model_dir).decoder_global_beyond_window
    again = load_model(tmp_path / "restored", quantize=False)
    for (name, a), b in zip(trained.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.to(torch.float16).to(a.dtype), b), name
    assert json.loads((tmp_path / "restored" / "stage.json").read_text())["note"] == "a test stage"


def test_a_stage_saved_without_its_config_takes_the_like_models(tiny_model_dir, tmp_path):
    _flagged_copy(tiny_model_dir, tmp_path / "stage")
    save(tmp_path / "stage", tmp_path / "stage.safetensors", note="")
    save_file(load_file(str(tmp_path / "stage.safetensors")), str(tmp_path / "bare.safetensors"),
              metadata={"note": "no config"})
    restore(tmp_path / "bare.safetensors", tmp_path / "restored", like=tiny_model_dir)
    assert CEDConfig.load(tmp_path / "restored") == CEDConfig.load(tiny_model_dir)


def test_average_is_the_mean_of_each_tensor_and_a_stage_of_its_own(tiny_model_dir, tmp_path):
    """`cedar stage average`: every weight the mean of the two folders' (not either one's), the
    config and tokenizer of the stage, a training.json warm-started from the stage's; folders of
    two geometries are refused."""
    shutil.copytree(tiny_model_dir, tmp_path / "stage")
    moved = load_model(tiny_model_dir, quantize=False)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1.0)
    save_model(moved, tmp_path / "stage")
    (tmp_path / "stage" / "training.json").write_text(json.dumps({"command": "cedar train X", "parameters": 7,
                                                                  "steps": 5, "tokens_seen": 10}))
    average(tmp_path / "stage", tiny_model_dir, tmp_path / "mean", note="half way")
    base, mean = load_model(tiny_model_dir, quantize=False).state_dict(), load_model(tmp_path / "mean", quantize=False)
    for name, w in mean.state_dict().items():
        if w.is_floating_point() and name in dict(moved.named_parameters()):
            assert torch.allclose(w, base[name] + 0.5, atol=1e-6), name
    tr = json.loads((tmp_path / "mean" / "training.json").read_text())
    assert tr["steps"] == 0 and tr["note"] == "half way" and tr["parameters"] == 7
    assert tr["warm_start"]["command"] == "cedar train X"
    assert (tmp_path / "mean" / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    average(tmp_path / "stage", tiny_model_dir, tmp_path / "quarter", weight=0.25)  # the stage's share
    quarter = load_model(tmp_path / "quarter", quantize=False).state_dict()
    for name in dict(moved.named_parameters()):
        if quarter[name].is_floating_point():
            assert torch.allclose(quarter[name], base[name] + 0.25, atol=1e-6), name
    assert json.loads((tmp_path / "quarter" / "training.json").read_text())["command"].endswith("--weight 0.25")
    with pytest.raises(ValueError, match="strictly between"):
        average(tmp_path / "stage", tiny_model_dir, tmp_path / "no", weight=1.0)
    _flagged_copy(tiny_model_dir, tmp_path / "flagged")
    with pytest.raises(ValueError, match="configs differ"):
        average(tmp_path / "flagged", tiny_model_dir, tmp_path / "no")
