"""CedarRuntime: the one object that owns Cedar's side of every seam with SGLang.

SGLang runs the scheduler, the radix tree and the HTTP server; Cedar keeps what SGLang has no
notion of (the FP4 global rows per token slot, the private window state per request slot,
snapshots for exact continuation, bounded replay). Everything SGLang's hooks and its model
class ask of Cedar is a method here, and nothing here imports SGLang:

| seam (who calls) | method |
|---|---|
| ``ModelRunner.alloc_memory_pool`` hook | :meth:`allocate` (pools sized from SGLang's) |
| ``PrefillAdder._replay_len`` hook | :meth:`admission_replay_rows` |
| ``ForwardBatch.init_new`` hook | :meth:`note_request` (per-request facts of the scheduler) |
| ``release_kv_cache`` hook | :meth:`on_request_finished` (snapshot the window state) |
| ``UnifiedRadixCache.checkpoint_into_tree`` hook | :meth:`on_request_inserted` (re-key it) |
| ``/set_internal_state`` (handlers hook) | :meth:`set_switch` |
| ``/get_server_info`` (state hook) | :meth:`internal_state` |
| ``CedarForCausalLM.forward`` (SGLang's model class) | :meth:`forward` (a ForwardBatch) |

:meth:`forward` reads a ForwardBatch's host facts (:meth:`StepInput.of`; the only place Cedar
reads one) and runs :meth:`step`, the one forward step: the per-request replay prepass (a
benchmark switch), the plan, :func:`served_step` (keys from the pools, the layers, the commit)
and the stats. SGLang's model class and the tests' harness (``driver.py``, which hands it a
stand-in with a ForwardBatch's fields) both call :meth:`forward`, so a test exercises the code
SGLang runs, the ForwardBatch's reading included.

How a hook finds its runtime: the model runner's hooks read it off the model
(``model_runner.model.runtime``); the tree-cache hooks, which see only SGLang's request-to-token
pool, ask :func:`runtime_for` which live runtime was allocated against that pool (the process-
level lookup SGLang itself uses for its pools, ``forward_context.get_req_to_token_pool``). No
attribute is hung on an SGLang object.

Why Cedar rides its own folded replay and not upstream's: SGLang 0.5.23 has a folded encoder
replay for DeepSeek-V4.1 (``model_executor/encoder_swa_replay.py``), behind the
``enable_encoder_swa_bounded_replay`` feature that the V4 argument hook turns on. The TP worker
prepends each hit's last min(H, 128) cached tokens to its extend (``fold_encoder_swa_replay``),
resetting windows through the V4 KV pool's ``request_window`` and handing V4's attention backend
the row floors (``encoder_swa_row_floor``); ``PrefillAdder._replay_len`` charges those rows.
Every piece of it is tied to V4's own pool and attention backend, which Cedar does not use (its
pools are its own: FP4 global rows per token slot, a private window per request slot), and it
always replays, where Cedar restores a snapshot and replays nothing when a finished request is
continued exactly. Cedar hooks only the budget side, ``_replay_len``, so SGLang's admission
charges Cedar's rows (:meth:`admission_replay_rows`: W rows, or none when a snapshot continues
the request), and folds those rows into the batch's one forward itself (:mod:`planner`).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from cedar.kernels import cpu_ext

from ..memory import budget_bytes_per_token, memory_report
from ..model import CEDModel
from .integrity import slot_integrity
from .native_step import round_to_bf16
from .planner import RequestInfo, ServedForward, ServingFlags, admission_replay_rows, plan_forward
from .pools import RequestSlots, TokenPools
from .prepass import replay_prepass
from .snapshots import SnapshotStore
from .stats import ServingStats
from .step import served_step

logger = logging.getLogger(__name__)

# runtime switches for /set_internal_state (0/1): benchmarks and tests flip modes in one server
SWITCHES = {
    "cedar_replay_per_request": lambda on: dict(replay_per_request=on),
    "cedar_narrow": lambda on: dict(narrow=on),
    "cedar_replay_exact": lambda on: dict(replay="exact" if on else "bounded"),
    "cedar_snapshots": lambda on: dict(snapshots=on),
    "cedar_decode_one_thread": lambda on: dict(decode_threads=1 if on else 0),  # 0: the server's threads
}
DECODE_THREADS_SWITCH = "cedar_decode_one_thread"
REPLAY_SWITCH = "cedar_replay_per_request"


def switch_problem(server_args) -> str | None:
    """Why a /set_internal_state body's Cedar switches are refused, or None (other keys are
    SGLang's to judge)."""
    for key, value in (server_args or {}).items():
        if key.startswith("cedar_") and key not in SWITCHES:
            return f"unknown Cedar switch {key!r}: one of {sorted(SWITCHES)}"
        if key in SWITCHES and not (type(value) in (int, bool) and value in (0, 1)):
            return f"{key} must be 0 or 1, got {value!r}"
    return None


