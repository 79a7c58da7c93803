"""Planning one served forward: which rows each request runs, with which floors (SPEC section 3).

SGLang schedules rows ``[H, H + n)`` of each request (``H`` = its cached prefix). The planner
decides, per request:

- whether its slot's private state (window rings, compressor tails) continues it exactly
  (same owner, same position), or is stale: then it is reset and, on a prefix hit, the request
  replays ``R = min(W, H)`` rows ``[H - R, H)`` in front of its scheduled rows (encoder-side
  bounded replay, in this same forward);
- where its decoder runs: ``all`` its rows (untrimmed), its ``tail`` (the last W positions,
  some carried over from earlier chunks), or ``skip`` (a non-final chunk under narrowing).

SGLang's prefill budget counts replay rows: its admission asks :func:`admission_replay_rows`
(through the ``PrefillAdder._replay_len`` hook in :mod:`sglang_hooks`) how many rows a new
request with a prefix hit will replay, so a forward never runs more rows than
``--chunked-prefill-size`` / ``--max-prefill-tokens``, replay rows included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cedar.kernels.dispatch import BACKENDS

from ..config import CEDConfig
from ..rows import RowBatch
from .pools import RequestSlots, TokenPools
from .prefix_digest import prefix_digest
from .snapshots import SnapshotStore

REPLAY_MODES = ("bounded", "exact", "off")
WEIGHT_MODES = ("float32", "bf16", "bf16-matmul")
DECODER_MODES = ("all", "tail", "skip")


@dataclass(frozen=True)
class ServingFlags:
    """Server-wide switches (``cedar serve`` flags). ``replay_per_request`` runs replay as one
    separate forward per request before the batch (upstream's first design; a benchmark switch)."""

    replay: str = "bounded"
    narrow: bool = True
    replay_per_request: bool = False
    snapshot_mb: float = 64.0  # exact-continuation snapshots budget (0: none)
    snapshots: bool = True  # restore/save snapshots (a runtime switch; the budget stays allocated)
    kernels: str | None = None  # the kernel backend (cedar.kernels.dispatch); None: the device's default
    # NOTE: CPU threads a decode step runs on (0: the server's, as every other step). A served
    # decode step shares the machine with SGLang's tokenizer and detokenizer processes, which
    # handle every streamed token: a second OpenMP thread then waits on a busy core more than it
    # helps (`cedar bench scheduler`, the README's figures), while a prefill wants every core.
    decode_threads: int = 1
    weights: str = "float32"  # "bf16": projection weights rounded to bf16 at allocation (native_step.round_to_bf16);
    # "bf16-matmul": also a prefill's matmuls in bf16 (rows rounded; modules.matmul_weight)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.decode_threads < 0:
            raise ValueError(f"decode_threads must be >= 0 (0: the server's threads), got {self.decode_threads}")
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay mode must be one of {REPLAY_MODES}, got {self.replay!r}")
        if self.kernels is not None and self.kernels not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {self.kernels!r}")


@dataclass(frozen=True)
class RequestInfo:
    """What SGLang's scheduler knows of a request and a forward does not carry (attached to the
    ForwardBatch by the ``init_new`` hook): is this its prompt's last chunk, does it want prompt
    logprobs (then it runs untrimmed)."""

    final_chunk: bool = True
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class ServedRequest:
    slot: int  # SGLang request slot (req_pool_indices)
    rid: str
    row_start: int  # first position this forward runs (the replay start on a stale hit)
    prefix_len: int  # H: rows below it are cached; the global write floor
    seq_len: int
    window_floor: int  # lowest readable window position (the owner's replay start)
    replayed: int  # replay rows put in front of the scheduled rows
    decoder: str  # one of DECODER_MODES
    token_slots: Tensor  # (seq_len,) int64 token slot of every position
    decoder_pos: int = 0  # the slot's decoder state is up to date below this position

    @property
    def num_rows(self) -> int:
        return self.seq_len - self.row_start


@dataclass(frozen=True)
class ServedForward:
    requests: tuple[ServedRequest, ...]
    input_ids: Tensor  # (T,) int64 model rows: each request's replay rows, then its scheduled rows
    batch: RowBatch
    sched_index: Tensor  # (T,) int64 the row's index in SGLang's batch, -1 for a replay row


def replay_rows(flags: ServingFlags, cfg: CEDConfig, hit: int) -> int:
    """Rows a request whose slot state is stale replays at a prefix hit of ``hit`` tokens."""
    return hit - _stale_start(flags, cfg, hit)


def _snapshot_digest(pools: TokenPools, token_slots: Tensor, hit: int) -> str:
    return prefix_digest(token_slots[:hit], pools.token_ids[token_slots[:hit]])


def _restorable(flags: ServingFlags, snapshots: SnapshotStore | None, hit: int) -> bool:
    """Whether a snapshot could continue a hit (NOTE: an empty store skips hashing the prefix)."""
    return bool(hit) and bool(snapshots) and flags.snapshots and flags.replay != "off"


def admission_replay_rows(cfg: CEDConfig, flags: ServingFlags, pools: TokenPools, snapshots: SnapshotStore | None,
                          hit: int, prefix_slots: Tensor | None) -> int:
    """Replay rows a request admitted with a prefix hit of ``hit`` tokens will run in front of
    its scheduled rows (SGLang's prefill budget charges them): none where a snapshot continues
    it exactly. prefix_slots: (hit,) the token slots the radix tree matched, None if unknown
    (then a snapshot is not assumed)."""
    if prefix_slots is not None and _restorable(flags, snapshots, hit) \
            and snapshots.contains(hit, _snapshot_digest(pools, prefix_slots.long(), hit)):
        return 0
    return replay_rows(flags, cfg, hit)


def _stale_start(flags: ServingFlags, cfg: CEDConfig, hit: int) -> int:
    """Replay start for a request whose private state is stale, at a prefix hit of ``hit``."""
    if hit == 0:
        return 0
    if any(hit % cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids):
        raise ValueError(f"prefix hit of {hit} tokens is not aligned to the compression ratios "
                         f"(serve with --page-size {cfg.page_size})")
    replay = hit if flags.replay == "exact" else min(cfg.sliding_window, hit)
    return hit - replay


def _decoder_mode(flags: ServingFlags, info: RequestInfo, decoder_pos: int, start: int,
                  num_rows: int, window: int) -> str:
    if (not flags.narrow or flags.replay == "exact" or info.prompt_logprobs) and decoder_pos == start:
        return "all"
    # NOTE: an untrimmed request whose decoder is behind (its mode was switched mid-prompt) can
    # only run the carried tail: the decoder never saw its earlier rows.
    if not info.final_chunk:
        return "skip"
    if decoder_pos == start and num_rows <= window:
        return "all"
    return "tail"


def claim_slot(cfg: CEDConfig, flags: ServingFlags, slots: RequestSlots, pools: TokenPools, slot: int,
               rid: str, hit: int, token_slots: Tensor, snapshots: SnapshotStore | None) -> None:
    """Give a stale ``slot`` to ``rid``: restore a snapshot that continues exactly at the hit,
    else reset it for bounded replay from the replay start."""
    if _restorable(flags, snapshots, hit) \
            and snapshots.restore(slots, slot, rid, hit, _snapshot_digest(pools, token_slots, hit)):
        return
    slots.reset(slot, rid, _stale_start(flags, cfg, hit))
    slots.owners[slot].cached_tokens = hit


def plan_forward(cfg: CEDConfig, flags: ServingFlags, slots: RequestSlots, pools: TokenPools,
                 req_to_token: Tensor, rids: list[str], req_slots: list[int], prefix_lens: list[int],
                 extend_lens: list[int], input_ids: Tensor, infos: list[RequestInfo],
                 snapshots: SnapshotStore | None = None) -> ServedForward:
    """Claim or continue each request's slot and lay out the model rows of one forward.

    Mutates ``slots`` (resets stale slots to their new owner, or restores a snapshot).
    input_ids: (sum(extend_lens),). Every tensor of the plan lives on the pools' device; the
    sizes come from the host lists (SGLang's own CPU-side metadata), never from a tensor."""
    requests = []
    long = dict(dtype=torch.long, device=pools.device)
    for b, (rid, slot, hit, n) in enumerate(zip(rids, req_slots, prefix_lens, extend_lens)):
        seq_len = hit + n
        token_slots = req_to_token[slot, :seq_len].long()
        owner = slots.owners[slot]
        if not (owner.rid == rid and owner.next_pos == hit):  # else: a later chunk, a decode step
            claim_slot(cfg, flags, slots, pools, slot, rid, hit, token_slots, snapshots)
        owner = slots.owners[slot]
        start = owner.next_pos
        mode = _decoder_mode(flags, infos[b], owner.decoder_pos, start, seq_len - start, cfg.sliding_window)
        requests.append(ServedRequest(slot, rid, start, hit, seq_len, owner.window_floor, hit - start,
                                      mode, token_slots, owner.decoder_pos))
    lens = tuple(r.num_rows for r in requests)
    if all(r.replayed == 0 and r.num_rows == 1 for r in requests):
        # NOTE: a decode step (every request one scheduled row, nothing replayed): SGLang's rows
        # are the model's rows in order, each at its request's prefix length. The same tensors as
        # below in three ops, where that built five a request (a third of the planner's time at
        # batch 8)
        batch = RowBatch(torch.tensor([r.row_start for r in requests], **long), lens)
        return ServedForward(tuple(requests), input_ids.long(), batch, torch.arange(len(requests), **long))
    ids, sched, pos, offset = [], [], [], 0
    for r, n in zip(requests, extend_lens):
        ids += [pools.token_ids[r.token_slots[r.row_start:r.prefix_len]].long(), input_ids[offset:offset + n]]
        sched += [torch.full((r.replayed,), -1, **long), torch.arange(offset, offset + n, **long)]
        pos.append(torch.arange(r.row_start, r.seq_len, **long))
        offset += n
    batch = RowBatch(torch.cat(pos) if pos else torch.zeros(0, **long), lens)
    return ServedForward(tuple(requests), torch.cat(ids) if ids else input_ids[:0].long(), batch,
                         torch.cat(sched) if sched else torch.zeros(0, **long))
