"""Drive the served runtime in process (``cedar.backend.serving.driver``: SGLang's slot tables
and allocator stood in for, the runtime's own ``step`` run), with the results as bookkeeping
tests read them. For unit tests of bookkeeping only; end-to-end tests use the real server."""

from __future__ import annotations

from cedar.backend.serving.driver import Driver, Req

__all__ = ["Harness", "Req"]


class Harness(Driver):
    def admit(self, rid, slot, ids, hit_from: Req | None = None, hit: int = 0) -> Req:
        req = Req(rid, slot, list(ids))
        if hit_from is not None:
            req.token_slots = hit_from.token_slots[:hit]
        return req

    def step(self, batch: list[tuple[Req, int]], infos=None, snapshots=None):
        """batch: (request, rows to schedule now). Returns ({rid: logits (n, V) f32 of its
        scheduled rows whose decoder ran}, the plan)."""
        out = self.run(batch, infos, snapshots=snapshots)
        logits = self.model.lm_head(out.hidden).float()
        res, at = {}, 0
        for req, n in batch:
            ran = out.decoded[at:at + n]
            if bool(ran.any()):
                res[req.rid] = logits[at:at + n][ran]
            at += n
        return res, out.plan