@dataclass(frozen=True)
class StepInput:
    """The host facts of one forward, as SGLang's ForwardBatch carries them (CPU lists; rows
    ``[prefix_lens[b], prefix_lens[b] + extend_lens[b])`` of request ``b`` are scheduled).

    req_to_token: (num request slots, max len) int32, SGLang's request-to-token-slot table."""

    kind: str  # "decode" | "extend"
    rids: list[str]
    req_slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: Tensor

    @classmethod
    def of(cls, fb, req_to_token: Tensor) -> "StepInput":
        """The facts of SGLang's ForwardBatch ``fb`` (a decode or extend batch): its rids, request
        slots and, per request, the rows already cached and the rows scheduled now."""
        if fb.forward_mode.is_decode():
            kind, prefix, ext = "decode", (fb.seq_lens_cpu - 1).tolist(), [1] * fb.batch_size
        else:
            kind, prefix, ext = "extend", list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        slots = fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices
        return cls(kind, list(fb.rids), slots.tolist(), prefix, ext, req_to_token)


@dataclass(frozen=True)
class StepOutput:
    """hidden: (rows, hidden) f32, the normed last hidden state of each scheduled row (0 where
    its decoder did not run); decoded: (rows,) bool, the rows whose decoder ran."""

    hidden: Tensor
    decoded: Tensor
    plan: ServedForward
    kind: str = "extend"  # "decode" | "extend", as the step's input


_LIVE: "weakref.WeakSet[CedarRuntime]" = weakref.WeakSet()


def runtime_for(req_to_token_pool) -> "CedarRuntime | None":
    """The live runtime allocated against SGLang's ``req_to_token_pool`` (None for another model's)."""
    if req_to_token_pool is None:
        return None
    return next((rt for rt in list(_LIVE) if rt.sglang_pool is req_to_token_pool), None)


