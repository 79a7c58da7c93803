"""Upstream's first encoder-replay design, kept as a benchmark switch (``replay_per_request``):
one separate replay forward per hit request, before the batch. Each runs the encoder and layer
E's window over rows [H - R, H) (global rows below the hit are not written); the batch then finds
the slot continuing exactly at H and its decoder tail carries the replayed rows over.

Cedar's default folds the same rows into the batch's one forward (:mod:`planner`)."""

from __future__ import annotations

import dataclasses

from torch import Tensor

from .planner import RequestInfo, ServedForward, ServingFlags, claim_slot, plan_forward
from .pools import RequestSlots, TokenPools
from .snapshots import SnapshotStore
from .step import served_step


def replay_prepass(model, flags: ServingFlags, slots: RequestSlots, pools: TokenPools, req_to_token: Tensor,
                   rids: list[str], req_slots: list[int], prefix_lens: list[int],
                   snapshots: SnapshotStore | None = None) -> list[ServedForward]:
    """Run one replay forward per request whose slot is stale at a hit; returns their plans."""
    cfg, plans = model.cfg, []
    for rid, slot, hit in zip(rids, req_slots, prefix_lens):
        owner = slots.owners[slot]
        if hit == 0 or (owner.rid == rid and owner.next_pos == hit):
            continue
        claim_slot(cfg, flags, slots, pools, slot, rid, hit, req_to_token[slot, :hit].long(), snapshots)
        start = slots.owners[slot].next_pos
        if start == hit:  # a snapshot continued it exactly
            continue
        ids = pools.token_ids[req_to_token[slot, start:hit].long()].long()
        plan = plan_forward(cfg, flags, slots, pools, req_to_token, [rid], [slot], [start], [hit - start],
                            ids, [RequestInfo(final_chunk=False)])
        plan = dataclasses.replace(plan, requests=tuple(
            dataclasses.replace(r, prefix_len=hit, replayed=hit - start) for r in plan.requests))
        served_step(model, pools, slots, plan, plan.input_ids.shape[0])  # NOTE: its output is not needed
        plans.append(plan)
    return plans
