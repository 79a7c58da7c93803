"""The forward step of the served model: one planned forward over the pools. Every caller runs
this function: :class:`runtime.CedarRuntime` (which SGLang's model class calls), the
per-request replay prepass, the GPU check and the tests' harness."""

from __future__ import annotations

import torch
from torch import Tensor

from ..model import CEDModel
from .native_step import native_decode, runs_native
from .planner import ServedForward
from .pool_keys import PoolKeys
from .pools import RequestSlots, TokenPools


def served_step(model: CEDModel, pools: TokenPools, slots: RequestSlots, plan: ServedForward,
                num_rows: int) -> tuple[Tensor, Tensor]:
    """One planned forward: keys from the pools, the layers, the commit. Returns the normed last
    hidden state of each of SGLang's ``num_rows`` scheduled rows ((num_rows, hidden) f32 on the
    pools' device; 0 for a row whose decoder did not run) and which rows ran it ((num_rows,) bool).

    NOTE: no value is read back to the host and no shape depends on one (a decode step's
    tables are sized from the plan's host facts; the rows are scattered through a sink row, not
    cut by a mask): what a whole-step native call or a captured graph needs
    (``tests/test_decode_step_sync_free.py``)."""
    keys = PoolKeys(model.cfg, model.codec, pools, slots, plan)
    h = model.embed(plan.input_ids)
    if runs_native(model, keys):  # a decode step on the C++ kernels: the layers in one native call
        dec = native_decode(model, h, plan.batch, keys)
    else:
        dec = model.run_layers(h, plan.batch, keys)
    keys.commit()
    hidden = torch.zeros(num_rows + 1, model.cfg.hidden_size, device=pools.device)  # row num_rows: the sink
    decoded = torch.zeros(num_rows + 1, dtype=torch.bool, device=pools.device)
    if dec is not None:
        sched = plan.sched_index[dec.source_row.clamp_min(0)]
        ok = (dec.source_row >= 0) & (sched >= 0)  # replay rows and carried-over rows go to the sink
        to = torch.where(ok, sched, num_rows)
        hidden[to] = model.norm(dec.hidden)
        decoded[to] = True
    return hidden[:num_rows], decoded[:num_rows]
