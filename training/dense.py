"""The batched training forward: the reference model's maths on a (B, T) batch of packed rows,
differentiable, with every mask dense and no per-request Python.

Per layer one softmax over [window keys, global entries, sink] (the reference merges the window
and global partials by their LSE, which is the same softmax). Window keys are attended in blocks
of W queries against the block before and their own; global entries are either the indexer's
top-k (gathered: the served maths) or, in a dense warm-up, every visible entry.

Rows hold several documents (sessions): ``doc`` (B, T) int64 tags each row's document (-1 =
padding); nothing attends across documents. Documents start at even offsets so compression
groups never straddle two documents.

Bounded replay is simulated as serving does it (see :class:`Plan`):
- an **encoder-side hit** at H: pass 1 runs rows [0, H) cold; pass 2 runs rows [H - W, T) with no
  window key below H - W (the replayed rows' truncated windows), reading pass 1's global entries
  for groups below H and its own above;
- **decoder narrowing** at a prompt end P: the layers after E give rows [P - W, P) no window key
  below P - W (in serving, those layers never ran on the rows before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cedar.backend.compressor import Compressor
from cedar.backend.model import CEDModel

NEG = float("-inf")


@dataclass(frozen=True)
class Plan:
    """Where one training step simulates serving (positions in the packed rows, multiples of W).

    hit: an encoder-side prefix hit of H tokens (0 = none); narrow_end: a prompt end P at which
    the decoder ran on the last W rows only (0 = none); dense_global: attend every visible global
    entry instead of the top-k (warm-up)."""

    hit: int = 0
    narrow_end: int = 0
    dense_global: bool = False


@dataclass
class Entries:
    rows: Tensor  # (B, C, D) f32 global KV entries (K = V), normed and RoPE'd
    index_keys: Tensor  # (B, C, Di) f32
    pos: Tensor  # (C,) int64 each entry's group's last position
    doc: Tensor  # (B, C) int64 document of each entry
    lag: int = 0  # the source's CEDConfig.global_lag

    @property
    def visible_from(self) -> Tensor:
        """(C,) int64 the position from which each entry may be selected."""
        return self.pos + self.lag


@dataclass(frozen=True)
class PassOutput:
    logits: Tensor  # (B, n, V) f32 for rows [start, start + n)
    entries: dict[int, Entries]  # per KV source
    aux: Tensor  # () f32 indexer distillation loss (KL, summed over index producers)
    # per index producer: the top-k as (indices (B, n, k) int64 into entries[kv_source_of(layer)],
    # valid (B, n, k) bool: False where fewer than k entries were visible)
    selections: dict[int, tuple[Tensor, Tensor]]
    start: int = 0  # position of the pass's first row


class DenseForward:
    """Wraps a :class:`CEDModel` (its parameters are trained in place)."""

    def __init__(self, model: CEDModel, aux_stride: int = 8) -> None:
        self.model, self.cfg = model, model.cfg
        self.W = model.cfg.sliding_window
        self.aux_stride = aux_stride  # indexer loss on every aux_stride-th query row

    # ------------------------------------------------------------------ one training step's logits
    def run(self, ids: Tensor, doc: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
        """ids, doc: (B, T) int64 -> logits (B, T, V) f32 (rows below H from pass 1, the rest from
        pass 2 when ``plan.hit``) and the aux loss ()."""
        passes = self.run_passes(ids, doc, plan)
        if len(passes) == 1:
            return passes[0].logits, passes[0].aux
        first, second = passes
        return torch.cat([first.logits, second.logits[:, self.W:]], dim=1), first.aux + second.aux

    def run_passes(self, ids: Tensor, doc: Tensor, plan: Plan) -> list[PassOutput]:
        """The passes ``run`` merges: one (cold), or two under ``plan.hit`` (rows [0, H), then
        rows [H - W, T) over the first pass's entries below H); the probes read their top-k."""
        T, W = ids.shape[1], self.W
        if T % W or plan.hit % W or plan.narrow_end % W:
            raise ValueError(f"T={T}, hit={plan.hit}, narrow_end={plan.narrow_end} must be multiples of W={W}")
        if not plan.hit:
            return [self.forward_pass(ids, doc, 0, plan, None)]
        H = plan.hit
        if not 2 * W <= H <= T - W:
            raise ValueError(f"hit {H} must lie in [2W, T - W]")
        first = self.forward_pass(ids[:, :H], doc[:, :H], 0, plan, None)
        return [first, self.forward_pass(ids[:, H - W:], doc[:, H - W:], H - W, plan, (first.entries, H))]

    def forward_pass(self, ids: Tensor, doc: Tensor, start: int, plan: Plan,
                     prefix: tuple[dict[int, Entries], int] | None) -> PassOutput:
        """Rows [start, start + n) of each packed row; ``prefix`` = (earlier entries, H): groups
        below H come from there (the cached global KV of a hit), groups from H on from this pass."""
        m, cfg = self.model, self.cfg
        B, n = ids.shape
        pos = torch.arange(start, start + n, dtype=torch.long)
        flat_pos = pos.repeat(B)  # (B * n,) the rows' positions, batch-major
        h = m.embed_tokens(ids).float()
        E = cfg.decoder_start
        enc_mask = self._window_mask(pos, doc, floor=None)
        dec_mask = (self._window_mask(pos, doc, floor=plan.narrow_end - self.W)
                    if plan.narrow_end else enc_mask)
        entries: dict[int, Entries] = {}
        selections: dict[int, Tensor] = {}
        aux = h.new_zeros(())
        index_scores: dict[int, tuple[Tensor, Tensor]] = {}  # index producer -> (scores, visible)
        targets: dict[int, list[Tensor]] = {}  # index producer -> attention of each layer it serves
        for layer in m.layers:
            i = layer.layer_id
            if layer.compressor is not None:
                entries[i] = self._entries(layer.compressor, h, pos, doc, prefix[0][i] if prefix else None,
                                           prefix[1] if prefix else 0, cfg.global_lag(i))
            hn = layer.attn_norm(h.reshape(B * n, -1))
            q = layer.queries(hn, flat_pos).view(B, n, layer.num_heads, layer.latent)
            kv = layer.window_kv(hn, flat_pos).view(B, n, layer.latent)
            source = cfg.kv_source_of(i)
            glob = None
            if source is not None:
                ent = entries[source]
                visible = (ent.visible_from[None, None, :] <= pos[None, :, None]) & (ent.doc[:, None, :] == doc[:, :, None])
                if layer.has_indexer:
                    iq, iw = layer.index_queries(hn)
                    iq, iw = iq.view(B, n, *iq.shape[1:]), iw.view(B, n, -1)
                    scores = torch.einsum("bthd,bcd->bthc", iq, ent.index_keys).relu()
                    scores = torch.einsum("bthc,bth->btc", scores, iw).masked_fill(~visible, NEG)
                    k = min(cfg.index_topk, scores.shape[-1])
                    # NOTE: ties (relu makes many exact zeros) go to the lower entry, as in the
                    # served top-k (a stable sort); a 1e-9 ramp does it at top-k's cost
                    ramp = torch.arange(scores.shape[-1], dtype=scores.dtype) * 1e-9
                    top = (scores.detach() - ramp).topk(k, dim=-1)
                    selections[i] = (top.indices, torch.isfinite(top.values))
                    index_scores[i] = (scores, visible)
                glob = (ent, visible, selections[cfg.topk_source_of(i)])
            mask = dec_mask if i > E else enc_mask
            o, dense_logits = self._attention(q, kv, mask, layer.sink, layer.scale, glob, plan.dense_global)
            if source is not None:  # NOTE: a dense step has the main attention's logits at hand: no second pass
                targets.setdefault(cfg.topk_source_of(i), []).append(
                    self._attention_target(q, layer.scale, ent, visible) if dense_logits is None
                    else self._target_of(dense_logits))
            h = h + layer.attn_output(o.reshape(B * n, layer.num_heads, layer.latent), flat_pos).view(B, n, -1)
            h = h + layer.mlp(layer.mlp_norm(h))
        for i, (scores, visible) in index_scores.items():
            aux = aux + self._indexer_loss(torch.stack(targets[i]).mean(0), scores, visible)
        logits = m.lm_head(m.norm(h)).float()
        return PassOutput(logits, entries, aux, selections, start)

    # ------------------------------------------------------------------ pieces
    def _entries(self, comp: Compressor, x: Tensor, pos: Tensor, doc: Tensor, cached: Entries | None,
                 hit: int, lag: int) -> Entries:
        B, n, _ = x.shape
        r = comp.ratio
        kv, gate = comp.project(x.reshape(B * n, -1))
        G = n // r
        first = pos[::r][:G]
        rows, index = comp.pool(kv, gate, first.repeat(B))
        rows, index = rows.view(B, G, -1), index.view(B, G, -1)
        epos, edoc = first + (r - 1), doc[:, r - 1::r][:, :G]
        if cached is None:
            return Entries(rows, index, epos, edoc, lag)
        # NOTE: a hit's global KV below H is what the earlier request wrote; groups from H on are new
        keep_old, keep_new = cached.pos < hit, first >= hit
        return Entries(torch.cat([cached.rows[:, keep_old], rows[:, keep_new]], 1),
                       torch.cat([cached.index_keys[:, keep_old], index[:, keep_new]], 1),
                       torch.cat([cached.pos[keep_old], epos[keep_new]]),
                       torch.cat([cached.doc[:, keep_old], edoc[:, keep_new]], 1), lag)

    def _window_mask(self, pos: Tensor, doc: Tensor, floor: int | None) -> Tensor:
        """(B, nb, W, 2W) bool: query i of block j sees key k of blocks j-1, j. ``floor``: the
        narrowed decoder's lowest key for queries at or above it."""
        W = self.W
        B, n = doc.shape
        nb = n // W
        qpos = pos.view(nb, W)
        kpos = torch.cat([qpos - W, qpos], dim=1)  # (nb, 2W)
        vis = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] > qpos[:, :, None] - W)
        vis = vis & (kpos[:, None, :] >= int(pos[0]))  # the first block has no block before it
        if floor is not None:
            vis = vis & ((kpos[:, None, :] >= floor) | (qpos[:, :, None] < floor))
        dq = doc.view(B, nb, W)
        dk = torch.cat([torch.cat([torch.full_like(dq[:, :1], -2), dq[:, :-1]], 1), dq], dim=2)
        same = (dk[:, :, None, :] == dq[:, :, :, None]) & (dq[:, :, :, None] >= 0)
        return vis[None] & same

    def _attention(self, q: Tensor, kv: Tensor, mask: Tensor, sink: Tensor, scale: float, glob,
                   dense: bool) -> tuple[Tensor, Tensor | None]:
        """q: (B, n, H, D), kv: (B, n, D), mask: (B, nb, W, 2W) -> o (B, n, H, D) and, when every
        visible entry is attended (``dense``), their masked logits (B, n, H, C) (else None)."""
        B, n, H, D = q.shape
        W = self.W
        nb = n // W
        q = q * scale  # NOTE: scaled once here, not the (many more) logits
        qb = q.view(B, nb, W, H, D)
        kb = kv.view(B, nb, W, D)
        kw = torch.cat([torch.cat([torch.zeros_like(kb[:, :1]), kb[:, :-1]], 1), kb], dim=2)  # (B, nb, 2W, D)
        lw = torch.einsum("bjqhd,bjkd->bjqhk", qb, kw)
        lw = lw.masked_fill(~mask[:, :, :, None, :], NEG)
        parts = [lw.reshape(B, n, H, 2 * W)]
        if glob is not None:
            ent, visible, (idx, valid) = glob
            if dense:
                lg = torch.einsum("bthd,bcd->bthc", q, ent.rows)
                lg = lg.masked_fill(~visible[:, :, None, :], NEG)
            else:
                kg = ent.rows[torch.arange(B)[:, None, None], idx]  # (B, n, k, D)
                lg = torch.einsum("bthd,btkd->bthk", q, kg)
                lg = lg.masked_fill(~valid[:, :, None, :], NEG)
            parts.append(lg)
        parts.append(sink.float().view(1, 1, H, 1).expand(B, n, H, 1))
        # NOTE: split, not sliced: the backward is one cat of the parts' gradients, where each
        # slice's backward filled a zero tensor of the whole softmax and copied into it
        p = torch.softmax(torch.cat(parts, dim=-1), dim=-1).split([x.shape[-1] for x in parts], dim=-1)
        pw = p[0].reshape(B, nb, W, H, 2 * W)
        o = torch.einsum("bjqhk,bjkd->bjqhd", pw, kw).reshape(B, n, H, D)
        if glob is not None:
            pg = p[1]
            o = o + (torch.einsum("bthc,bcd->bthd", pg, ent.rows) if dense else torch.einsum("bthk,btkd->bthd", pg, kg))
        return o, (lg if glob is not None and dense else None)

    @torch.no_grad()
    def _target_of(self, dense_logits: Tensor) -> Tensor:
        """:meth:`_attention_target` from a dense step's own masked logits (B, n, H, C): the same
        softmax over the visible entries, head-mean, on every aux_stride-th query row."""
        return torch.softmax(dense_logits.detach()[:, ::self.aux_stride], -1).mean(2)

    @torch.no_grad()
    def _attention_target(self, q: Tensor, scale: float, ent: Entries, visible: Tensor) -> Tensor:
        """One layer's main attention over the visible entries, head-mean, on every
        aux_stride-th query row: (B, n', C) f32 (detached)."""
        rows = slice(0, None, self.aux_stride)
        vis = visible[:, rows]
        lg = torch.einsum("bthd,bcd->bthc", q[:, rows].detach(), ent.rows.detach()) * scale
        return torch.softmax(lg.masked_fill(~vis[:, :, None, :], NEG), -1).mean(2)

    def _indexer_loss(self, target: Tensor, scores: Tensor, visible: Tensor) -> Tensor:
        """KL(target || softmax(indexer)) on every aux_stride-th query row that sees at least two
        entries. target: the mean main attention of every layer that uses this indexer's
        selection (it picks their entries, so it learns where all of them look)."""
        rows = slice(0, None, self.aux_stride)
        vis = visible[:, rows]
        keep = vis.sum(-1) >= 2  # (B, n')
        if not bool(keep.any()):
            return scores.new_zeros(())
        logp = F.log_softmax(scores[:, rows], -1)
        kl = (target * (torch.log(target.clamp_min(1e-12)) - logp.clamp_min(-1e4))).masked_fill(~vis, 0).sum(-1)
        return kl[keep].mean()
