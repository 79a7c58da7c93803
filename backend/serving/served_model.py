"""CedarForCausalLM: the CED model as an SGLang model class (the ``EntryClass`` of
``cedar.backend.sglang_models``).

SGLang runs its own scheduler, radix tree and HTTP server around it. This class is the thin
end SGLang calls: it loads the weights and hands each ForwardBatch to its
:class:`~.runtime.CedarRuntime` (``self.runtime.forward``, which reads the batch's host facts),
which owns what SGLang has no notion
of (the FP4 global rows per token slot, the private window state per request slot, snapshots,
bounded replay) and runs the step; the logits go through SGLang's own LogitsProcessor. One
``forward`` = one batched pass over every request's rows (replay rows included; :mod:`planner`).

SGLang itself allocates no per-layer K/V for this model (``start_layer == end_layer == 0``);
its per-token budget is Cedar's true bytes per token (the cell-size hook in
:mod:`sglang_hooks`), and the runtime's ``allocate`` sizes Cedar's pools from SGLang's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch
from torch import Tensor, nn

from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet

from ..model import CEDModel
from .hf_config import CedarHFConfig, ced_config_of
from .planner import ServingFlags
from .runtime import CedarRuntime


def flags_from_config(hf_config) -> ServingFlags:
    """Serving flags travel in the HF config (``--json-model-override-args``), not env vars."""
    raw = dict(getattr(hf_config, "cedar_serving", None) or {})
    return ServingFlags(**{f.name: raw[f.name] for f in dataclasses.fields(ServingFlags) if f.name in raw})


class HeadMethod:
    """The LM head's ``quant_method``: how SGLang's LogitsProcessor multiplies by a head that
    carries one (its extension point for heads that are not a plain matmul). It calls the head's
    own forward (:class:`~cedar.backend.modules.LMHead`: a decode step's rows through
    ``cedar_cpu::linear`` on the fast CPU backend), so the served logits are the reference's bits
    and the head is read at the memory's speed rather than by ``torch.matmul``'s few-row GEMM."""

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        out = layer(x)
        return out if bias is None else out + bias

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # NOTE: SGLang's loader calls it
        return None


class CedarForCausalLM(nn.Module):
    start_layer = 0  # NOTE: SGLang sizes per-layer K/V from end - start: none for CED layers
    end_layer = 0

    def __init__(self, config: CedarHFConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.config = config
        self.cfg = ced_config_of(config)
        flags = flags_from_config(config)
        # NOTE: SGLang builds the model under ``with torch.device(...)``: pools and kernels follow it
        self.device = torch.get_default_device()
        kernels = KernelSet.for_device(self.device.type, flags.kernels)
        if kernels.backend == "fast":
            cpu_ext.available()  # NOTE: load (or build) the C++ kernels now, not in the first request
        self.model = CEDModel(self.cfg, kernels=kernels, quantize=True)
        self.lm_head = self.model.lm_head
        self.lm_head.quant_method = HeadMethod()
        self.logits_processor = LogitsProcessor(config)
        self.runtime = CedarRuntime(self.model, flags, self.device)

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

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, input_embeds=None,
                get_embedding: bool = False, pp_proxy_tensors=None):
        t0 = time.perf_counter()
        step = self.runtime.forward(input_ids, forward_batch)
        hidden = step.hidden if step is not None else torch.zeros(input_ids.shape[0], self.cfg.hidden_size,
                                                                    device=self.device)
        out = self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)
        if step is not None:
            out.customized_info = self.runtime.meta_info(step.plan)
            self.runtime.stats.time_forward(step.kind, time.perf_counter() - t0)
        return out
