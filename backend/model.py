"""The CED model in plain PyTorch: the reference every faster path is tested against.

Two ways to run it:
- ``forward(input_ids)``: cold whole-sequence forward, untrimmed, no cache.
- ``extend(cache, input_ids, start, plan)``: incremental forward over explicit caches (FP4 global
  rows + FP8 window rings, or float32 with quantization off), honouring an :class:`ExtendPlan`:
  encoder-side replay floors and decoder-side narrowing exactly as SPEC section 3 defines them.

Decoder narrowing: layer E (the decoder source) writes the decoder's global KV and its own window
rows for every row; when a forward holds more than W rows, E's attention and every later layer
run on its last W rows only. Layer E's window is untrimmed (it reads every row's E-window); the
layers after E read nothing below ``max(window_floor, seq_len - W)``. A forward of at most W rows
is not trimmed and keeps the encoder floor (it may read the request's earlier window rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cedar.kernels.dispatch import KernelSet

from .cache import SequenceCache
from .config import CEDConfig
from .key_source import CachedKeys, ExtendPlan, KeySource, WholeSequenceKeys, WindowKeys
from .kv_codec import KVCodec
from .layer import CEDLayer, Projections
from .modules import LMHead, RMSNorm, SwiGLU
from .rows import DecoderRows, RowBatch


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
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.use_kernels(self.kernels)

    def use_kernels(self, kernels: KernelSet) -> "CEDModel":
        """Run on another kernel set (the weights stay); returns self."""
        self.kernels, self.codec = kernels, KVCodec(kernels, self.codec.quantize)
        self.fast = getattr(kernels, "backend", None) == "fast"  # NOTE: norms and RoPE in C++ too
        for m in self.modules():
            if isinstance(m, (RMSNorm, SwiGLU, LMHead)):
                m.fast = self.fast
        return self

    # ------------------------------------------------------------------ public entry points
    @torch.no_grad()
    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids: (T,) int64 -> logits (T, vocab) f32; cold, whole sequence, untrimmed."""
        self._check_ids(input_ids)
        dec = self.run_layers(self.embed(input_ids), RowBatch.single(0, input_ids.shape[0]),
                              WholeSequenceKeys(self.codec, self.cfg.global_lag))
        return self.lm_head(self.norm(dec.hidden)).float()

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
        keys = CachedKeys(cache, self.codec, plan, self.cfg.sliding_window, self.cfg.decoder_start,
                          self.cfg.global_lag)
        cache.window_floor = plan.window_floor
        batch = RowBatch.single(start, input_ids.shape[0])
        dec = self.run_layers(self.embed(input_ids), batch, keys)
        cache.seq_len = start + input_ids.shape[0]
        if dec is None:
            return ExtendResult(None, batch.pos[:0])
        return ExtendResult(self.lm_head(self.norm(dec.hidden)).float(), dec.batch.pos)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids).float()

    # ------------------------------------------------------------------ the layer loop
    def run_layers(self, h: Tensor, batch: RowBatch, keys: KeySource) -> DecoderRows | None:
        """h: (T, hidden) embeddings of ``batch``'s rows -> the last layer's output on the decoder
        rows (``DecoderRows``), or None when every request stopped at the cut."""
        E, selections = self.cfg.decoder_start, {}  # selections: index producer -> (T, topk)
        for layer in self.layers[:E]:
            h = self._block(layer, h, batch, keys, selections)
        # NOTE: the cut. Layer E (the decoder source) writes global KV and its window for every
        # row; its attention and every later layer run on the decoder rows only.
        src = self.layers[E]
        keys.write_global(E, src.compressor, h, batch)
        rope = batch.rope(self.cfg.kv_latent_dim, self.cfg.rope_dim, self.cfg.rope_theta, self.fast)
        wk = keys.window_keys(E, src.window_kv(src.attn_norm(h), rope), batch)
        dec = keys.decoder_rows(h, batch)
        if dec is None or dec.hidden.shape[0] == 0:  # every request stops at the cut
            return dec
        h, selections = dec.hidden, {}
        for layer in self.layers[E:]:
            h = self._block(layer, h, dec.batch, keys, selections, wk if layer is src else None)
        return DecoderRows(h, dec.batch, dec.source_row)

    def _block(self, layer: CEDLayer, h: Tensor, batch: RowBatch, keys: KeySource,
               selections: dict[int, Tensor], window: WindowKeys | None = None) -> Tensor:
        cfg = self.cfg
        rope = batch.rope(cfg.kv_latent_dim, cfg.rope_dim, cfg.rope_theta, self.fast)
        if layer.compressor is not None and layer.layer_id != cfg.decoder_start:
            keys.write_global(layer.layer_id, layer.compressor, h, batch)
        p = layer.project(h, rope, window=window is None)  # q (T, H, D), and the window rows to store
        o = keys.attend_in_place(layer, p, batch, selections, store=window is None)  # a served decode step
        if o is None:
            o = self._attention(layer, p, batch, keys, selections, window)
        return layer.tail(h, o, rope)  # h + attention output, then + MLP

    def _attention(self, layer: CEDLayer, p: Projections, batch: RowBatch, keys: KeySource,
                   selections: dict[int, Tensor], window: WindowKeys | None) -> Tensor:
        """The layer's attention from its projections: window keys (stored, then read), the window
        attention, and with a global source the indexer's top-k, the sparse attention and the
        merge -> o (T, H, D) f32."""
        cfg, i, k = self.cfg, layer.layer_id, self.kernels
        cu, pos = batch.cu, batch.pos
        if window is None:
            window = keys.window_keys(i, p.kv, batch)
        o, lse = k.window_attention(p.q, window.keys, cu, window.cu, pos, window.pos, cfg.sliding_window,
                                    keys.window_floor(i), layer.sink.float(), layer.scale, plan=window.plan)
        source = cfg.kv_source_of(i)
        if source is not None:
            view = keys.global_view(source)
            if layer.has_indexer:
                selections[i] = k.indexer_topk(p.iq, p.iw, view.index_keys, cu, view.cu, pos, view.entry_pos,
                                               cfg.index_topk, plan=view.plan)
            og, lg = k.sparse_attention(p.q, view.entries, cu, view.cu, selections[cfg.topk_source_of(i)],
                                        layer.scale, plan=view.plan)
            o, lse = k.merge_states(o, lse, og, lg)
        return o

    def _check_ids(self, input_ids: Tensor) -> None:
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {self.cfg.vocab_size}): "
                             f"min {int(input_ids.min())}, max {int(input_ids.max())}")
