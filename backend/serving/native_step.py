"""A served decode step in one native call (``cedar_cpu::decode_step``): the CPU counterpart of a
captured decode graph.

``CEDModel.run_layers`` over :class:`PoolKeys`' one-call path makes about four C++ calls a layer
(the compressor, the projections, the attention, the tail) with Python between them: module
lookups, argument lists and the dispatcher, a sizeable part of a few-millisecond step. Here the
layer loop and the cut run in C++: the same functions on the same inputs in the same order, so
the same bits (``tests/test_kernels_fast.py`` compares every hidden row, ring, pool and tail byte
with the per-layer path). Python builds the step's tables first (``BatchTables``, the RoPE
tables, the global views); nothing inside the call decides a shape from a tensor's value.

The op reads flat lists; their layouts (per layer: ``NW`` weights, ``NF`` floats, ``NI`` ints;
``NS`` step tensors, then ``NL`` per layer) are written here and read by ``decode_step`` in
``kernels/csrc/cedar_cpu.cpp``: change both together.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW

from ..model import CEDModel
from ..modules import BF16_MATMUL, LINEAR_ROWS, packed_weight, rope_constants
from ..rows import DecoderRows, RowBatch
from .pool_keys import PoolKeys

NW, NF, NI, NS, NL = 20, 5, 6, 17, 25
LINEAR = (1, 2, 4, 5, 7, 9, 10, 11, 13, 14, 16)  # a layer's projection weights among its NW
# the projections whose prefill matmuls --weights bf16-matmul runs in bf16: the MLP's gate, up and
# down (most of a layer's matmul work). NOTE: measured on the model shipped before 2026-12-04's
# (tests/test_bf16_weights.py's prompts): rounding the rows of every projection moved its
# next-token distributions 15x more than rounding the weights alone (mean KL 2.9e-2, max 1.2,
# against 2.0e-3); the window and compressor KV projections (their rows become FP8 / FP4 cache
# rows and the indexer's keys) account for most of it, the queries and output projection for the
# rest (1.2e-2); the MLP alone keeps 2.0e-3 (each shipped model's figures for both modes: the
# README and tests/test_bf16_weights.py)
MATMUL_BF16 = (9, 10, 11)
ENABLED = True  # NOTE: the tests switch it off to compare with the per-layer path


@dataclass(frozen=True)
class NativeWeights:
    """A model's weights and constants in ``decode_step``'s layout, made once per model (the
    tensors by reference: an in-place weight update is seen, a replaced Parameter is not).
    packed: the same list with the projection weights whose sizes allow it packed
    (``modules.packed_weight``'s copies, the ones a per-layer forward reads too), what a step of up
    to LINEAR_ROWS rows reads; taken again when a projection weight changes in place (``versions``:
    each one's version counter when taken, the step's cheap check; a storage swapped through
    ``.data`` is packed_weight's to notice, not this list's).
    bf16: the same list with the projection weights as bfloat16 copies, once the model's are
    bf16 values (:func:`round_to_bf16`); None for a float32 model."""

    tensors: list[Tensor | None]  # L * NW
    floats: list[float]  # L * NF
    ints: list[int]  # 7 + L * NI
    packed: list[Tensor | None]  # L * NW
    projections: tuple[Tensor, ...]  # the projection weights among tensors, in list order
    versions: list[int]  # their version counters when packed
    bf16: list[Tensor | None] | None = None


def _packed(tensors: list[Tensor | None], refresh: bool = False) -> dict:
    """NativeWeights' packed, projections and versions fields for ``tensors``: the projections'
    packed copies are the ones a per-layer forward's few-row matmuls read (``packed_weight``)."""
    packed, projections = list(tensors), []
    for i, t in enumerate(tensors):
        if t is not None and i % NW in LINEAR:
            packed[i] = packed_weight(t, refresh)
            projections.append(t)
    return {"packed": packed, "projections": tuple(projections), "versions": [t._version for t in projections]}


_WEIGHTS: "weakref.WeakKeyDictionary[CEDModel, NativeWeights]" = weakref.WeakKeyDictionary()


def native_weights(model: CEDModel) -> NativeWeights:
    if model not in _WEIGHTS:
        cfg, tensors, floats = model.cfg, [], []
        ints = [cfg.decoder_start, cfg.sliding_window, cfg.index_topk, GLOBAL_ROW.group,
                int(GLOBAL_ROW.scale == "e4m3"), INDEX_ROW.group, int(INDEX_ROW.scale == "e4m3")]
        for layer in model.layers:
            i, c, idx = layer.layer_id, layer.compressor, layer.has_indexer
            comp = [None] * 8
            if c is not None:
                freqs, partner = rope_constants(c.wkv.weight.shape[0], c.rope_dim, c.rope_theta, c.wkv.weight.device)
                comp = [c.norm.weight, c.wkv.weight, c.wgate.weight if c.wgate is not None else None, c.kv_norm.weight,
                        c.wk_index.weight, c.index_norm.weight, freqs, partner]
            tensors += [layer.attn_norm.weight, layer.wq.weight, layer.wkv.weight, layer.kv_norm.weight,
                        layer.wq_index.weight if idx else None, layer.w_index.weight if idx else None, layer.sink,
                        layer.wo.weight, layer.mlp_norm.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight,
                        layer.mlp.down_proj.weight, *comp]
            floats += [layer.attn_norm.eps, layer.mlp_norm.eps, layer._index_div if idx else 1.0, layer.scale,
                       c.norm.eps if c is not None else 0.0]
            source, topk_source = cfg.kv_source_of(i), cfg.topk_source_of(i)
            ints += [layer.num_heads, layer.index_num_heads if idx else 0, c.ratio if c is not None else 0,
                     -1 if source is None else source, -1 if source is None or topk_source is None else topk_source,
                     int(idx)]
        _WEIGHTS[model] = NativeWeights(tensors, floats, ints, **_packed(tensors))
    nw = _WEIGHTS[model]
    if [t._version for t in nw.projections] != nw.versions:  # NOTE: a weight changed in place
        nw = _WEIGHTS[model] = dataclasses.replace(nw, **_packed(nw.tensors))
    return nw


def round_to_bf16(model: CEDModel, matmul: bool = False) -> None:
    """Serve ``model`` with bf16 projection weights (``cedar serve --weights bf16``): every layer's
    projection weight becomes its nearest bf16 value, in place (float32 storage, so every path and
    the reference compute with the same values), and a decode step reads bfloat16 copies: half the
    bytes of the float32 weights it streams every step, the same bits (``cedar_cpu::linear``
    widens each bf16 value exactly and sums as over float32). Idempotent.

    matmul (``--weights bf16-matmul``): also hand the MLP's weights (:data:`MATMUL_BF16`) their
    bfloat16 copies for matmuls of more than LINEAR_ROWS rows
    (:func:`~cedar.backend.modules.matmul_weight`): a prefill's and a hit's MLP matmuls then round
    their rows to bf16 and run at the CPU's bf16 rate; a decode step's few rows keep the float32
    path. A reference model rounded the same way computes the same.

    NOTE: a different model from the float32 one, by at most bf16's rounding of each weight (and,
    with ``matmul``, of each prefill row entering a projection); the README states how far its
    tokens move (``tests/test_bf16_weights.py`` bounds both)."""
    nw = native_weights(model)
    bf16 = list(nw.tensors)
    for i, t in enumerate(nw.tensors):
        if t is not None and i % NW in LINEAR:
            t.data.copy_(t.data.to(torch.bfloat16).float())
            bf16[i] = t.data.to(torch.bfloat16)
            if matmul and i % NW in MATMUL_BF16:
                setattr(t, BF16_MATMUL, bf16[i])
    # NOTE: .data's writes leave the version counters as they were: packed again here
    _WEIGHTS[model] = dataclasses.replace(nw, bf16=bf16, **_packed(nw.tensors, refresh=True))


def runs_native(model: CEDModel, keys: PoolKeys) -> bool:
    """A decode step on the C++ kernels, no autograd (``keys.one_call()``), the model's own ops
    in C++ too (``model.fast``): the step the native call stands for."""
    return ENABLED and model.fast and keys.one_call()


def native_decode(model: CEDModel, h: Tensor, batch: RowBatch, keys: PoolKeys) -> DecoderRows:
    """``model.run_layers(h, batch, keys)`` of a decode step on the one-call path
    (``keys.one_call()``), in one C++ call. h: (T, hidden) f32 embeddings -> the decoder rows."""
    cfg, t, slots, E = model.cfg, keys.tables, keys.slots, model.cfg.decoder_start
    dec = t.dec.batch
    enc_rope = batch.rope(cfg.kv_latent_dim, cfg.rope_dim, cfg.rope_theta, model.fast)
    dec_rope = dec.rope(cfg.kv_latent_dim, cfg.rope_dim, cfg.rope_theta, model.fast)
    floors = {d: keys.window_floor(E + 1 if d else E) for d in (False, True)}  # NOTE: decode row b is request b
    enc_out = slots.enc_out.view(-1, h.shape[1])
    step = [enc_rope.cos, enc_rope.sin, enc_rope.sin_inverse, enc_rope.partner, dec_rope.cos, dec_rope.sin,
            dec_rope.sin_inverse, t.slots, batch.pos, dec.pos, floors[False], floors[True], t.dec_src, enc_out,
            t.enc_out_dst, t.enc_out_src, slots.enc_pos.view(-1)]
    for layer in model.layers:
        i, c = layer.layer_id, layer.compressor
        per = [slots.ring_rows[i], slots.ring_scales[i], slots.ring_pos[i]] + [None] * (NL - 3)
        source = cfg.kv_source_of(i)
        if source is not None:
            view = keys.global_view(source)
            v = view.plan
            per[3:11] = [v.rows, v.row_scales, v.index_rows, v.index_scales, v.entry_rows, v.cu_c, v.row_req,
                         view.entry_pos]
        if c is not None:
            r, src = c.ratio, keys.pools.sources[i]
            w = t.groups(r, slots.tail_len[i] if r > 1 else None)
            per[11:14] = [w.src, w.first_pos, w.dst]
            if r > 1:
                per[14:21] = [w.tail_src, w.tail_dst, slots.tail_kv[i], slots.tail_gate[i], slots.tail_len[i], t.slots,
                              w.tail_len]
            per[21:25] = [src.rows, src.row_scales, src.index_rows, src.index_scales]
        step += per
    nw = native_weights(model)
    few = len(batch.lens) <= LINEAR_ROWS  # NOTE: the per-layer path's few-row matmuls (more rows: at::linear's)
    weights = (nw.bf16 if nw.bf16 is not None else nw.packed) if few else nw.tensors
    out = torch.ops.cedar_cpu.decode_step(h, weights, nw.floats, nw.ints, step)
    keys.views.clear()  # NOTE: the pools were written behind the views' backs (they hold no data in place)
    return DecoderRows(out, dec, t.dec_source_row)


__all__ = ["NativeWeights", "native_weights", "round_to_bf16", "runs_native", "native_decode", "NW", "NF",
           "NI", "NS", "NL"]
