"""SGLang's side of a forward stood in for, driving a :class:`~.runtime.CedarRuntime` in process:
its request-to-token table by a plain tensor, its paged allocator by a counter (page 0 is
padding, as in SGLang) and its ForwardBatch by :class:`HostBatch` (the fields the runtime reads).
The runtime's ``forward``, and so the step, is the one SGLang's model class calls: only the
scheduler around it is a stand-in. Used by the GPU check (no SGLang there) and by the
tests' harness (``tests/serving_harness.py``) for bookkeeping tests; end-to-end tests use the
real server."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .planner import RequestInfo, ServingFlags
from .runtime import CedarRuntime, StepOutput


@dataclass(frozen=True)
class Mode:
    """SGLang's ForwardMode, as far as the runtime asks it."""

    decode: bool

    def is_decode(self) -> bool:
        return self.decode

    def is_idle(self) -> bool:
        return False


@dataclass(frozen=True)
class HostBatch:
    """A ForwardBatch's fields the runtime reads (``StepInput.of`` and ``CedarRuntime.forward``);
    the drift test pins them on SGLang's class. out_cache_loc: (rows,) int64, the scheduled rows'
    token slots; seq_lens_cpu, extend_*: per request, on the host."""

    forward_mode: Mode
    rids: list[str]
    req_pool_indices_cpu: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor

    @property
    def batch_size(self) -> int:
        return len(self.rids)


@dataclass
class Req:
    rid: str
    slot: int
    ids: list[int]  # every token so far (prompt + generated)
    token_slots: list[int] = field(default_factory=list)


class Driver:
    """A scheduler stand-in over one runtime (``self.rt``; its pools and slots are ``pools`` and
    ``slots``). num_slots: token slots; num_reqs: request slots; max_len: tokens per request."""

    def __init__(self, model, flags: ServingFlags = ServingFlags(), num_slots: int = 8192, num_reqs: int = 8,
                 max_len: int = 4096, device="cpu") -> None:
        self.model, self.cfg, self.device = model, model.cfg, torch.device(device)
        self.rt = CedarRuntime(model, flags, self.device)
        self.req_to_token = torch.zeros(num_reqs, max_len, dtype=torch.int32, device=self.device)
        self.rt.allocate(num_slots, self.req_to_token, self.cfg.page_size)
        self.rt.snapshots = None  # NOTE: a caller passes its own store to each step
        self.next_slot = self.cfg.page_size  # page 0 is padding, as in SGLang
        self._written: dict[int, tuple[str, int]] = {}  # request slot -> (rid, its table entries written)

    @property
    def pools(self):
        return self.rt.pools

    @property
    def slots(self):
        return self.rt.slots

    @property
    def flags(self) -> ServingFlags:
        return self.rt.flags

    def alloc(self, req: Req, n: int) -> list[int]:
        """Slots for positions [H, H + n) of req, page by page as SGLang's paged allocator does."""
        out, P = [], self.cfg.page_size
        last = req.token_slots[-1] if req.token_slots else None
        for p in range(len(req.token_slots), len(req.token_slots) + n):
            if p % P == 0:
                last = self.next_slot
                self.next_slot += P
            else:
                last = last + 1
            out.append(last)
        if self.next_slot > self.pools.num_slots:
            raise RuntimeError(f"the driver ran out of token slots ({self.pools.num_slots})")
        return out

    def prepare(self, batch: list[tuple[Req, int]], kind: str | None = None) -> tuple[HostBatch, torch.Tensor]:
        """SGLang's side of a forward: slots allocated, its table written. batch: (request, rows to
        schedule now). Returns the forward batch (its host facts) and the input ids."""
        rids, slots, prefix, ext, ids, new_all = [], [], [], [], [], []
        for req, n in batch:
            H = len(req.token_slots)
            new = self.alloc(req, n)
            req.token_slots += new
            # NOTE: as SGLang writes its table: a request's new slots only (all of them when the
            # row was another request's or its shared prefix is not written yet; from its length
            # before this step where a caller cut its slots back)
            rid, done = self._written.get(req.slot, (None, 0))
            done = min(done, H) if rid == req.rid else 0
            self.req_to_token[req.slot, done:len(req.token_slots)] = torch.tensor(req.token_slots[done:],
                                                                                dtype=torch.int32)
            self._written[req.slot] = (req.rid, len(req.token_slots))
            rids.append(req.rid); slots.append(req.slot); prefix.append(H); ext.append(n)
            ids += req.ids[H:H + n]; new_all += new
        input_ids = torch.tensor(ids, device=self.device)
        kind = kind or ("decode" if all(n == 1 and p > 0 for p, n in zip(prefix, ext)) else "extend")
        req_slots = torch.tensor(slots)
        fb = HostBatch(Mode(kind == "decode"), rids, req_slots, req_slots.to(self.device),
                       torch.tensor([p + n for p, n in zip(prefix, ext)]), prefix, ext,
                       torch.tensor(new_all, device=self.device))
        return fb, input_ids

    @torch.no_grad()
    def run(self, batch: list[tuple[Req, int]], infos: list[RequestInfo] | None = None, flags=None,
            snapshots=None) -> StepOutput:
        """One served forward of ``batch`` through the runtime's step; infos: the scheduler's facts
        per request (as the ``init_new`` hook notes them; default: a final chunk)."""
        if flags is not None:
            self.rt.flags = flags
        self.rt.snapshots = snapshots
        fb, input_ids = self.prepare(batch)
        if not fb.forward_mode.is_decode():  # NOTE: as the init_new hook: facts for prefill chunks only
            for (req, _), p, info in zip(batch, fb.extend_prefix_lens_cpu, infos or [RequestInfo()] * len(batch)):
                self.rt.note_request(req.slot, p, req.rid, info)
        return self.rt.forward(input_ids, fb)

    def last_logits(self, out: StepOutput, batch: list[tuple[Req, int]]) -> torch.Tensor:
        """Each request's last scheduled row's logits, (B, V) f32."""
        last = torch.tensor([n for _, n in batch]).cumsum(0) - 1
        return self.model.lm_head(out.hidden[last.to(self.device)]).float()
