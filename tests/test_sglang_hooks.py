"""The SGLang patch surface is pinned: if the installed SGLang is not the version the hooks were
written for, or a hooked target moved or changed signature, this fails loudly (re-check every
hook in backend/serving/sglang_hooks.py before changing the pin)."""

import importlib.metadata
import inspect
import pkgutil

import pytest

from cedar.backend.serving import seed_hooks, sglang_hooks, tool_call_hooks

# target -> the parameters the hook relies on (in order, after self/cls)
EXPECTED_PARAMS = {
    "cell_size": ["self", "kvc", "num_layers"],
    "alloc": ["self", "memory_pool_config"],
    "init_new": ["cls", "batch", "model_runner"],
    "meta_info": ["self", "meta_info", "state", "customized_info", "index", "finish_reason"],
    "validate": ["self", "obj", "input_ids"],
    "release": ["req", "tree_cache", "checkpoint"],
    "checkpoint": ["self", "req", "up_to"],
    "state": ["self", "recv_req"],
    "handlers": ["self"],
    "replay_len": ["self", "req", "prefix_len"],
    "set_state": ["self", "obj"],
}
TOOL_CALL_PARAMS = {
    "structural_tag": ["self", "key_string"],
    "json": ["self", "key_string"],
    "effective_tools": ["self", "request"],
    "legacy_tag": ["self", "at_least_one"],
}
SEED_PARAMS = {"seed_batch": ["cls", "batch", "vocab_size"], "seed_merge": ["self", "other"],
               "seeded_draw": ["logprobs", "seed", "positions"]}
ALL_TARGETS = {**{("serving", k): v for k, v in sglang_hooks.TARGETS.items()},
               **{("tool_call", k): v for k, v in tool_call_hooks.TARGETS.items()},
               **{("seed", k): v for k, v in seed_hooks.TARGETS.items()}}
ALL_PARAMS = {**{("serving", k): v for k, v in EXPECTED_PARAMS.items()},
              **{("tool_call", k): v for k, v in TOOL_CALL_PARAMS.items()},
              **{("seed", k): v for k, v in SEED_PARAMS.items()}}


def test_sglang_version_is_the_pinned_one():
    assert importlib.metadata.version("sglang") == sglang_hooks.SGLANG_VERSION, (
        "SGLang changed: re-check every hook target in cedar/backend/serving/sglang_hooks.py")


@pytest.mark.parametrize("name", sorted(ALL_TARGETS))
def test_hook_targets_exist_with_expected_signature(name):
    target = ALL_TARGETS[name]
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = inspect.getattr_static(owner, attr)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    fn = inspect.unwrap(fn)
    params = list(inspect.signature(fn).parameters)
    assert params[: len(ALL_PARAMS[name])] == ALL_PARAMS[name], (target, params)


def test_every_target_is_tested():
    assert set(ALL_PARAMS) == set(ALL_TARGETS)


def test_install_refuses_another_version(monkeypatch):
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.0.0")
    with pytest.raises(RuntimeError, match="written for sglang"):
        sglang_hooks.install()


def test_plugin_is_inert_unless_enabled(monkeypatch):
    from cedar.backend.serving import plugin

    monkeypatch.delenv("CEDAR_SGLANG_PLUGIN", raising=False)
    calls = []
    monkeypatch.setattr(sglang_hooks, "install", lambda: calls.append(1))
    plugin.register()
    assert calls == []
    eps = [ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")]
    assert "cedar.backend.serving.plugin:register" in eps


def test_pinned_tool_call_internals():
    """What the tool-call fixes read inside SGLang / xgrammar besides the targets: the parser
    registry `--tool-call-parser` reads, the hermes detector Cedar's parser extends, and
    xgrammar's JSON string rule that `markup_free_strings` replaces."""
    import json

    import xgrammar
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.function_call.hermes_detector import HermesDetector

    from cedar.backend.serving import tool_call_parser

    assert tool_call_parser.register() is FunctionCallParser.ToolCallParserEnum[tool_call_parser.PARSER_NAME]
    assert issubclass(FunctionCallParser.ToolCallParserEnum["cedar"], HermesDetector)
    for attr in ("parse_base_json", "structure_info", "prev_tool_call_arr", "streamed_args_for_tool"):
        assert hasattr(HermesDetector(), attr), attr
    printed = str(xgrammar.Grammar.from_json_schema(json.dumps({"type": "string"}), any_whitespace=False))
    assert tool_call_hooks.STRING_RULE in printed


def test_seeded_draw_on_cpu_is_the_kernels_hash():
    """The CPU seeded draw hashes (seed, position, column) as SGLang's Triton kernel does
    (MurmurHash3 over four 32-bit words), so a seed picks the same Gumbel noise on every device."""
    import torch

    def kernel_hash(seed: int, pos: int, col: int) -> int:  # murmur_hash32_kernel, in Python
        m = 0xFFFFFFFF
        h = 0
        for k in (seed & m, (seed >> 32) & m, pos & m, col & m):
            k = (k * 0xCC9E2D51) & m
            k = ((k << 15) | (k >> 17)) & m
            h ^= (k * 0x1B873593) & m
            h = ((((h << 13) | (h >> 19)) & m) * 5 + 0xE6546B64) & m
        h ^= 16
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m
        return h ^ (h >> 16)

    seeds, positions = torch.tensor([7, 2**40 + 3, 2**62 - 1]), torch.tensor([0, 5, 4095])
    got = seed_hooks.murmur_hash32(seeds, positions, torch.arange(5))
    assert got.tolist() == [[kernel_hash(int(s), int(p), c) for c in range(5)] for s, p in zip(seeds, positions)]
    logprobs = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    draw = [seed_hooks.around_seeded_draw(None, logprobs, seeds, positions) for _ in range(2)]
    assert torch.equal(draw[0], draw[1])  # the same seed and position: the same token
    zeros = torch.zeros(24, dtype=torch.long)
    other = seed_hooks.around_seeded_draw(None, logprobs.repeat(8, 1), torch.arange(24), zeros)
    assert len(set(other.view(-1).tolist())) > 1  # different seeds: different tokens
    assert seed_hooks.request_seeds([None, None], [0.0, 0.0]) is None
    assert seed_hooks.request_seeds([5, None], [0.0, 0.1]) is None  # min_p: SGLang's seeded sampler refuses it
    mixed = seed_hooks.request_seeds([5, None], [0.0, 0.0])
    assert mixed[0] == 5 and mixed[1] != seed_hooks.request_seeds([5, None], [0.0, 0.0])[1]
