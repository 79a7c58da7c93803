"""Tokenizer build (round trip, specials, chat template, determinism) and safetensors weights I/O."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cedar.backend.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_FILES,
    build_tokenizer,
    generation_eos_token_ids,
    special_token_ids,
)
from cedar.backend.weights import WEIGHTS_FILE, WeightsError, load_weights, save_weights


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


# ---------------------------------------------------------------------------------- tokenizer


def test_vocab_and_special_ids(tokenizer_dir, hf_tokenizer):
    ids = special_token_ids(tokenizer_dir)
    assert ids == {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    assert list(ids)[:3] == ["<|bos|>", "<|eos|>", "<|pad|>"] and ids["<|end|>"] == 7
    assert len(hf_tokenizer) == 512
    for token, token_id in ids.items():
        assert hf_tokenizer.encode(token, add_special_tokens=False) == [token_id], token
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        0, 7, 2)
    assert generation_eos_token_ids(tokenizer_dir) == [7, 1]


@pytest.mark.parametrize("text", [
    "The cached request reads the token before the window is ready.",
    '{"name": "search", "arguments": {"query": "cedar 12345", "limit": 10}, "ok": [1, 2.5e-3]}',
    "def f(x):\n\treturn x ** 2  # tabs,\r\n  double  spaces  ",
    "héllo wörld: 世界 🙂 \u200b Ω≈ç√",
    "",
])
def test_round_trip(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text
    # encode adds no BOS/EOS: the chat template owns <|bos|>.
    assert hf_tokenizer(text).input_ids == ids


def test_unseen_unicode_falls_back_to_bytes(hf_tokenizer):
    # None of these characters is in the training corpus: one token per UTF-8 byte, no unk.
    for char in ("世", "🙂", "ø"):
        assert len(hf_tokenizer.encode(char, add_special_tokens=False)) == len(char.encode())


def test_merges_compress_corpus_like_text(hf_tokenizer):
    text = 'def read_cache(self, cache_id: int) -> list[str]:\n    return {"id": 12, "ok": true}'
    assert len(hf_tokenizer.encode(text, add_special_tokens=False)) < len(text) // 2


def test_specials_inside_text(hf_tokenizer):
    ids = hf_tokenizer.encode("<|user|>hi there<|end|>", add_special_tokens=False)
    assert ids[0] == 4 and ids[-1] == 7 and 4 not in ids[1:-1]
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "hi there"


def test_chat_template(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>{"name":"get_weather", "arguments":{}}</tool_call>'},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|user|>Weather in Paris?<|end|>"
        '<|assistant|><tool_call>{"name":"get_weather", "arguments":{}}</tool_call><|end|>'
        '<|tool|>{"temp": 21}<|end|><|assistant|>'
    )
    without_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == text.removesuffix("<|assistant|>")
    # As SGLang calls it: one BOS, turn boundaries are single ids, ends on <|assistant|>.
    ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:2] == [0, 4] and ids[-1] == 5
    assert ids.count(0) == 1 and ids.count(7) == 3
    assert hf_tokenizer.decode(ids) == text


def test_chat_template_rejects_unknown_role(hf_tokenizer):
    with pytest.raises(Exception, match="unknown chat role: critic"):
        hf_tokenizer.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)


def test_build_is_deterministic(tokenizer_dir, tmp_path):
    build_tokenizer(tmp_path / "same_process")
    # NOTE: a second process too: the trainer's hash maps are seeded per process.
    code = "import sys; from pathlib import Path; from cedar.backend.tokenizer import build_tokenizer;"
    code += " build_tokenizer(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other_process")], check=True)
    for name in TOKENIZER_FILES:
        reference = (tokenizer_dir / name).read_bytes()
        assert (tmp_path / "same_process" / name).read_bytes() == reference, name
        assert (tmp_path / "other_process" / name).read_bytes() == reference, name


def test_vocab_too_small_raises(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=264)


# ------------------------------------------------------------------------------------ weights


def _state_dict() -> dict[str, torch.Tensor]:
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40])
    embed = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: shares storage with embed.weight
        "layers.0.attn.q_proj.weight": torch.randn(8, 4).to(torch.bfloat16).t(),  # non-contiguous
        "layers.0.attn.sink": special,
        "layers.0.norm.weight": special.to(torch.bfloat16),
        "layers.0.compress_ratio": torch.tensor([0, 2, 1], dtype=torch.int64),
        "scale_e4m3_codes": torch.arange(-128, 128, dtype=torch.int8).reshape(16, 16),
        "scalar": torch.tensor(3, dtype=torch.int32),
    }


def _expected(state_dict) -> dict:
    return {name: (tuple(t.shape), t.dtype) for name, t in state_dict.items()}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def saved(tmp_path):
    state_dict = _state_dict()
    save_weights(state_dict, tmp_path)
    return tmp_path, state_dict


def test_weights_round_trip_bit_identical(saved):
    model_dir, state_dict = saved
    loaded = load_weights(model_dir, _expected(state_dict))
    assert loaded.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert loaded[name].device.type == "cpu"
        assert _bytes(loaded[name]) == _bytes(tensor), name
    with safe_open(str(model_dir / WEIGHTS_FILE), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "cedar_format_version": "1"}


def test_missing_file(tmp_path):
    with pytest.raises(WeightsError, match="not found") as info:
        load_weights(tmp_path, {})
    assert str(tmp_path / WEIGHTS_FILE) in str(info.value)


def test_truncated_file(saved):
    model_dir, state_dict = saved
    path = model_dir / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated or corrupt") as info:
        load_weights(model_dir, _expected(state_dict))
    assert str(path) in str(info.value)


def test_corrupt_header_length(saved):
    model_dir, state_dict = saved
    path = model_dir / WEIGHTS_FILE
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    path.write_bytes(struct.pack("<Q", header_len ^ (1 << 40)) + data[8:])
    with pytest.raises(WeightsError, match="truncated or corrupt") as info:
        load_weights(model_dir, _expected(state_dict))
    assert str(path) in str(info.value)


def test_missing_and_unexpected_tensors(tmp_path):
    state_dict = _state_dict()
    expected = _expected(state_dict)
    del state_dict["layers.0.attn.sink"]
    state_dict["layers.9.extra"] = torch.zeros(2)
    save_weights(state_dict, tmp_path)
    with pytest.raises(WeightsError) as info:
        load_weights(tmp_path, expected)
    message = str(info.value)
    assert "1 missing tensor(s): layers.0.attn.sink" in message
    assert "1 unexpected tensor(s): layers.9.extra" in message


def test_many_missing_names_are_abbreviated(tmp_path):
    save_weights({}, tmp_path)
    expected = {f"w{i}": ((1,), torch.float32) for i in range(8)}
    with pytest.raises(WeightsError, match=r"8 missing tensor\(s\): w0, w1, w2, w3, w4, \.\.\. "
                                           r"\(3 more\)"):
        load_weights(tmp_path, expected)


def test_wrong_shape_and_dtype(saved):
    model_dir, state_dict = saved
    expected = _expected(state_dict)
    expected["embed.weight"] = ((8, 16), torch.float32)
    expected["scalar"] = ((), torch.int64)
    with pytest.raises(WeightsError) as info:
        load_weights(model_dir, expected)
    message = str(info.value)
    assert "embed.weight: expected shape (8, 16) torch.float32, got (16, 8) torch.float32" in message
    assert "scalar: expected shape () torch.int64, got () torch.int32" in message


def test_other_format_version(tmp_path):
    save_file({"w": torch.zeros(1)}, str(tmp_path / WEIGHTS_FILE),
              metadata={"format": "pt", "cedar_format_version": "2"})
    with pytest.raises(WeightsError, match="cedar_format_version '2'"):
        load_weights(tmp_path, {"w": ((1,), torch.float32)})
