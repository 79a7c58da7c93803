"""Everything Cedar changes in SGLang's behaviour, in one module, through SGLang's own
``HookRegistry`` (no installed file is edited). Written for SGLANG_VERSION; ``install()`` refuses
another version, and ``tests/test_sglang_hooks.py`` fails loudly when the pin or a target moves.

Each hook is a no-op for models other than Cedar's. A hook reads the SGLang facts it needs and
makes one call: to the serving model's :class:`~.runtime.CedarRuntime`, which owns Cedar's side
of every seam (the table there says which method serves which hook), or, in the tokenizer's
process where no runtime lives, to a pure function (:mod:`validation`, :mod:`stats`,
``runtime.switch_problem``). Every SGLang object a hook reads is read here and nowhere else in the
serving core; the hooks are registered through :mod:`seam`, the one module that touches SGLang's
``HookRegistry``.

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
import logging
import sys

from ..config import MODEL_TYPE
from . import runtime, seam, seed_hooks, tool_call_hooks, tool_call_parser
from .integrity import pool_integrity
from .planner import RequestInfo
from .stats import collapse_counters
from .validation import check_request

logger = logging.getLogger(__name__)

SGLANG_VERSION = seam.SGLANG_VERSION
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


def _cedar_hf(tokenizer_manager):
    """The tokenizer manager's HF config when it serves Cedar's model, else None."""
    hf = getattr(getattr(tokenizer_manager, "model_config", None), "hf_config", None)
    return hf if hf is not None and _is_cedar(hf) else None


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

        # NOTE: SGLang's slot ids run over [0, size + page_size): page 0 is its padding page.
        rt.allocate(model_runner.token_to_kv_pool.size + model_runner.page_size,
                    model_runner.req_to_token_pool.req_to_token, model_runner.page_size,
                    chunked_prefill_size=get_schedule().chunked_prefill_size,
                    budget_tokens=model_runner.max_total_num_tokens, sglang_pool=model_runner.req_to_token_pool)
    return result


def around_replay_len(original, self, req, prefix_len):
    rt = runtime.runtime_for(getattr(self.tree_cache, "req_to_token_pool", None))
    if rt is None:
        return original(self, req, prefix_len)
    # NOTE: the matched slots are known only for the tree's own match (no host-tier hits here)
    slots = self.tree_cache.prefix_device_indices(req) if 0 < prefix_len <= req.prefix_len else None
    return rt.admission_replay_rows(prefix_len, None if slots is None else slots[:prefix_len],
                                    budget=self.rem_chunk_tokens, page_size=self.page_size, alone=not self.can_run_list)


def after_init_new(forward_batch, cls, batch, model_runner, *args, **kwargs):
    rt = _runtime(model_runner)
    if rt is None or not batch.forward_mode.is_extend():
        return forward_batch
    decoding = {id(r) for r in (batch.decoding_reqs or ())}
    for req in (r for r in batch.reqs if id(r) not in decoding):
        start = req.logprob_start_len
        rt.note_request(int(req.kv.req_pool_idx), req.prefix_len, req.rid, RequestInfo(
            final_chunk=req.extend_end == len(req.full_untruncated_fill_ids),
            prompt_logprobs=bool(req.return_logprob) and start is not None and 0 <= start < len(req.origin_input_ids) - 1))
    return forward_batch


def before_release(req, tree_cache, *args, checkpoint: bool = False, **kwargs):
    rt = runtime.runtime_for(getattr(tree_cache, "req_to_token_pool", None))
    if rt is not None and checkpoint and req.finished() and req.kv.holds_kv:
        rt.on_request_finished(int(req.kv.req_pool_idx), req.rid)
    return None


def after_checkpoint(result, self, req, *args, **kwargs):
    rt = runtime.runtime_for(self.req_to_token_pool)
    if rt is not None and req.finished() and req.kv.holds_kv:
        rt.on_request_inserted(req.rid, self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :req.kv.cache_protected_len])
    return None


def around_meta_info(original, self, meta_info, state, customized_info, index, finish_reason):
    original(self, meta_info, state, customized_info, index, finish_reason)
    collapse_counters(meta_info)


def before_validate(self, obj, input_ids, *args, **kwargs):
    hf = _cedar_hf(self)
    if hf is not None:
        check_request(input_ids, getattr(obj, "top_logprobs_num", None), getattr(obj, "token_ids_logprob", None),
                      getattr(obj, "logprob_start_len", None), getattr(obj, "sampling_params", None), hf.vocab_size)
    return None


def after_state(output, self, recv_req):
    rt = _runtime(self.scheduler.tp_worker.model_runner)
    if rt is not None:
        running = self.scheduler.running_batch.reqs if self.scheduler.running_batch else []
        output.internal_state["cedar"] = rt.internal_state(
            {int(r.kv.req_pool_idx): r.rid for r in running if r.kv.req_pool_idx is not None},
            sglang_pools=_scheduler_pools(self.scheduler), hooks=[dataclasses.asdict(h) for h in hook_status()])
    return output


def _scheduler_pools(scheduler) -> dict:
    """SGLang's token and request-slot accounting, read through its own pool-stats observer and
    invariant checker (:func:`integrity.pool_integrity` judges it)."""
    ps = scheduler.pool_stats_observer.get_pool_stats()
    in_use, _ = scheduler.invariant_checker._get_total_uncached_sizes()
    rtp = scheduler.req_to_token_pool
    return pool_integrity(
        tokens={"total": int(scheduler.max_total_num_tokens), "free": int(ps.full_available_size),
                "cached": int(ps.full_evictable_size), "protected": int(scheduler.tree_cache.protected_size()),
                "in_use": int(in_use), "session_held": int(scheduler.pool_stats_observer.session_held_tokens())},
        request_slots={"total": int(rtp.size), "free": len(rtp.free_slots),
                       "running": len(scheduler.running_batch.reqs) if scheduler.running_batch else 0})


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

    handler_cls = type(next(iter(handlers.values())))  # NOTE: SGLang's _UpdateHandler(validate, apply)
    for key in SWITCHES:
        handlers[key] = handler_cls(validate, apply)
    return handlers


async def around_set_state(original, self, obj, *args, **kwargs):
    problem = switch_problem(getattr(obj, "server_args", None)) if _cedar_hf(self) is not None else None
    if problem is not None:
        from fastapi.responses import ORJSONResponse

        return ORJSONResponse(status_code=400, content={"error": {"message": problem}})
    return await original(self, obj, *args, **kwargs)


HOOKS = {
    "cell_size": (cell_size, "around"),
    "alloc": (after_alloc, "after"),
    "init_new": (after_init_new, "after"),
    "meta_info": (around_meta_info, "around"),
    "validate": (before_validate, "before"),
    "release": (before_release, "before"),
    "checkpoint": (after_checkpoint, "after"),
    "replay_len": (around_replay_len, "around"),
    "state": (after_state, "after"),
    "set_state": (around_set_state, "around"),
    "handlers": (after_handlers, "after"),
}


def install() -> None:
    """Register every hook (called by the plugin in each SGLang process)."""
    seam.check_version("SGLang hooks", f"every target in {__name__}")
    for module in (sys.modules[__name__], tool_call_hooks, seed_hooks):
        seam.register(module)
    tool_call_parser.register()  # NOTE: SGLang's parser registry, a supported extension point


HookStatus = seam.HookStatus
missing_hooks_message = seam.missing_message


def hook_status() -> list[seam.HookStatus]:
    """Every Cedar hook target of the server (this module's, ``tool_call_hooks``'s,
    ``seed_hooks``'s) with whether it is installed, read from the live SGLang objects."""
    return seam.status(sys.modules[__name__], tool_call_hooks, seed_hooks)
