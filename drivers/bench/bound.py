"""``cedar bench bound``: the memory-bandwidth bound of a decode step, the yardstick decode speed
is held to (issue #23: "batch 1 at >= 50% of the bandwidth bound you measured").

A decode step must read, at least once:

- ``weights``: every weight of every layer (each layer runs for the new token), the head, and one
  embedding row per request (float32 as served; ``--weight-bytes 2`` for bf16);
- ``window``: per request, each layer's window rows (min(W, context) FP8 rows);
- ``global_rows``: per request, each layer that reads a global source, the entries it attends:
  min(top-k, visible entries) FP4 rows;
- ``index_keys``: per request, each index producer scans every visible entry's FP4 index row.

Bytes over this machine's read bandwidth (a timed reduction over a buffer far larger than the
caches, best of repeats, the threads the server uses) gives the fastest step the hardware allows:
``bound_tok_s = batch / (bytes / bandwidth)``. Caches are counted by ``cedar.kernels.formats``'
row sizes, the same accounting as ``cedar memory``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from cedar.backend.config import CEDConfig
from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW, WINDOW_ROW, row_bytes


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step of ``batch`` requests at ``context`` tokens must read."""

    context: int
    batch: int
    weights: int
    window: int
    global_rows: int
    index_keys: int

    @property
    def total(self) -> int:
        return self.weights + self.window + self.global_rows + self.index_keys


def weight_counts(cfg: CEDConfig) -> tuple[int, int]:
    """(values of every weight but the embedding table, values of one embedding row), read off
    the model built on the meta device (no memory, no values)."""
    import torch

    from cedar.backend.model import CEDModel

    with torch.device("meta"):
        model = CEDModel(cfg, quantize=False)
    emb = model.embed_tokens.weight
    rest = sum(p.numel() for n, p in model.named_parameters() if p is not emb)
    return rest, emb.shape[1]


def decode_step_bytes(cfg: CEDConfig, context: int, batch: int, weight_bytes: int = 4) -> StepBytes:
    """The bytes of one decode step (see the module doc). context: tokens each request holds."""
    if context < 1 or batch < 1 or weight_bytes < 1:
        raise ValueError(f"need context, batch and weight_bytes >= 1, got {context}, {batch}, {weight_bytes}")
    rest, emb_row = weight_counts(cfg)
    L, W, D = cfg.num_hidden_layers, cfg.sliding_window, cfg.kv_latent_dim
    window = L * min(W, context) * row_bytes(WINDOW_ROW, D)
    glob = index = 0
    for layer in range(L):
        source = cfg.kv_source_of(layer)
        if source is None:
            continue
        entries = context // cfg.compress_ratios[source]
        glob += min(cfg.index_topk, entries) * row_bytes(GLOBAL_ROW, D)
        if layer in cfg.index_source_layer_ids:
            index += entries * row_bytes(INDEX_ROW, cfg.index_head_dim)
    return StepBytes(context, batch, weight_bytes * (rest + batch * emb_row), batch * window, batch * glob,
                     batch * index)


def read_bandwidth(mb: int = 512, repeats: int = 5, threads: int | None = None) -> dict:
    """Measured read bandwidth: a float32 sum over an ``mb`` MiB buffer, best of ``repeats``."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    float(x.sum())  # NOTE: pages touched and warm before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t0)
    return {"gb_s": round(x.numel() * 4 / best / 1e9, 2), "buffer_mb": mb, "repeats": repeats,
            "threads": torch.get_num_threads()}


def bound_report(cfg: CEDConfig, points: list[tuple[int, int]], bandwidth_gb_s: float,
                 weight_bytes: int = 4) -> list[dict]:
    """For each (batch, context): the step's bytes by kind and the bound in tokens/s."""
    rows = []
    for batch, context in points:
        b = decode_step_bytes(cfg, context, batch, weight_bytes)
        step_s = b.total / (bandwidth_gb_s * 1e9)
        rows.append({**asdict(b), "total": b.total, "bound_step_ms": round(1e3 * step_s, 4),
                     "bound_tok_s": round(batch / step_s, 1)})
    return rows
