"""The SGLang patch surface is pinned: if the installed SGLang is not the version the hooks were
written for, or a hooked target moved or changed signature, this fails loudly (re-check every
hook in backend/serving/sglang_hooks.py before changing the pin)."""

import importlib.metadata
import inspect
import pkgutil

import pytest

from cedar.backend.serving import sglang_hooks, tool_call_hooks

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
}
ALL_TARGETS = {**{("serving", k): v for k, v in sglang_hooks.TARGETS.items()},
               **{("tool_call", k): v for k, v in tool_call_hooks.TARGETS.items()}}
ALL_PARAMS = {**{("serving", k): v for k, v in EXPECTED_PARAMS.items()},
              **{("tool_call", k): v for k, v in TOOL_CALL_PARAMS.items()}}


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
