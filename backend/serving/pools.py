"""Cedar's serving state inside SGLang: what is shared per token slot, what is private per
request slot (SPEC section 2).

- :class:`TokenPools` (shared, prefix-cacheable): for every KV source, FP4 global rows and index
  keys, one row per ``r`` token slots (row = slot // r: SGLang pages are aligned to every ratio,
  so a group's tokens share one page), plus the token id that produced each slot (replay reads
  it). SGLang's radix tree shares token slots, so a prefix hit shares exactly these rows.
- :class:`RequestSlots` (private, one per SGLang request slot): the FP8 window rings of every
  layer, the compressor tails, the encoder outputs of the last W positions (a chunked prefill's
  decoder tail), and who owns the slot. SWA state never enters the radix tree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW, WINDOW_ROW, code_cols, scale_cols

from ..cache import ring_size
from ..config import CEDConfig
from .prefix_digest import PrefixHasher


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class SourceRows:
    ratio: int
    rows: Tensor  # (num_rows, D/2) uint8 FP4 codes
    row_scales: Tensor  # (num_rows, D/16) uint8 E4M3
    index_rows: Tensor  # (num_rows, Di/2) uint8 FP4 codes
    index_scales: Tensor  # (num_rows, Di/32) uint8 E8M0


class TokenPools:
    """Per token slot state, sized by SGLang's token pool (``num_slots`` slots)."""

    def __init__(self, cfg: CEDConfig, num_slots: int, device: torch.device | str = "cpu") -> None:
        D, Di = cfg.kv_latent_dim, cfg.index_head_dim
        self.num_slots, self.device = num_slots, torch.device(device)
        z = functools.partial(torch.zeros, dtype=torch.uint8, device=self.device)
        self.sources: dict[int, SourceRows] = {}
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            n = -(-num_slots // r)
            self.sources[s] = SourceRows(
                r, z(n, code_cols(GLOBAL_ROW, D)), z(n, scale_cols(GLOBAL_ROW, D)),
                z(n, code_cols(INDEX_ROW, Di)), z(n, scale_cols(INDEX_ROW, Di)))
        # the token that filled each slot
        self.token_ids = torch.zeros(num_slots, dtype=torch.int32, device=self.device)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.token_ids, *(t for s in self.sources.values()
                                         for t in (s.rows, s.row_scales, s.index_rows, s.index_scales)))


@dataclass
class SlotOwner:
    """Who a request slot's private state belongs to. Written by the planner (claim) and by the
    forward (advance); a slot whose owner or position does not match a request is stale."""

    rid: str | None = None
    next_pos: int = 0  # encoder-side state is complete for positions [window_floor, next_pos)
    decoder_pos: int = 0  # decoder rings are up to date below this position
    window_floor: int = 0  # replay start of this owner's first forward
    cached_tokens: int = 0
    replayed_tokens: int = 0
    restored_tokens: int = 0  # the prefix a snapshot continued exactly (nothing replayed)
    hasher: PrefixHasher | None = None  # digest of this owner's prefix at page boundaries


@dataclass
class RequestSlots:
    """Private state of every SGLang request slot (``num_slots`` = req_to_token_pool.size)."""

    cfg: CEDConfig
    num_slots: int
    device: torch.device | str = "cpu"  # where every tensor below lives (the model's device)
    ring_rows: dict[int, Tensor] = field(init=False)  # layer -> (slots, S_l, D) uint8 FP8
    ring_scales: dict[int, Tensor] = field(init=False)  # layer -> (slots, S_l, D/32) uint8 E8M0
    ring_pos: dict[int, Tensor] = field(init=False)  # layer -> (slots, S_l) int64, -1 = empty
    tail_kv: dict[int, Tensor] = field(init=False)  # ratio>1 source -> (slots, r-1, D) f32
    tail_gate: dict[int, Tensor] = field(init=False)
    tail_len: dict[int, Tensor] = field(init=False)  # source -> (slots,) int64
    enc_out: Tensor = field(init=False)  # (slots, W, hidden) f32: layer E inputs, slot = pos % W
    enc_pos: Tensor = field(init=False)  # (slots, W) int64, -1 = empty
    owners: list[SlotOwner] = field(init=False)

    def __post_init__(self) -> None:
        cfg, n, D, W = self.cfg, self.num_slots, self.cfg.kv_latent_dim, self.cfg.sliding_window
        self.device = dev = torch.device(self.device)
        self.ring_rows, self.ring_scales, self.ring_pos = {}, {}, {}
        for layer in range(cfg.num_hidden_layers):
            S = ring_size(cfg, layer)
            self.ring_rows[layer] = torch.zeros(n, S, code_cols(WINDOW_ROW, D), dtype=torch.uint8, device=dev)
            self.ring_scales[layer] = torch.zeros(n, S, scale_cols(WINDOW_ROW, D), dtype=torch.uint8, device=dev)
            self.ring_pos[layer] = torch.full((n, S), -1, dtype=torch.long, device=dev)
        self.tail_kv, self.tail_gate, self.tail_len = {}, {}, {}
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            if r > 1:
                self.tail_kv[s] = torch.zeros(n, r - 1, D, device=dev)
                self.tail_gate[s] = torch.zeros(n, r - 1, D, device=dev)
                self.tail_len[s] = torch.zeros(n, dtype=torch.long, device=dev)
        self.enc_out = torch.zeros(n, W, cfg.hidden_size, device=dev)
        self.enc_pos = torch.full((n, W), -1, dtype=torch.long, device=dev)
        self.owners = [SlotOwner() for _ in range(n)]

    def reset(self, slot: int, rid: str, start: int) -> None:
        """Give ``slot`` to request ``rid`` whose first row is at ``start``: nothing of the
        previous occupant stays readable (NOTE: positions are tagged, and all tags cleared)."""
        for layer in self.ring_pos:
            self.ring_pos[layer][slot] = -1
        for s in self.tail_len:
            self.tail_len[s][slot] = 0
        self.enc_pos[slot] = -1
        self.owners[slot] = SlotOwner(rid=rid, next_pos=start, decoder_pos=start, window_floor=start,
                                      hasher=PrefixHasher(self.cfg.page_size))

    def slot_tensors(self) -> dict[str, Tensor]:
        """Every private per-slot tensor by name (first dim = request slot)."""
        out = {}
        for layer in self.ring_pos:
            out[f"ring_rows.{layer}"] = self.ring_rows[layer]
            out[f"ring_scales.{layer}"] = self.ring_scales[layer]
            out[f"ring_pos.{layer}"] = self.ring_pos[layer]
        for s in self.tail_len:
            out[f"tail_kv.{s}"], out[f"tail_gate.{s}"] = self.tail_kv[s], self.tail_gate[s]
            out[f"tail_len.{s}"] = self.tail_len[s]
        out["enc_out"], out["enc_pos"] = self.enc_out, self.enc_pos
        return out

    @property
    def nbytes(self) -> int:
        rings = _nbytes(*self.ring_rows.values(), *self.ring_scales.values())
        return rings + _nbytes(*self.tail_kv.values(), *self.tail_gate.values(), self.enc_out)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's private tensors, tags included (what a snapshot copies)."""
        return sum(t[0].numel() * t.element_size() for t in self.slot_tensors().values())

    @property
    def window_bytes_per_slot(self) -> int:
        return _nbytes(*self.ring_rows.values(), *self.ring_scales.values()) // self.num_slots
