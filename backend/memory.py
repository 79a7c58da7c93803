"""Byte accounting of the CED caches (SPEC section 2): a tested function, not a comment.

global bytes/token = sum over KV sources of (global row + index row) / ratio;
SWA bytes/request = layers x W x window row (a per-request constant, never prefix-cached);
compressor tail bytes/request = sum over ratio>1 sources of (r - 1) x latent x 4 B x 2 (kv, gate);
FP16 comparison = every layer caching its K = V latent in FP16 (layers x latent x 2 B per token).
served budget/token = global bytes/token + the int32 token id replay reads, in whole bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW, WINDOW_ROW, row_bytes

from .config import CEDConfig


@dataclass(frozen=True)
class MemoryReport:
    geometry: str
    global_row_bytes: int
    index_row_bytes: int
    swa_row_bytes: int
    global_bytes_per_token: float
    swa_bytes_per_request: int
    compressor_tail_bytes_per_request: int
    fp16_all_layers_bytes_per_token: int
    reduction_vs_fp16: float

    def to_json_dict(self) -> dict:
        d = asdict(self)
        g = d["global_bytes_per_token"]
        d["global_bytes_per_token"] = int(g) if float(g).is_integer() else g
        return d


def memory_report(cfg: CEDConfig) -> MemoryReport:
    D, Di, W, L = cfg.kv_latent_dim, cfg.index_head_dim, cfg.sliding_window, cfg.num_hidden_layers
    g_row, i_row, w_row = row_bytes(GLOBAL_ROW, D), row_bytes(INDEX_ROW, Di), row_bytes(WINDOW_ROW, D)
    per_token = sum((g_row + i_row) / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)
    tails = sum((cfg.compress_ratios[s] - 1) * D * 4 * 2 for s in cfg.kv_source_layer_ids)
    fp16 = L * D * 2
    return MemoryReport(geometry=cfg.name, global_row_bytes=g_row, index_row_bytes=i_row,
                        swa_row_bytes=w_row, global_bytes_per_token=per_token,
                        swa_bytes_per_request=L * W * w_row, compressor_tail_bytes_per_request=tails,
                        fp16_all_layers_bytes_per_token=fp16, reduction_vs_fp16=fp16 / per_token)


def budget_bytes_per_token(cfg: CEDConfig) -> int:
    """What the served model asks SGLang to budget per token slot: the global + index rows of
    every source (/ ratio) and the int32 token id that replay reads, rounded up."""
    return math.ceil(memory_report(cfg).global_bytes_per_token + 4)
