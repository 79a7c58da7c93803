"""CEDConfig: roles derived from the layout, HF config.json round trip, clear errors."""

import dataclasses
import json

import pytest

from cedar.backend.config import CEDConfig, Role
from cedar.backend.geometries import cedar_tiny, geometry, v41_flash


def test_v41_flash_roles():
    cfg = v41_flash()
    roles = cfg.roles
    assert roles[0] == roles[1] == Role.SWA
    assert [i for i, r in enumerate(roles) if r is Role.FULL] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r is Role.REINDEX] == [24, 28, 32, 36]
    assert cfg.decoder_start == 20
    assert [cfg.kv_source_of(i) for i in (3, 7, 9, 19, 21, 39)] == [2, 2, 8, 14, 20, 20]
    assert [cfg.topk_source_of(i) for i in (3, 21, 25, 39)] == [2, 20, 24, 36]
    assert cfg.is_encoder(19) and not cfg.is_encoder(20)


def test_cedar_tiny_has_every_role():
    cfg = cedar_tiny()
    assert cfg.roles == (Role.SWA, Role.FULL, Role.REUSE, Role.REUSE,
                         Role.FULL, Role.REUSE, Role.REINDEX, Role.REUSE)
    assert cfg.compress_ratios[1] == 2 and cfg.compress_ratios[cfg.decoder_start] == 1
    assert [cfg.kv_source_of(i) for i in range(8)] == [None, 1, 1, 1, 4, 4, 4, 4]
    assert [cfg.topk_source_of(i) for i in range(8)] == [None, 1, 1, 1, 4, 4, 6, 6]


@pytest.mark.parametrize("name", ["cedar-tiny", "v41-flash"])
def test_hf_json_round_trip(tmp_path, name):
    cfg = geometry(name)
    cfg.save(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["architectures"] == ["CedarForCausalLM"] and d["model_type"] == "cedar_ced"
    assert d["compress_ratios"] == list(cfg.compress_ratios)
    assert CEDConfig.load(tmp_path) == cfg


def _bad(**changes):
    return dataclasses.replace(cedar_tiny(), **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4)),
     None),  # valid variant: sanity of the helper
    (dict(kv_source_layer_ids=(4,), index_source_layer_ids=(4,)), "no KV source before it"),
    (dict(compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1)), "decoder source must be layer L/2"),
    (dict(kv_source_layer_ids=(1, 5), index_source_layer_ids=(1, 5)), "decoder source must be layer L/2"),
    (dict(page_size=3), "does not divide page_size"),
    (dict(compress_ratios=(0, 2, 2, 2, 1, 1)), "compress_ratios has 6 entries"),
    (dict(num_hidden_layers=7, compress_ratios=(0, 2, 2, 1, 1, 1, 1)), "must be even"),
    (dict(index_source_layer_ids=(4, 6)), "every KV source must also be an index source"),
    (dict(compress_ratios=(0, 2, 2, 2, 1, 1, 2, 1)), "ratio 2 but its source 4 has ratio 1"),
    (dict(rope_dim=15), "rope_dim"),
    (dict(kv_latent_dim=48), "multiples of 32"),
    (dict(hidden_size=0), "hidden_size must be positive"),
])
def test_inconsistent_configs_raise(changes, message):
    if message is None:
        _bad(**changes)
        return
    with pytest.raises(ValueError, match=message):
        _bad(**changes)


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        CEDConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CEDConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        CEDConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "cedar_ced", "vocab_size": 10}))
    with pytest.raises(ValueError, match="missing fields"):
        CEDConfig.load(tmp_path)
