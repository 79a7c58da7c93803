"""The gated compressor of a KV source: one global KV entry (and one index key) per ``r`` tokens.

Entry g summarises tokens ``[g*r, g*r + r)``: ``sum_j softmax_j(gate_j) * kv_j`` per channel
(ratio 1: no gate, the entry is the token's own projection). The pooled latent is normalised and
RoPE'd at the group's last position (the position from which the entry is visible), then
quantized (FP4) by the cache. The index key is ``index_norm(wk_index(pooled))``.

The compressor reads the layer's *input* hidden state: for the decoder source (layer E) that is
the encoder's last hidden state, so the decoder's global KV depends on no decoder weight but the
compressor's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .modules import RMSNorm, Rope, apply_rope, linear


class Compressor(nn.Module):
    def __init__(self, hidden: int, latent: int, index_dim: int, ratio: int, rope_dim: int,
                 rope_theta: float, eps: float) -> None:
        super().__init__()
        self.ratio, self.rope_dim, self.rope_theta = ratio, rope_dim, rope_theta
        self.norm = RMSNorm(hidden, eps)
        self.wkv = nn.Linear(hidden, latent, bias=False)
        self.wgate = nn.Linear(hidden, latent, bias=False) if ratio > 1 else None
        self.kv_norm = RMSNorm(latent, eps)
        self.wk_index = nn.Linear(latent, index_dim, bias=False)
        self.index_norm = RMSNorm(index_dim, eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """x: (T, hidden) layer input -> kv (T, latent) f32 and gate (T, latent) f32 (None at r=1)."""
        xn = self.norm(x)
        f = self.norm.fast
        return linear(xn, self.wkv, f).float(), (linear(xn, self.wgate, f).float() if self.wgate is not None else None)

    def pool(self, kv: Tensor, gate: Tensor | None, first_pos: Tensor) -> tuple[Tensor, Tensor]:
        """kv, gate: (G * r, latent) rows of G complete groups; first_pos: (G,) int64 group starts.
        Returns global rows (G, latent) f32 (normed, RoPE'd) and index keys (G, index_dim) f32."""
        r = self.ratio
        kv = kv.view(-1, r, kv.shape[-1])  # (G, r, latent)
        if gate is None:
            pooled = kv[:, 0]
        else:
            w = torch.softmax(gate.view(-1, r, gate.shape[-1]), dim=1)
            pooled = (w * kv).sum(dim=1)  # (G, latent)
        entry_pos = Rope.of(first_pos + (r - 1), pooled.shape[-1], self.rope_dim, self.rope_theta, self.kv_norm.fast)
        rows = apply_rope(self.kv_norm(pooled), entry_pos, self.rope_dim, self.rope_theta)
        return rows, self.index_norm(linear(pooled, self.wk_index, self.norm.fast))


@dataclass(frozen=True)
class GroupSplit:
    """One request's projected rows cut into the compression groups a forward writes."""

    kv: Tensor  # (n * r, latent) f32 rows of the n groups to write
    gate: Tensor | None  # (n * r, latent) f32, None at r = 1
    first_pos: Tensor  # (n,) int64 start position of each group to write
    skipped_first_pos: Tensor  # (m,) int64 complete groups below the write floor (left as cached)
    tail_kv: Tensor  # (< r, latent) rows of the incomplete last group, kept pending
    tail_gate: Tensor | None


def split_groups(kv: Tensor, gate: Tensor | None, tail_kv: Tensor, tail_gate: Tensor | None, first_pos: int,
                 ratio: int, write_floor: int) -> GroupSplit:
    """Prepend the pending tail (rows before ``first_pos``) to a request's new rows and cut them
    into complete groups of ``ratio``. NOTE: the write floor keeps a shared prefix bit-identical:
    a group ending below it is not written (a group straddling it is).

    kv, gate: (T, latent) f32 rows at positions [first_pos, first_pos + T)."""
    t = tail_kv.shape[0]
    kv = torch.cat([tail_kv, kv])
    gate = torch.cat([tail_gate, gate]) if gate is not None else None
    start = first_pos - t
    if start % ratio:
        raise ValueError(f"compressor rows start at {start}, not a multiple of the ratio {ratio}")
    done = kv.shape[0] // ratio * ratio
    firsts = start + ratio * torch.arange(done // ratio, dtype=torch.long)
    keep = firsts + (ratio - 1) >= write_floor
    sel = keep.repeat_interleave(ratio)
    return GroupSplit(kv[:done][sel], gate[:done][sel] if gate is not None else None, firsts[keep], firsts[~keep],
                      kv[done:], gate[done:] if gate is not None else None)