class CedarRuntime:
    """Cedar's serving state and every operation SGLang's seams ask of it (see the module doc)."""

    def __init__(self, model: CEDModel, flags: ServingFlags, device: torch.device) -> None:
        self.model, self.cfg, self.flags, self.device = model, model.cfg, flags, torch.device(device)
        self.pools: TokenPools | None = None
        self.slots: RequestSlots | None = None
        self.snapshots: SnapshotStore | None = None
        self.stats = ServingStats()
        self.threads = torch.get_num_threads()  # the server's CPU threads: every step but decode runs on them
        self.sglang_pool = None  # the SGLang request-to-token pool this runtime was allocated against
        self.req_to_token: Tensor | None = None  # its table: (request slots, max len) int32
        # NOTE: per-request facts of the scheduler, keyed by (request slot, prefix length), each
        # with the rid that noted it: the forward batch SGLang hands the model is not always the
        # object its init_new built, and with overlap scheduling a slot's next chunk can be noted
        # before this one runs. A note drops the slot's stale entries (another rid's, whatever
        # prefix the new one starts at; its own from an earlier life, see note_request), and an
        # entry goes when it is consumed: at most the chunks in flight of one request per slot.
        self._facts: dict[tuple[int, int], tuple[str, RequestInfo]] = {}

    # ------------------------------------------------------------------ pools
    def allocate(self, num_token_slots: int, req_to_token: Tensor, page_size: int,
                 chunked_prefill_size: int | None = None, budget_tokens: int | None = None,
                 sglang_pool=None) -> dict:
        """Size Cedar's pools from SGLang's: token slots, its request-to-token table ((request
        slots, max len) int32, read by every step) and page size. Refuses a prefill chunk that
        cannot hold a hit's replay rows. Remembers SGLang's request-to-token pool (an opaque
        handle) so the tree-cache hooks find this runtime."""
        if page_size % self.cfg.page_size:
            raise ValueError(f"SGLang page size {page_size} is not a multiple of the model's "
                             f"{self.cfg.page_size} (serve with --page-size {self.cfg.page_size})")
        need = self.cfg.sliding_window + page_size
        if chunked_prefill_size is not None and 0 < chunked_prefill_size < need:
            raise ValueError(f"--chunked-prefill-size {chunked_prefill_size} leaves no room for a hit's "
                             f"{self.cfg.sliding_window} replay rows: serve with at least {need}")
        if self.flags.weights != "float32":
            round_to_bf16(self.model, matmul=self.flags.weights == "bf16-matmul")
        self.pools = TokenPools(self.cfg, num_token_slots, self.device)
        self.slots = RequestSlots(self.cfg, req_to_token.shape[0], self.device)
        self.snapshots = SnapshotStore(int(self.flags.snapshot_mb * 2**20)) if self.flags.snapshot_mb > 0 else None
        self.req_to_token = req_to_token
        self._facts.clear()
        if sglang_pool is not None:
            self.sglang_pool = sglang_pool
            _LIVE.add(self)
        figures = self.memory_figures()
        if budget_tokens is not None:
            logger.info("cedar memory: SGLang budgets %d B/token for %d tokens; SWA %d B/request; pools %s",
                        figures["budget_bytes_per_token"], budget_tokens, figures["swa_bytes_per_request"], figures)
        return figures

    def memory_figures(self) -> dict:
        report = memory_report(self.cfg)
        figures = {
            "budget_bytes_per_token": budget_bytes_per_token(self.cfg),
            "global_bytes_per_token": report.global_bytes_per_token,
            "swa_bytes_per_request": report.swa_bytes_per_request,
        }
        if self.pools is not None:
            figures.update(
                token_slots=self.pools.num_slots, token_pool_bytes=self.pools.nbytes,
                request_slots=self.slots.num_slots, request_slot_bytes=self.slots.nbytes,
                swa_bytes_per_request_allocated=self.slots.window_bytes_per_slot,
                snapshots=self.snapshots.stats() if self.snapshots is not None else None)
        return figures

    def kernel_info(self) -> dict:
        """Which kernels serve: the dispatch backend, and on CPU whether the C++ kernels loaded."""
        ks = self.model.kernels
        return {"backend": ks.backend, "cpu_ext": ks.backend == "fast" and cpu_ext.available()}

    def _ensure_pools(self) -> None:
        if self.pools is None:  # the allocation hook did not run: fail loudly, never guess
            raise RuntimeError("cedar pools were not allocated: the SGLang plugin hooks are not active")

    # ------------------------------------------------------------------ admission and facts
    def admission_replay_rows(self, hit: int, prefix_slots: Tensor | None, budget: int | None = None,
                              page_size: int = 0, alone: bool = False) -> int:
        """Replay rows SGLang's prefill budget must charge a request admitted at a prefix hit of
        ``hit`` tokens (see planner.admission_replay_rows). budget: the rows left in this prefill
        (SGLang's ``rem_chunk_tokens``; None: unbounded); alone: no other request is admitted yet."""
        if self.pools is None:
            return 0
        rows = admission_replay_rows(self.cfg, self.flags, self.pools, self.snapshots, hit, prefix_slots)
        if rows and budget is not None and alone and rows > budget - page_size:
            # NOTE: only `--replay exact` (the whole prefix, a reference mode) gets here (allocate
            # keeps the chunk above W + a page): such a request runs alone, over the budget,
            # rather than never.
            return max(budget - page_size, 0)
        return rows

    def note_request(self, slot: int, prefix_len: int, rid: str, info: RequestInfo) -> None:
        """What the scheduler knows of request ``rid``'s next chunk (starting at ``prefix_len``
        in request slot ``slot``) and the forward does not carry."""
        # NOTE: stale: another request's (one aborted before it ran), and, for this request, any
        # at or past this chunk's start (an earlier life of it: a retracted request is admitted
        # again under its rid, at 0 or at a hit); a pending earlier chunk of this life stays
        stale = [k for k, (owner, _) in self._facts.items()
                 if k[0] == slot and (owner != rid or prefix_len == 0 or k[1] >= prefix_len)]
        for key in stale:
            del self._facts[key]
        self._facts[(slot, prefix_len)] = (rid, info)

    def _take_facts(self, slot: int, prefix_len: int, rid: str) -> RequestInfo:
        owner, info = self._facts.pop((slot, prefix_len), (rid, RequestInfo()))
        return info if owner == rid else RequestInfo()

    # ------------------------------------------------------------------ release and checkpoint
    def on_request_finished(self, slot: int, rid: str) -> bool:
        """A request finished: keep its slot's state for exact continuation."""
        if self.snapshots is None or not self.flags.snapshots or self.slots is None \
                or self.slots.owners[slot].rid != rid:
            return False
        return self.snapshots.save(self.slots, slot, self.slots.owners[slot].hasher)

    def on_request_inserted(self, rid: str, tree_slots: Tensor) -> None:
        """The tree took a finished request's prefix (tree_slots: (n,) the slots it kept, the
        request's own or an earlier copy's): key its snapshot by those (see SnapshotStore.rekey)."""
        if self.snapshots is not None and self.pools is not None:
            self.snapshots.rekey(rid, tree_slots, self.pools.token_ids)

    # ------------------------------------------------------------------ switches and state
    def set_switch(self, key: str, on: bool) -> None:
        """Flip one runtime switch (a key of SWITCHES)."""
        self.flags = dataclasses.replace(self.flags, **SWITCHES[key](bool(on)))

    def internal_state(self, running: dict[int, str], sglang_pools: dict | None = None,
                       hooks: list[dict] | None = None) -> dict:
        """Cedar's part of /get_server_info. running: request slot -> rid of running requests;
        sglang_pools: SGLang's own pool accounting, judged (integrity.pool_integrity); hooks: the
        hook targets and whether each is installed."""
        state = dict(self.memory_figures())
        broken = slot_integrity(self.slots, self.snapshots, running) if self.slots is not None else []
        state["integrity"] = {**(sglang_pools or {}), "slots_ok": not broken, "slots_broken": broken[:20]}
        if hooks is not None:
            state["hooks"] = hooks
        state["replayed_tokens_total"] = self.stats.replayed_tokens
        state["forward_ms"] = self.stats.forward_summary()
        state["forward_rows_max"] = dict(self.stats.rows_max)
        state["kernels"] = self.kernel_info()
        state["threads"] = {"server": self.threads, "decode": self._threads_for("decode"),
                            "now": torch.get_num_threads()}
        state["flags"] = dataclasses.asdict(self.flags)
        return state

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def forward(self, input_ids: Tensor, forward_batch) -> StepOutput | None:
        """SGLang's model forward: one step over a ForwardBatch's scheduled rows (None for an idle
        batch). input_ids: (sum(extend_lens),) int on the pools' device; SGLang has written the
        rows' token slots (``out_cache_loc``) and its request-to-token table."""
        if forward_batch.forward_mode.is_idle() or input_ids.numel() == 0:
            return None
        self.write_ids(forward_batch.out_cache_loc, input_ids)
        return self.step(input_ids, StepInput.of(forward_batch, self.req_to_token))

    @torch.no_grad()
    def step(self, input_ids: Tensor, inp: StepInput) -> StepOutput:
        """One forward of SGLang's scheduled rows. input_ids: (sum(extend_lens),) int on the pools'
        device; the pools' token ids of the scheduled slots are already written (:meth:`write_ids`)."""
        self._ensure_pools()
        self._use_threads(inp.kind)
        # NOTE: facts are noted for prefill chunks only: a decode step never takes one (a stale
        # entry taken there would skip its decoder)
        infos = [RequestInfo()] * len(inp.rids) if inp.kind == "decode" else \
            [self._take_facts(s, p, r) for s, p, r in zip(inp.req_slots, inp.prefix_lens, inp.rids)]
        if self.flags.replay_per_request:
            for pre in replay_prepass(self.model, self.flags, self.slots, self.pools, inp.req_to_token,
                                      inp.rids, inp.req_slots, inp.prefix_lens, self.snapshots):
                self.stats.record(pre)
        plan = plan_forward(self.cfg, self.flags, self.slots, self.pools, inp.req_to_token, inp.rids,
                            inp.req_slots, inp.prefix_lens, inp.extend_lens, input_ids, infos, self.snapshots)
        hidden, decoded = served_step(self.model, self.pools, self.slots, plan, input_ids.shape[0])
        self.stats.record(plan, inp.kind)
        return StepOutput(hidden, decoded, plan, inp.kind)

    def _use_threads(self, kind: str) -> None:
        """Run this step on ``flags.decode_threads`` CPU threads if it decodes (at most the
        server's), else on the server's. The setting stays for what SGLang runs after the model
        (the LM head, sampling) and is changed only when the step kind changes."""
        if self.device.type == "cpu" and torch.get_num_threads() != (n := self._threads_for(kind)):
            torch.set_num_threads(n)

    def _threads_for(self, kind: str) -> int:
        if kind == "decode" and self.flags.decode_threads:
            return min(self.flags.decode_threads, self.threads)
        return self.threads

    def write_ids(self, token_slots: Tensor, input_ids: Tensor) -> None:
        """SGLang wrote the scheduled rows' K/V slots (``out_cache_loc``); record their token ids."""
        self._ensure_pools()
        self.pools.token_ids[token_slots.long()] = input_ids.int()

    def meta_info(self, plan: ServedForward) -> dict:
        """Per-request counters for each response's meta_info."""
        return self.stats.meta_info(plan, self.slots)
