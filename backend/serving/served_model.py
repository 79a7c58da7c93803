"""CedarForCausalLM: the CED model as an SGLang model class (the ``EntryClass`` of
``cedar.backend.sglang_models``).

SGLang runs its own scheduler, radix tree and HTTP server around it. The model owns what SGLang
has no notion of: the FP4 global rows per token slot, the private window state per request slot,
and bounded replay. One ``forward`` = one batched pass over every request's rows (replay rows
included; :mod:`planner`), so replay never costs a separate forward (unless the
``replay_per_request`` benchmark switch asks for upstream's old behaviour).

SGLang itself allocates no per-layer K/V for this model (``start_layer == end_layer == 0``);
its per-token budget is Cedar's true bytes per token (the cell-size hook in
:mod:`sglang_hooks`), and :meth:`allocate` sizes Cedar's pools from SGLang's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Iterable

import torch
from torch import Tensor, nn

from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet

from ..memory import budget_bytes_per_token, memory_report
from ..model import CEDModel
from .hf_config import CedarHFConfig, ced_config_of
from .planner import RequestInfo, ServedForward, ServingFlags, admission_replay_rows, plan_forward
from .pool_keys import PoolKeys
from .prepass import replay_prepass
from .pools import RequestSlots, TokenPools
from .snapshots import SnapshotStore
from .stats import ServingStats

logger = logging.getLogger(__name__)


def served_step(model: CEDModel, pools: TokenPools, slots: RequestSlots, plan: ServedForward,
                num_rows: int) -> Tensor:
    """One planned forward: keys from the pools, the layers, the commit, and the normed last
    hidden state of each of SGLang's ``num_rows`` scheduled rows ((num_rows, hidden) f32 on the
    pools' device; 0 for a row whose decoder did not run).

    NOTE: no value is read back to the host and no shape depends on one (a decode step's
    tables are sized from the plan's host facts; the rows are scattered through a sink row, not
    cut by a mask): what a whole-step native call or a captured graph needs
    (``tests/test_decode_step_sync_free.py``)."""
    keys = PoolKeys(model.cfg, model.codec, pools, slots, plan)
    dec = model.run_layers(model.embed(plan.input_ids), plan.batch, keys)
    keys.commit()
    hidden = torch.zeros(num_rows + 1, model.cfg.hidden_size, device=pools.device)  # row num_rows: the sink
    if dec is not None:
        sched = plan.sched_index[dec.source_row.clamp_min(0)]
        ok = (dec.source_row >= 0) & (sched >= 0)  # replay rows and carried-over rows go to the sink
        hidden[torch.where(ok, sched, num_rows)] = model.norm(dec.hidden)
    return hidden[:num_rows]


def flags_from_config(hf_config) -> ServingFlags:
    """Serving flags travel in the HF config (``--json-model-override-args``), not env vars."""
    raw = dict(getattr(hf_config, "cedar_serving", None) or {})
    return ServingFlags(**{f.name: raw[f.name] for f in dataclasses.fields(ServingFlags) if f.name in raw})


class CedarForCausalLM(nn.Module):
    start_layer = 0  # NOTE: SGLang sizes per-layer K/V from end - start: none for CED layers
    end_layer = 0

    def __init__(self, config: CedarHFConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.config = config
        self.cfg = ced_config_of(config)
        self.flags = flags_from_config(config)
        # NOTE: SGLang builds the model under ``with torch.device(...)``: pools and kernels follow it
        self.device = torch.get_default_device()
        kernels = KernelSet.for_device(self.device.type, self.flags.kernels)
        if kernels.backend == "fast":
            cpu_ext.available()  # NOTE: load (or build) the C++ kernels now, not in the first request
        self.model = CEDModel(self.cfg, kernels=kernels, quantize=True)
        self.lm_head = self.model.lm_head
        self.logits_processor = LogitsProcessor(config)
        self.pools: TokenPools | None = None
        self.slots: RequestSlots | None = None
        self.stats = ServingStats()
        # (rid, prefix len) -> facts of the scheduler (written by the ForwardBatch.init_new hook)
        self.request_infos: dict[tuple[str, int], RequestInfo] = {}

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        own = self.model.state_dict()
        seen = set()
        for name, tensor in weights:
            if name not in own:
                raise ValueError(f"unexpected weight {name!r} for CedarForCausalLM")
            if own[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r}: expected {tuple(own[name].shape)}, got {tuple(tensor.shape)}")
            own[name].copy_(tensor)
            seen.add(name)
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    # ------------------------------------------------------------------ pools
    def allocate(self, num_token_slots: int, num_request_slots: int, page_size: int) -> dict:
        """Called once SGLang has sized its pools (hook on ModelRunner.alloc_memory_pool)."""
        if page_size % self.cfg.page_size:
            raise ValueError(f"SGLang page size {page_size} is not a multiple of the model's "
                             f"{self.cfg.page_size} (serve with --page-size {self.cfg.page_size})")
        self.pools = TokenPools(self.cfg, num_token_slots, self.device)
        self.slots = RequestSlots(self.cfg, num_request_slots, self.device)
        self.snapshots = SnapshotStore(int(self.flags.snapshot_mb * 2**20)) if self.flags.snapshot_mb > 0 else None
        figures = self.memory_figures()
        logger.info("cedar pools: %s", json.dumps(figures))
        return figures

    def memory_figures(self) -> dict:
        report = memory_report(self.cfg)
        figures = {
            "budget_bytes_per_token": budget_bytes_per_token(self.cfg),
            "global_bytes_per_token": report.global_bytes_per_token,
            "swa_bytes_per_request": report.swa_bytes_per_request,
        }
        if self.pools is not None:
            figures.update(
                token_slots=self.pools.num_slots, token_pool_bytes=self.pools.nbytes,
                request_slots=self.slots.num_slots, request_slot_bytes=self.slots.nbytes,
                swa_bytes_per_request_allocated=self.slots.window_bytes_per_slot,
                snapshots=self.snapshots.stats() if self.snapshots is not None else None)
        return figures

    def kernel_info(self) -> dict:
        """Which kernels serve: the dispatch backend, and on CPU whether the C++ kernels loaded."""
        ks = self.model.kernels
        return {"backend": ks.backend, "cpu_ext": ks.backend == "fast" and cpu_ext.available()}

    def on_request_finished(self, slot: int, rid: str) -> bool:
        """A request finished (release hook): keep its slot's state for exact continuation."""
        if self.snapshots is None or not self.flags.snapshots or self.slots is None \
                or self.slots.owners[slot].rid != rid:
            return False
        return self.snapshots.save(self.slots, slot, self.slots.owners[slot].hasher)

    def on_request_inserted(self, rid: str, tree_slots: Tensor) -> None:
        """The tree took a finished request's prefix (tree_slots: (n,) the slots it kept, the
        request's own or an earlier copy's): key its snapshot by those (see SnapshotStore.rekey)."""
        if self.snapshots is not None and self.pools is not None:
            self.snapshots.rekey(rid, tree_slots, self.pools.token_ids)

    def admission_replay_rows(self, hit: int, prefix_slots: Tensor | None) -> int:
        """Replay rows SGLang's prefill budget must charge a request admitted at a prefix hit of
        ``hit`` tokens (the ``PrefillAdder._replay_len`` hook); see planner.admission_replay_rows."""
        if self.pools is None:
            return 0
        return admission_replay_rows(self.cfg, self.flags, self.pools, self.snapshots, hit, prefix_slots)

    def _ensure_pools(self) -> None:
        if self.pools is None:  # the allocation hook did not run: fail loudly, never guess
            raise RuntimeError("cedar pools were not allocated: the SGLang plugin hooks are not active")

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, input_embeds=None,
                get_embedding: bool = False, pp_proxy_tensors=None):
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        self._ensure_pools()
        t0 = time.perf_counter()
        fb = forward_batch
        if fb.forward_mode.is_idle() or input_ids.numel() == 0:
            hidden = torch.zeros(input_ids.shape[0], self.cfg.hidden_size, device=self.device)
            return self.logits_processor(input_ids, hidden, self.lm_head, fb)
        req_to_token = get_req_to_token_pool().req_to_token
        self.pools.token_ids[fb.out_cache_loc.long()] = input_ids.int()
        kind = "decode" if fb.forward_mode.is_decode() else "extend"
        if kind == "decode":
            prefix = (fb.seq_lens_cpu - 1).tolist()
            ext = [1] * fb.batch_size
        else:
            prefix, ext = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        rids = list(fb.rids)
        req_slots = (fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices).tolist()
        infos = [self.request_infos.pop((rid, p), RequestInfo()) for rid, p in zip(rids, prefix)]
        if self.flags.replay_per_request:
            for pre in replay_prepass(self.model, self.flags, self.slots, self.pools, req_to_token,
                                      rids, req_slots, prefix, self.snapshots):
                self.stats.record(pre)
        plan = plan_forward(self.cfg, self.flags, self.slots, self.pools, req_to_token, rids, req_slots,
                            prefix, ext, input_ids, infos, self.snapshots)
        hidden = served_step(self.model, self.pools, self.slots, plan, input_ids.shape[0])
        self.stats.record(plan, kind)
        out = self.logits_processor(input_ids, hidden, self.lm_head, fb)
        out.customized_info = self.stats.meta_info(plan, self.slots)
        self.stats.time_forward(kind, time.perf_counter() - t0)
        return out
