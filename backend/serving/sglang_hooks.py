"""Everything Cedar changes in SGLang's behaviour, in one module, through SGLang's own
``HookRegistry`` (no installed file is edited). Written for SGLANG_VERSION; ``install()`` refuses
another version, and ``tests/test_sglang_hooks.py`` fails loudly when the pin or a target moves.

Each hook is a no-op for models other than Cedar's. A hook reads the SGLang facts it needs and
delegates to the serving model's :class:`~.runtime.CedarRuntime`, which owns Cedar's side of
every seam (the table there says which method serves which hook).

| target | why |
|---|---|
| DefaultPoolConfigurator._compute_cell_size | budget Cedar's true bytes per token slot |
| ModelRunner.alloc_memory_pool | size Cedar's pools from SGLang's, log the figures |
| ForwardBatch.init_new | carry per-request facts the model needs (last chunk, prompt logprobs) |
| TokenizerManager.update_request_meta_info | report cumulative counters once, not per token |
| mem_cache.common.release_kv_cache | snapshot a finished request's window state (exact continuation) |
| UnifiedRadixCache.checkpoint_into_tree | re-key that snapshot by the token slots the tree kept (a
  concurrent duplicate's slots are freed) |
| TokenizerManager._validate_one_request | reject empty prompts and token ids outside the vocabulary
  with a 400 (SGLang does not check ids; an out-of-range id would crash the scheduler) |
| PrefillAdder._replay_len | charge the prefill budget the replay rows a new request will run
  (SGLang's own admission already subtracts them from the chunk), so no forward outgrows it |
| SchedulerInternalStateController.get_internal_state / _update_handlers | expose pools and
  integrity under /get_server_info; let /set_internal_state flip the replay benchmark switch |
| TokenizerManager.set_internal_state | a bad Cedar switch (unknown, or not 0/1) gets a 400 with a
  message (SGLang answers a rejected update 200 ``[false]``) |

Tool-calling fixes (any model) live in ``tool_call_hooks.py``, repeatable seeded sampling (any
model) in ``seed_hooks.py``, both installed from here.

A hook that did not install stops the server: ``hook_status`` reads every target back from the
live SGLang objects, the plugin (``plugin.py``) exits non-zero naming each missing one, and
``/get_server_info`` lists them all under ``cedar.hooks`` (target, installed; as the scheduler
process sees them). ``tests/test_sglang_hooks.py`` also pins the SGLang attributes the hook
bodies read.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pkgutil

from ..config import MODEL_TYPE
from . import runtime, seed_hooks, tool_call_hooks

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
P = "sglang.srt."
TARGETS = {
    "cell_size": P + "model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
    "alloc": P + "model_executor.model_runner.ModelRunner.alloc_memory_pool",
    "init_new": P + "model_executor.forward_batch_info.ForwardBatch.init_new",
    "meta_info": P + "managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
    "validate": P + "managers.tokenizer_manager.TokenizerManager._validate_one_request",
    "release": P + "mem_cache.common.release_kv_cache",
    "checkpoint": P + "mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree",
    "replay_len": P + "managers.schedule_policy.PrefillAdder._replay_len",
    "state": P + "managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
    "set_state": P + "managers.tokenizer_manager.TokenizerManager.set_internal_state",
    "handlers": P + "managers.scheduler_components.internal_state.SchedulerInternalStateController._update_handlers",
}
SWITCHES, REPLAY_SWITCH, switch_problem = runtime.SWITCHES, runtime.REPLAY_SWITCH, runtime.switch_problem


def _is_cedar(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) == MODEL_TYPE


def _runtime(model_runner) -> "runtime.CedarRuntime | None":
    """The Cedar runtime of the model this runner serves (None for another model's)."""
    return getattr(getattr(model_runner, "model", None), "runtime", None) if _serves_cedar(model_runner) else None


def _serves_cedar(model_runner) -> bool:
    from .served_model import CedarForCausalLM

    return isinstance(getattr(model_runner, "model", None), CedarForCausalLM)


def cell_size(original, self, kvc, num_layers):
    if not _is_cedar(kvc.model_config.hf_config):
        return original(self, kvc, num_layers)
    from ..memory import budget_bytes_per_token
    from .hf_config import ced_config_of

    return budget_bytes_per_token(ced_config_of(kvc.model_config.hf_config))


def after_alloc(result, model_runner, *args, **kwargs):
    rt = _runtime(model_runner)
    if rt is not None:
        from sglang.srt.runtime_context import get_schedule

        chunk, need = get_schedule().chunked_prefill_size, rt.cfg.sliding_window + model_runner.page_size
        if chunk is not None and 0 < chunk < need:
            raise ValueError(f"--chunked-prefill-size {chunk} leaves no room for a hit's {rt.cfg.sliding_window} "
                             f"replay rows: serve with at least {need}")
        # NOTE: SGLang's slot ids run over [0, size + page_size): page 0 is its padding page.
        figures = rt.allocate(model_runner.token_to_kv_pool.size + model_runner.page_size,
                              model_runner.req_to_token_pool.req_to_token.shape[0], model_runner.page_size,
                              sglang_pool=model_runner.req_to_token_pool)
        logger.info("cedar memory: SGLang budgets %d B/token for %d tokens; SWA %d B/request; pools %s",
                    figures["budget_bytes_per_token"], model_runner.max_total_num_tokens,
                    figures["swa_bytes_per_request"], figures)
    return result


def around_replay_len(original, self, req, prefix_len):
    rt = runtime.runtime_for(getattr(self.tree_cache, "req_to_token_pool", None))
    if rt is None:
        return original(self, req, prefix_len)
    # NOTE: the matched slots are known only for the tree's own match (no host-tier hits here)
    slots = self.tree_cache.prefix_device_indices(req) if 0 < prefix_len <= req.prefix_len else None
    rows = rt.admission_replay_rows(prefix_len, None if slots is None else slots[:prefix_len])
    limit = self.rem_chunk_tokens
    if rows and limit is not None and not self.can_run_list and rows > limit - self.page_size:
        # NOTE: only `--replay exact` (the whole prefix, a reference mode) gets here (the alloc
        # hook keeps the chunk above W + a page): such a request runs alone, over the budget,
        # rather than never.
        return max(limit - self.page_size, 0)
    return rows


def after_init_new(forward_batch, cls, batch, model_runner, *args, **kwargs):
    rt = _runtime(model_runner)
    if rt is None or not forward_batch.forward_mode.is_extend():
        return forward_batch
    from .planner import RequestInfo

    decoding = {id(r) for r in (batch.decoding_reqs or ())}
    for req in batch.reqs:
        if id(req) in decoding:
            continue
        final = req.extend_end == len(req.full_untruncated_fill_ids)
        wants = bool(req.return_logprob) and req.logprob_start_len is not None \
            and 0 <= req.logprob_start_len < len(req.origin_input_ids) - 1
        rt.note_request(int(req.kv.req_pool_idx), req.prefix_len,
                        RequestInfo(final_chunk=final, prompt_logprobs=wants))
    return forward_batch


def before_release(req, tree_cache, *args, checkpoint: bool = False, **kwargs):
    rt = runtime.runtime_for(getattr(tree_cache, "req_to_token_pool", None))
    if rt is not None and checkpoint and req.finished() and req.kv.holds_kv:
        rt.on_request_finished(int(req.kv.req_pool_idx), req.rid)
    return None


def after_checkpoint(result, self, req, *args, **kwargs):
    rt = runtime.runtime_for(self.req_to_token_pool)
    if rt is not None and req.finished() and req.kv.holds_kv:
        kept = req.kv.cache_protected_len
        rt.on_request_inserted(req.rid, self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :kept])
    return None


