"""`cedar stage`: a training stage kept in float16 and restored as the model it was trained as."""

import json
import shutil
from dataclasses import replace

import torch
from safetensors.torch import load_file, save_file

from cedar.backend.config import CEDConfig
from cedar.backend.model_io import load_model, save_model
from cedar.training.stages import restore, save


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
