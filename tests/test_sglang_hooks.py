"""The SGLang patch surface is pinned: if the installed SGLang is not the version the hooks were
written for, or a hooked target moved or changed signature, this fails loudly (re-check every
hook in backend/serving/sglang_hooks.py before changing the pin)."""

import dataclasses
import importlib.metadata
import inspect
import pkgutil

import pytest

from cedar.backend.serving import seed_hooks, sglang_hooks, tool_call_hooks
from cedar.frontend import executor_fix

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
EXECUTOR_PARAMS = {"executor_del": ["self"], "state_del": ["self"]}
SEED_PARAMS = {"seed_batch": ["cls", "batch", "vocab_size"], "seed_merge": ["self", "other"],
               "seeded_draw": ["logprobs", "seed", "positions"]}
ALL_TARGETS = {**{("serving", k): v for k, v in sglang_hooks.TARGETS.items()},
               **{("tool_call", k): v for k, v in tool_call_hooks.TARGETS.items()},
               **{("seed", k): v for k, v in seed_hooks.TARGETS.items()},
               **{("frontend", k): v for k, v in executor_fix.TARGETS.items()}}
# the hooks the server's processes install and report (the frontend fix is the client's)
SERVER_TARGETS = {k: v for k, v in ALL_TARGETS.items() if k[0] != "frontend"}
MODULE_KEYS = {"sglang_hooks": "serving", "tool_call_hooks": "tool_call", "seed_hooks": "seed"}
ALL_PARAMS = {**{("serving", k): v for k, v in EXPECTED_PARAMS.items()},
              **{("tool_call", k): v for k, v in TOOL_CALL_PARAMS.items()},
              **{("seed", k): v for k, v in SEED_PARAMS.items()},
              **{("frontend", k): v for k, v in EXECUTOR_PARAMS.items()}}


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


# What the hook bodies read on SGLang objects besides the targets' parameters, read off the
# bodies in sglang_hooks.py, tool_call_hooks.py and seed_hooks.py, and what the runtime and the
# model class read off a ForwardBatch and the logits output: class -> attributes. A version
# bump that renames one would otherwise surface as an AttributeError (or a silently skipped
# `getattr(..., None)` branch) inside a running server.
S = "sglang.srt."
READ_ATTRS = {
    # cell_size
    S + "mem_cache.kv_cache_configurator.KVCacheConfigurator": ["model_config"],
    S + "configs.model_config.ModelConfig": ["hf_config"],
    # after_alloc, after_state (via tp_worker.model_runner)
    S + "model_executor.model_runner.ModelRunner": [
        "model", "page_size", "token_to_kv_pool", "req_to_token_pool", "max_total_num_tokens"],
    S + "mem_cache.memory_pool.KVCache": ["size"],
    S + "mem_cache.memory_pool.ReqToTokenPool": ["req_to_token", "size", "free_slots"],
    # around_replay_len
    S + "managers.schedule_policy.PrefillAdder": ["tree_cache", "rem_chunk_tokens", "can_run_list", "page_size"],
    # around_replay_len, after_checkpoint, before_release (tree_cache.req_to_token_pool)
    S + "mem_cache.unified_radix_cache.UnifiedRadixCache": ["req_to_token_pool", "prefix_device_indices",
                                                             "protected_size"],
    # after_init_new, before_release, after_checkpoint, after_state, seed hooks
    S + "managers.schedule_batch.Req": [
        "rid", "prefix_len", "kv", "finished", "extend_end", "full_untruncated_fill_ids", "return_logprob",
        "logprob_start_len", "origin_input_ids", "sampling_params"],
    S + "managers.schedule_batch.ReqKvInfo": ["holds_kv", "req_pool_idx", "cache_protected_len"],
    S + "managers.schedule_batch.ScheduleBatch": ["reqs", "decoding_reqs", "forward_mode"],
    S + "model_executor.forward_batch_info.ForwardMode": ["is_extend", "is_decode", "is_idle"],
    # runtime.CedarRuntime.forward and StepInput.of (the ForwardBatch SGLang's model class gets)
    S + "model_executor.forward_batch_info.ForwardBatch": [
        "forward_mode", "out_cache_loc", "seq_lens_cpu", "batch_size", "extend_prefix_lens_cpu",
        "extend_seq_lens_cpu", "req_pool_indices_cpu", "req_pool_indices", "rids"],
    # served_model: the logits output's per-request meta channel
    S + "layers.logits_processor.LogitsProcessorOutput": ["customized_info"],
    # before_validate, around_set_state
    S + "managers.tokenizer_manager.TokenizerManager": ["model_config"],
    S + "managers.io_struct.GenerateReqInput": [
        "top_logprobs_num", "token_ids_logprob", "logprob_start_len", "sampling_params"],
    S + "managers.io_struct.SetInternalStateReq": ["server_args"],
    # after_state, after_handlers
    S + "managers.scheduler_components.internal_state.SchedulerInternalStateController": ["scheduler"],
    S + "managers.scheduler.Scheduler": [
        "tp_worker", "running_batch", "pool_stats_observer", "invariant_checker", "max_total_num_tokens",
        "tree_cache", "req_to_token_pool"],
    # after_state's pool figures (_scheduler_pools)
    S + "managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver": [
        "get_pool_stats", "session_held_tokens"],
    S + "managers.scheduler_components.pool_stats_observer.PoolStats": ["full_available_size", "full_evictable_size"],
    S + "managers.scheduler_components.invariant_checker.SchedulerInvariantChecker": ["_get_total_uncached_sizes"],
    S + "managers.tp_worker.TpModelWorker": ["model_runner"],
    S + "managers.io_struct.GetInternalStateReqOutput": ["internal_state"],
    # tool_call_hooks
    S + "constrained.xgrammar_backend.XGrammarGrammarBackend": ["any_whitespace"],
    S + "entrypoints.openai.protocol.ChatCompletionRequest": ["tool_choice"],
    S + "entrypoints.openai.protocol.ToolChoice": ["function"],
    S + "entrypoints.openai.protocol.Tool": ["function"],
    S + "entrypoints.openai.protocol.Function": ["name", "parameters"],
    S + "function_call.function_call_parser.FunctionCallParser": ["tools"],
    S + "entrypoints.openai.protocol.LegacyStructuralTagResponseFormat": ["structures"],
    S + "entrypoints.openai.protocol.StructuresResponseFormat": ["schema_"],
    # seed_hooks
    S + "sampling.sampling_batch_info.SamplingBatchInfo": ["sampling_seed", "temperatures"],
    S + "sampling.sampling_params.SamplingParams": ["sampling_seed", "min_p"],
}
# module-level names the hook bodies import from SGLang
READ_NAMES = [S + "runtime_context.get_schedule", S + "constrained.utils.is_legacy_structural_tag",
              S + "managers.scheduler_components.internal_state.UpdateRejected",
              S + "entrypoints.openai.protocol.ToolChoice"]