def around_meta_info(original, self, meta_info, state, customized_info, index, finish_reason):
    original(self, meta_info, state, customized_info, index, finish_reason)
    from .stats import META_KEYS

    for key in META_KEYS:  # cumulative counters: the last value is the request's total
        values = [v for v in (meta_info.get(key) or []) if v is not None]
        if key in meta_info:
            meta_info[key] = values[-1] if values else 0


def before_validate(self, obj, input_ids, *args, **kwargs):
    hf = getattr(getattr(self, "model_config", None), "hf_config", None)
    if hf is None or not _is_cedar(hf):
        return None
    if input_ids is not None:
        if len(input_ids) == 0:
            raise ValueError("the prompt is empty: send at least one token")
        bad = [t for t in input_ids if not 0 <= int(t) < hf.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {hf.vocab_size})")
    _check_sizes(obj, hf.vocab_size)
    return None


def _check_sizes(obj, vocab_size: int) -> None:
    """Request fields that size a tensor in the scheduler, refused here with a 400: a top-k
    larger than the vocabulary killed the scheduler (SGLang's sampler calls topk out of range)."""
    tops = getattr(obj, "top_logprobs_num", None)
    for top in tops if isinstance(tops, list) else [tops]:
        if top is not None and not (isinstance(top, int) and 0 <= top <= vocab_size):
            raise ValueError(f"top_logprobs_num must be an integer in [0, {vocab_size}], got {top!r}")
    ids = getattr(obj, "token_ids_logprob", None) or []
    for t in (i for group in ids for i in (group if isinstance(group, list) else [group])):
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            raise ValueError(f"token_ids_logprob: token id {t!r} is out of range [0, {vocab_size})")
    starts = getattr(obj, "logprob_start_len", None)
    for start in starts if isinstance(starts, list) else [starts]:
        # NOTE: a start below -1 failed an assertion in SGLang's logprob processor and killed the
        # scheduler; past the prompt SGLang answers a 400 itself
        if start is not None and not (isinstance(start, int) and start >= -1):
            raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position, got {start!r}")
    params = getattr(obj, "sampling_params", None)
    for sp in params if isinstance(params, list) else [params]:
        n = sp.get("n") if isinstance(sp, dict) else None
        if n is not None and not (isinstance(n, int) and n >= 1):
            raise ValueError(f"sampling_params.n must be an integer >= 1, got {n!r}")


