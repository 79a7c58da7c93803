"""What a served forward reused, for each response's ``meta_info`` and for Prometheus.

Per request (read off its slot's owner, cumulative over its forwards): ``replayed_tokens``
(rows recomputed for the window only) and ``restored_tokens`` (the prefix a snapshot continued
exactly, replaying nothing). SGLang appends one value per forward to ``meta_info``; the meta-info hook in
:mod:`sglang_hooks` keeps the last (cumulative) value.
"""

from __future__ import annotations

import os

META_KEYS = ("replayed_tokens", "restored_tokens")


def collapse_counters(meta_info: dict) -> None:
    """SGLang appends each step's ``customized_info`` to a response's meta_info; Cedar's counters
    are cumulative, so the last value is the request's total (0 when none was reported)."""
    for key in META_KEYS:
        values = [v for v in (meta_info.get(key) or []) if v is not None]
        if key in meta_info:
            meta_info[key] = values[-1] if values else 0


class ServingStats:
    def __init__(self) -> None:
        self.replayed_tokens = 0  # since start-up, all requests
        self._counter = None
        self.forward_s: dict[str, list[float]] = {"decode": [0, 0.0], "extend": [0, 0.0]}  # kind -> [n, seconds]
        self.rows_max = {"decode": 0, "extend": 0}  # most model rows of one forward (replay rows included)

    def time_forward(self, kind: str, seconds: float) -> None:
        """Wall time of one model forward in the scheduler (planner, tables, layers, logits)."""
        self.forward_s[kind][0] += 1
        self.forward_s[kind][1] += seconds

    def forward_summary(self) -> dict:
        return {k: {"forwards": n, "mean_ms": round(1e3 * s / n, 3) if n else None} for k, (n, s) in self.forward_s.items()}

    def _prometheus(self):
        # NOTE: created lazily, in the scheduler process, after SGLang set the multiprocess dir.
        if self._counter is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Counter

            self._counter = Counter("cedar:replayed_tokens", "Rows recomputed by bounded replay")
        return self._counter

    def record(self, plan, kind: str | None = None) -> None:
        if kind is not None:
            self.rows_max[kind] = max(self.rows_max[kind], int(plan.input_ids.numel()))
        n = sum(r.replayed for r in plan.requests)
        self.replayed_tokens += n
        counter = self._prometheus()
        if counter is not None and n:
            counter.inc(n)

    def meta_info(self, plan, slots) -> dict:
        owners = [slots.owners[r.slot] for r in plan.requests]
        return {"replayed_tokens": [o.replayed_tokens for o in owners],
                "restored_tokens": [o.restored_tokens for o in owners]}