def instance_attributes(cls) -> set[str]:
    """Every attribute an instance of ``cls`` has by its class's own declaration (source
    inspection, since the scheduler's objects are hard to build): class attributes, methods and
    properties; annotations; dataclass, pydantic and msgspec fields; and every ``self.<name> = ...``
    assigned in a method of ``cls`` or a base."""
    import ast
    import dataclasses
    import textwrap

    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= set(vars(klass))  # NOTE: an Enum's dir() lists its members, not its methods
        for declared in (klass.__dict__.get("__annotations__"), getattr(klass, "model_fields", None),
                         getattr(klass, "__struct_fields__", None)):
            if isinstance(declared, (dict, tuple)):
                names |= set(declared)
        if dataclasses.is_dataclass(klass):
            names |= {f.name for f in dataclasses.fields(klass)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


@pytest.mark.parametrize("owner", sorted(READ_ATTRS))
def test_attributes_the_hooks_read_exist(owner):
    cls = pkgutil.resolve_name(owner)
    missing = sorted(set(READ_ATTRS[owner]) - instance_attributes(cls))
    assert not missing, f"{owner} no longer has {missing}: re-check the hook bodies that read them"


@pytest.mark.parametrize("name", READ_NAMES)
def test_names_the_hooks_import_exist(name):
    assert pkgutil.resolve_name(name) is not None


def test_attribute_check_can_fail():
    """The source scan finds `self.x =` assignments, and only those of the class and its bases."""
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo

    assert {"rid", "kv", "origin_input_ids"} <= instance_attributes(Req)
    assert "cache_protected_len_gone" not in instance_attributes(ReqKvInfo)
    assert "rem_chunk_tokens" not in instance_attributes(Req)


_LOAD_PLUGINS = """
import json, sys
from cedar.backend.serving import sglang_hooks
if sys.argv[1:]:
    sglang_hooks.TARGETS["validate"] = sys.argv[1]
from sglang.srt.plugins import load_plugins
load_plugins()
print("HOOKS", json.dumps([[h.module, h.name, h.installed] for h in sglang_hooks.hook_status()]))
"""


def _load_plugins_in_a_fresh_process(*argv: str):
    """SGLang's own ``load_plugins`` (what every server process runs) in a child, so the hooks
    never patch this test process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CEDAR_SGLANG_PLUGIN="1")
    return subprocess.run([sys.executable, "-c", _LOAD_PLUGINS, *argv], env=env, capture_output=True,
                          text=True, timeout=300)


def test_load_plugins_installs_every_hook():
    import json

    done = _load_plugins_in_a_fresh_process()
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("HOOKS "))
    status = {(MODULE_KEYS[m], n): ok for m, n, ok in json.loads(line[len("HOOKS "):])}
    assert status == {name: True for name in SERVER_TARGETS}


def test_a_hook_that_does_not_install_stops_the_process():
    """A moved target: SGLang's ``apply_hooks`` logs it and carries on; the plugin exits non-zero
    with a message naming the hook, before the process does anything else."""
    bogus = sglang_hooks.P + "managers.tokenizer_manager.TokenizerManager._validate_one_request_gone"
    done = _load_plugins_in_a_fresh_process(bogus)
    assert done.returncode != 0
    assert "HOOKS" not in done.stdout
    assert f"1 SGLang hook(s) did not install: sglang_hooks.validate ({bogus})" in done.stderr


def test_plugin_exits_when_install_raises(monkeypatch):
    """SGLang's loader logs a plugin's exception and carries on; the plugin turns it into an exit."""
    from cedar.backend.serving import hf_config, plugin

    def wrong_version():
        raise RuntimeError("cedar's SGLang hooks were written for sglang 0.5.23, found 0.0.0")

    monkeypatch.setenv("CEDAR_SGLANG_PLUGIN", "1")
    monkeypatch.setattr(hf_config, "register_auto_config", lambda: None)
    monkeypatch.setattr(sglang_hooks, "install", wrong_version)
    with pytest.raises(SystemExit, match="installing the SGLang hooks failed: .*written for sglang"):
        plugin.register()


def test_hook_status_reads_the_live_objects():
    """In this process no hook is applied: every target resolves and none counts as installed."""
    status = sglang_hooks.hook_status()
    assert {(MODULE_KEYS[h.module], h.name) for h in status} == set(SERVER_TARGETS)
    assert not any(h.installed for h in status)
    message = sglang_hooks.missing_hooks_message(status)
    assert message.startswith(f"cedar: {len(SERVER_TARGETS)} SGLang hook(s) did not install")
    assert sglang_hooks.missing_hooks_message([dataclasses.replace(h, installed=True) for h in status]) is None


def test_server_info_lists_every_hook(server):
    hooks = server.cedar_state()["hooks"]
    assert {(MODULE_KEYS[h["module"]], h["name"]): (h["target"], h["installed"]) for h in hooks} == {
        name: (target, True) for name, target in SERVER_TARGETS.items()}


def test_importing_the_frontend_changes_nothing_in_sglang_and_the_endpoint_fix_is_a_pinned_hook():
    """In a fresh interpreter: importing cedar.frontend (and its endpoint module) leaves SGLang's
    StreamExecutor.__del__ as SGLang wrote it; install() puts the fix on it through SGLang's hook
    registry, read back from the live class, and a second install changes nothing."""
    import subprocess
    import sys

    # NOTE: ids, not references: SGLang's registry rebinds every module global that holds the
    # original function (``_propagate_patch``), a test's own variables included
    code = (
        "import inspect\n"
        "from sglang.lang.interpreter import StreamExecutor\n"
        "now = lambda: id(inspect.getattr_static(StreamExecutor, '__del__'))\n"
        "before = now()\n"
        "import cedar.frontend, cedar.frontend.endpoint, cedar.frontend.server\n"
        "from cedar.frontend import executor_fix\n"
        "assert now() == before, 'import patched SGLang'\n"
        "assert not executor_fix.installed()\n"
        "executor_fix.install(); once = now()\n"
        "executor_fix.install()\n"
        "assert executor_fix.installed() and once != before and now() == once\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_frontend_fix_refuses_another_sglang_version(monkeypatch):
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.0.1")
    with pytest.raises(RuntimeError, match="written for sglang"):
        executor_fix.install()


def sglang_internals_by_module() -> dict[str, set[str]]:
    """Every SGLang internal a Cedar module imports (``sglang.<module>.<name>``; the package's
    public API, ``import sglang`` and ``from sglang import ...``, is not internal) -> the Cedar
    files that import it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found: dict[str, set[str]] = {}
    for layer in ("kernels", "backend", "frontend", "agents", "training", "drivers", "cli"):
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang."):
                    names = [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.startswith("sglang.")]
                else:
                    continue
                for name in names:
                    found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def test_each_sglang_internal_is_reached_from_one_cedar_module():
    """No SGLang internal is imported by two Cedar modules, and only the seam touches SGLang's
    hook registry (the hook modules declare tables; ``seam.register`` installs them)."""
    found = sglang_internals_by_module()
    assert found["sglang.srt.plugins.hook_registry.HookRegistry"] == {"backend/serving/seam.py"}
    shared = {name: sorted(files) for name, files in found.items() if len(files) > 1}
    assert not shared, shared


def test_the_internals_scan_sees_imports():
    found = sglang_internals_by_module()
    assert found["sglang.srt.function_call.hermes_detector.HermesDetector"] == {"backend/serving/tool_call_parser.py"}
    assert not any(name in ("sglang", "sglang.function") for name in found)  # the public API is not counted