def after_state(output, self, recv_req):
    rt = _runtime(self.scheduler.tp_worker.model_runner)
    if rt is not None:
        from .integrity import pool_integrity

        running = self.scheduler.running_batch.reqs if self.scheduler.running_batch else []
        state = rt.internal_state({int(r.kv.req_pool_idx): r.rid for r in running if r.kv.req_pool_idx is not None})
        state["integrity"] = {**pool_integrity(self.scheduler), **state["integrity"]}
        state["hooks"] = [dataclasses.asdict(h) for h in hook_status()]
        output.internal_state["cedar"] = state
    return output


def after_handlers(handlers, self):
    rt = _runtime(self.scheduler.tp_worker.model_runner)
    if rt is None:
        return handlers

    def validate(key, value):
        problem = switch_problem({key: value})
        if problem is not None:
            from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

            raise UpdateRejected(problem)

    def apply(key, value):
        rt.set_switch(key, bool(value))
        return {}

    handler_cls = type(next(iter(handlers.values())))
    for key in SWITCHES:
        handlers[key] = handler_cls(validate, apply)
    return handlers


async def around_set_state(original, self, obj, *args, **kwargs):
    hf = getattr(getattr(self, "model_config", None), "hf_config", None)
    problem = switch_problem(getattr(obj, "server_args", None)) if hf is not None and _is_cedar(hf) else None
    if problem is not None:
        from fastapi.responses import ORJSONResponse

        return ORJSONResponse(status_code=400, content={"error": {"message": problem}})
    return await original(self, obj, *args, **kwargs)


def install() -> None:
    """Register every hook (called by the plugin in each SGLang process)."""
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"cedar's SGLang hooks were written for sglang {SGLANG_VERSION}, "
                           f"found {sglang.__version__}: re-check every target in {__name__}")
    HookRegistry.register(TARGETS["cell_size"], cell_size, HookType.AROUND)
    HookRegistry.register(TARGETS["alloc"], after_alloc, HookType.AFTER)
    HookRegistry.register(TARGETS["init_new"], after_init_new, HookType.AFTER)
    HookRegistry.register(TARGETS["meta_info"], around_meta_info, HookType.AROUND)
    HookRegistry.register(TARGETS["validate"], before_validate, HookType.BEFORE)
    HookRegistry.register(TARGETS["release"], before_release, HookType.BEFORE)
    HookRegistry.register(TARGETS["checkpoint"], after_checkpoint, HookType.AFTER)
    HookRegistry.register(TARGETS["replay_len"], around_replay_len, HookType.AROUND)
    HookRegistry.register(TARGETS["state"], after_state, HookType.AFTER)
    HookRegistry.register(TARGETS["set_state"], around_set_state, HookType.AROUND)
    HookRegistry.register(TARGETS["handlers"], after_handlers, HookType.AFTER)
    tool_call_hooks.install()
    seed_hooks.install()



@dataclasses.dataclass(frozen=True)
class HookStatus:
    """One hook target and whether Cedar's hook is live on it in this process."""

    name: str  # the key in its module's TARGETS, e.g. "validate"
    module: str  # the Cedar module that owns the hook, e.g. "seed_hooks"
    target: str  # the dotted SGLang path
    installed: bool


def hook_status() -> list[HookStatus]:
    """Every Cedar hook target (this module's, ``tool_call_hooks``'s, ``seed_hooks``'s) with
    whether it is installed, read from the live SGLang objects (not from what was registered).

    A target counts as installed when the attribute now at its path is a wrapper chain (SGLang's
    ``_wrap_fn``: ``functools.wraps`` plus ``__wrapped__``) one of whose wrappers closes over a
    function defined in the owning Cedar module. A target that no longer resolves, or whose
    attribute is SGLang's own function, is not installed.
    """
    import sys

    out = []
    for module in (sys.modules[__name__], tool_call_hooks, seed_hooks):
        short = module.__name__.rsplit(".", 1)[-1]
        for name, target in module.TARGETS.items():
            out.append(HookStatus(name, short, target, _installed(target, module.__name__)))
    return out


def _installed(target: str, module_name: str) -> bool:
    owner_path, attr = target.rsplit(".", 1)
    try:
        fn = inspect.getattr_static(pkgutil.resolve_name(owner_path), attr)
    except (ImportError, AttributeError, ValueError):
        return False
    fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and getattr(value, "__module__", None) == module_name:
                return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def missing_hooks_message(status: list[HookStatus]) -> str | None:
    """The refusal naming every hook that is not installed, or None when all are."""
    missing = [h for h in status if not h.installed]
    if not missing:
        return None
    names = ", ".join(f"{h.module}.{h.name} ({h.target})" for h in missing)
    return (f"cedar: {len(missing)} SGLang hook(s) did not install: {names}. SGLang logs a failing "
            f"hook and carries on; Cedar refuses to serve without it (see the log above for why, "
            f"and re-check the target against sglang {SGLANG_VERSION})")
