"""Analytic models of one prefill of the served CED config, untrimmed vs with decoder narrowing,
that ``cedar bench prefill`` prints beside each measured speedup.

- ``narrowing_speedup_bound``: an upper bound that holds whatever the per-term constants of an
  implementation. A prefill's cost is a sum of terms linear in the rows a layer runs (projections,
  window and top-k attention, compressors) and terms in the entries each row scores (the indexer
  and its top-k: quadratic in the prompt). Narrowing shrinks every term, and a ratio of sums
  never exceeds the largest ratio of its parts, so the speedup is at most
  max(linear-rows ratio, scored-entries ratio).
- ``flop_estimate``: the speedup if time were proportional to FLOPs (below).

Counted (multiply-adds x 2): every projection, the window attention (<= W keys per row), the
sparse global attention (<= top-k entries per row), the indexer scores (every visible entry per
row: the only term quadratic in the prompt), the compressors. Not counted: norms, RoPE,
quantization, gathers, sampling and the scheduler, which narrowing does not shrink, so the
measured speedup stays below the bound.
"""

from __future__ import annotations

from cedar.backend.config import CEDConfig, Role


def _visible_entries(first: int, last: int, ratio: int) -> float:
    """Sum over query positions p in [first, last) of the entries visible at p: (p + 1) // ratio."""
    return sum((p + 1) // ratio for p in range(first, last))


def layer_flops(cfg: CEDConfig, layer: int, first: int, last: int) -> float:
    """FLOPs of layer ``layer``'s attention + MLP on query rows at positions [first, last)."""
    T = last - first
    h, H, D, I = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_latent_dim, cfg.intermediate_size
    f = 2 * T * (h * H * D + h * D + H * D * h + 3 * h * I)  # wq, wkv, wo, SwiGLU
    f += 2 * 2 * H * D * sum(min(cfg.sliding_window, p + 1) for p in range(first, last))
    r = cfg.compress_ratios[layer]
    if r:
        f += 2 * 2 * H * D * sum(min(cfg.index_topk, (p + 1) // r) for p in range(first, last))
    if cfg.role(layer) in (Role.FULL, Role.REINDEX):
        Hi, Di = cfg.index_num_heads, cfg.index_head_dim
        f += 2 * T * h * Hi * (Di + 1) + 2 * Hi * Di * _visible_entries(first, last, r)
    return float(f)


def compressor_flops(cfg: CEDConfig, layer: int, rows: int) -> float:
    r, h, D, Di = cfg.compress_ratios[layer], cfg.hidden_size, cfg.kv_latent_dim, cfg.index_head_dim
    return float(2 * rows * h * D * (2 if r > 1 else 1) + 2 * (rows // r) * D * Di)


def prefill_flops(cfg: CEDConfig, prompt_len: int, narrow: bool) -> float:
    E, W, P = cfg.decoder_start, cfg.sliding_window, prompt_len
    total = sum(compressor_flops(cfg, s, P) for s in cfg.kv_source_layer_ids)
    total += 2 * P * cfg.hidden_size * cfg.kv_latent_dim  # layer E's window rows, always every row
    for layer in range(cfg.num_hidden_layers):
        first = P - W if narrow and layer >= E and P > W else 0
        total += layer_flops(cfg, layer, first, P)
    return total


def flop_estimate(cfg: CEDConfig, prompt_len: int) -> float:
    return prefill_flops(cfg, prompt_len, narrow=False) / prefill_flops(cfg, prompt_len, narrow=True)


def _rows_and_scores(cfg: CEDConfig, prompt_len: int, narrow: bool) -> tuple[float, float]:
    """(layer-rows run, entries scored by indexers) of one prefill."""
    E, W, P = cfg.decoder_start, cfg.sliding_window, prompt_len
    rows = scores = 0.0
    for layer in range(cfg.num_hidden_layers):
        first = P - W if narrow and layer >= E and P > W else 0
        rows += P - first
        if cfg.role(layer) in (Role.FULL, Role.REINDEX):
            scores += _visible_entries(first, P, cfg.compress_ratios[layer])
    return rows, scores


def narrowing_speedup_bound(cfg: CEDConfig, prompt_len: int) -> float:
    (rows_off, scores_off), (rows_on, scores_on) = (_rows_and_scores(cfg, prompt_len, n) for n in (False, True))
    return max(rows_off / rows_on, scores_off / scores_on if scores_on else 1.0)
