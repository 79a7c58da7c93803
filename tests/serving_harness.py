"""Drive the served model's bookkeeping (planner + PoolKeys + pools) in process, the way
CedarForCausalLM.forward does inside SGLang, with SGLang's slot tables stood in for by plain
tensors. For unit tests of bookkeeping only; end-to-end tests use the real server."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cedar.backend.serving.planner import RequestInfo, ServingFlags, plan_forward
from cedar.backend.serving.pool_keys import PoolKeys
from cedar.backend.serving.pools import RequestSlots, TokenPools
from cedar.backend.serving.prepass import replay_prepass


@dataclass
class Req:
    rid: str
    slot: int
    ids: list[int]  # every token so far (prompt + generated)
    token_slots: list[int] = field(default_factory=list)


class Harness:
    def __init__(self, model, flags=ServingFlags(), num_slots=8192, num_reqs=8, max_len=4096, device="cpu"):
        self.model, self.cfg, self.flags = model, model.cfg, flags
        self.pools = TokenPools(self.cfg, num_slots, device)
        self.slots = RequestSlots(self.cfg, num_reqs, device)
        self.req_to_token = torch.zeros(num_reqs, max_len, dtype=torch.int32, device=device)
        self.next_slot = self.cfg.page_size  # page 0 is padding, as in SGLang

    def alloc(self, req: Req, n: int) -> list[int]:
        """Slots for positions [H, H + n) of req, page by page as SGLang's paged allocator does."""
        out, P = [], self.cfg.page_size
        last = req.token_slots[-1] if req.token_slots else None
        for p in range(len(req.token_slots), len(req.token_slots) + n):
            if p % P == 0:
                last = self.next_slot
                self.next_slot += P
            else:
                last = last + 1
            out.append(last)
        return out

    def admit(self, rid, slot, ids, hit_from: Req | None = None, hit: int = 0) -> Req:
        req = Req(rid, slot, list(ids))
        if hit_from is not None:
            req.token_slots = hit_from.token_slots[:hit]
        return req

    @torch.no_grad()
    def step(self, batch: list[tuple[Req, int]], infos=None, snapshots=None):
        """batch: (request, rows to schedule now). Returns {rid: logits of its last decoder row}."""
        rids, slots, prefix, ext, ids = [], [], [], [], []
        for req, n in batch:
            H = len(req.token_slots)
            new_slots = self.alloc(req, n)
            req.token_slots += new_slots
            self.req_to_token[req.slot, :len(req.token_slots)] = torch.tensor(req.token_slots)
            chunk = req.ids[H:H + n]
            self.pools.token_ids[torch.tensor(new_slots)] = torch.tensor(chunk, dtype=torch.int32)
            rids.append(req.rid); slots.append(req.slot); prefix.append(H); ext.append(n); ids += chunk
        infos = infos or [RequestInfo()] * len(batch)
        if self.flags.replay_per_request:
            replay_prepass(self.model, self.flags, self.slots, self.pools, self.req_to_token, rids, slots, prefix,
                           snapshots)
        plan = plan_forward(self.cfg, self.flags, self.slots, self.pools, self.req_to_token, rids, slots,
                            prefix, ext, torch.tensor(ids), infos, snapshots)
        keys = PoolKeys(self.cfg, self.model.codec, self.pools, self.slots, plan)
        dec = self.model.run_layers(self.model.embed(plan.input_ids), plan.batch, keys)
        keys.commit()
        out = {}
        if dec is not None:
            logits = self.model.lm_head(self.model.norm(dec.hidden)).float()
            cu = dec.batch.cu.tolist()
            for b, req in enumerate(plan.requests):
                if cu[b + 1] > cu[b]:
                    out[req.rid] = logits[cu[b]:cu[b + 1]]
        return out, plan
