"""The CED model in plain PyTorch: the reference every faster path is tested against.

Two ways to run it:
- ``forward(input_ids)``: cold whole-sequence forward, untrimmed, no cache.
- ``extend(cache, input_ids, start, plan)``: incremental forward over explicit caches (FP4 global
  rows + FP8 window rings, or float32 with quantization off), honouring an :class:`ExtendPlan`:
  encoder-side replay floors and decoder-side narrowing exactly as SPEC section 3 defines them.

Decoder narrowing: layer E (the decoder source) runs on every row and writes the decoder's global
KV for every row; when a forward holds more than W rows, the layers after E run on its last W rows
only and their window reads nothing below ``max(window_floor, seq_len - W)``. A forward of at most
W rows is not trimmed and keeps the encoder floor (it may read the request's earlier window rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cedar.kernels.dispatch import KernelSet

from .cache import SequenceCache
from .config import CEDConfig
from .key_source import CachedKeys, ExtendPlan, KeySource, WholeSequenceKeys
from .kv_codec import KVCodec
from .layer import CEDLayer
from .modules import RMSNorm


@dataclass(frozen=True)
class ExtendResult:
    logits: Tensor | None  # (m, vocab) f32 for the rows that ran every layer; None if skipped
    positions: Tensor  # (m,) int64 positions of those rows


class CEDModel(nn.Module):
    def __init__(self, cfg: CEDConfig, kernels: KernelSet | None = None, quantize: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels or KernelSet("torch")
        self.codec = KVCodec(self.kernels, quantize)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(CEDLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # ------------------------------------------------------------------ public entry points
    @torch.no_grad()
    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids: (T,) int64 -> logits (T, vocab) f32; cold, whole sequence, untrimmed."""
        self._check_ids(input_ids)
        pos = torch.arange(input_ids.shape[0], dtype=torch.long)
        h, _ = self._layers(self.embed_tokens(input_ids).float(), pos,
                            WholeSequenceKeys(self.codec), narrow=False, skip_decoder=False)
        return self.lm_head(self.norm(h)).float()

    @torch.no_grad()
    def extend(self, cache: SequenceCache, input_ids: Tensor, start: int, plan: ExtendPlan) -> ExtendResult:
        """Run rows at positions [start, start + n) over ``cache`` and advance it to start + n.

        ``start`` may lie below ``cache.seq_len`` only for replayed rows of a prefix hit (their
        global rows are below ``plan.write_floor`` and are not rewritten)."""
        self._check_ids(input_ids)
        if start > cache.seq_len:
            raise ValueError(f"extend at {start} leaves a gap after {cache.seq_len} cached tokens")
        if start < cache.seq_len and plan.write_floor < cache.seq_len:
            raise ValueError("rows below seq_len may only be replayed under a write floor at seq_len")
        pos = torch.arange(start, start + input_ids.shape[0], dtype=torch.long)
        keys = CachedKeys(cache, self.codec, plan, self.cfg.sliding_window)
        cache.window_floor = plan.window_floor
        h, pos = self._layers(self.embed_tokens(input_ids).float(), pos, keys,
                              narrow=plan.narrow, skip_decoder=plan.skip_decoder)
        cache.seq_len = start + input_ids.shape[0]
        if plan.skip_decoder:
            return ExtendResult(None, pos[:0])
        return ExtendResult(self.lm_head(self.norm(h)).float(), pos)

    # ------------------------------------------------------------------ the layer loop
    def _layers(self, h: Tensor, pos: Tensor, keys: KeySource, narrow: bool,
                skip_decoder: bool) -> tuple[Tensor, Tensor]:
        E, W, k = self.cfg.decoder_start, self.cfg.sliding_window, self.kernels
        selections: dict[int, Tensor] = {}  # index-producing layer -> (T, topk) int32
        for layer in self.layers:
            i = layer.layer_id
            if i == E + 1:
                if skip_decoder:
                    break
                if narrow and h.shape[0] > W:
                    # NOTE: decoder-side bounded replay: rows below the tail never reach these
                    # layers, so their window must not look below the tail either.
                    h, pos = h[-W:], pos[-W:]
                    selections = {j: s[-W:] for j, s in selections.items()}
                    if isinstance(keys, CachedKeys):
                        keys.decoder_floor = int(pos[0])
            h = h + self._attention(layer, h, pos, keys, selections, k)
            h = h + layer.mlp(layer.mlp_norm(h))
        return h, pos

    def _attention(self, layer: CEDLayer, h: Tensor, pos: Tensor, keys: KeySource,
                   selections: dict[int, Tensor], k: KernelSet) -> Tensor:
        cfg, i, T = self.cfg, layer.layer_id, h.shape[0]
        cu = torch.tensor([0, T], dtype=torch.int32)
        if layer.compressor is not None:
            keys.write_global(i, layer.compressor, h, pos)
        hn = layer.attn_norm(h)
        q = layer.queries(hn, pos)  # (T, H, D)
        kk, kpos = keys.window_keys(i, layer.window_kv(hn, pos), pos)
        floor = torch.tensor([keys.window_floor(i)], dtype=torch.long)
        cu_k = torch.tensor([0, kk.shape[0]], dtype=torch.int32)
        o, lse = k.window_attention(q, kk, cu, cu_k, pos, kpos, cfg.sliding_window, floor,
                                    layer.sink.float(), layer.scale)
        source = cfg.kv_source_of(i)
        if source is not None:
            view = keys.global_view(source)
            cu_c = torch.tensor([0, view.entries.shape[0]], dtype=torch.int32)
            if layer.has_indexer:
                iq, iw = layer.index_queries(hn)
                scores = k.indexer_scores(iq, iw, view.index_keys, cu, cu_c, pos, view.entry_pos)
                selections[i] = k.topk_select(scores, cfg.index_topk)
            sel = selections[cfg.topk_source_of(i)]
            og, lg = k.sparse_attention(q, view.entries, cu, cu_c, sel, layer.scale)
            o, lse = k.merge_states(o, lse, og, lg)
        return layer.attn_output(o, pos)

    def _check_ids(self, input_ids: Tensor) -> None:
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {self.cfg.vocab_size}): "
                             f"min {int(input_ids.min())}, max {int(input_ids.max())}")
