"""Pool integrity as the scheduler sees it: every token slot is free, cached in the radix tree
(evictable), protected by a running request's prefix, or private to a running request; every
request slot is free or held. Read through SGLang 0.5.23's own pool-stats observer and
invariant checker (pinned with the hooks in :mod:`sglang_hooks`)."""

from __future__ import annotations


def pool_integrity(scheduler) -> dict:
    ps = scheduler.pool_stats_observer.get_pool_stats()
    in_use, _ = scheduler.invariant_checker._get_total_uncached_sizes()
    tokens = {
        "total": int(scheduler.max_total_num_tokens),
        "free": int(ps.full_available_size),
        "cached": int(ps.full_evictable_size),
        "protected": int(scheduler.tree_cache.protected_size()),
        "in_use": int(in_use),
        "session_held": int(scheduler.pool_stats_observer.session_held_tokens()),
    }
    accounted = sum(v for k, v in tokens.items() if k != "total")
    rtp = scheduler.req_to_token_pool
    requests = {"total": int(rtp.size), "free": len(rtp.free_slots),
                "running": len(scheduler.running_batch.reqs) if scheduler.running_batch else 0}
    return {"tokens": tokens, "tokens_ok": accounted == tokens["total"], "request_slots": requests}
