"""Property-based tests of the served bookkeeping (hypothesis): random schedules of new requests
(cold, or hits of every length around W and the page size on finished requests, multi-turn
continuations), chunked prefills, mixed batches, decode steps, aborts, finishes with snapshot
saves under a budget of two, evictions that put token pages back for reuse, run through the
planner, PoolKeys and the pools (tests/serving_harness.py stands in for SGLang's tables).

After every step: Cedar's slot and snapshot invariants hold (``slot_integrity``, with every
running request owning its slot), and every logit row a request gets equals a simple model of
what it must see: the reference model's own cache for that request alone (cold; bounded replay
on the donor's global rows; or the donor's exact state where a snapshot was restored). A
request that read another's window state would get other logits.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cedar.backend.cache import SequenceCache, cache_for_hit, new_cache
from cedar.backend.geometries import cedar_tiny
from cedar.backend.key_source import ExtendPlan
from cedar.backend.model_io import random_model
from cedar.backend.replay import decode
from cedar.backend.serving.integrity import slot_integrity
from cedar.backend.serving.planner import RequestInfo
from cedar.backend.serving.prefix_digest import prefix_digest
from cedar.backend.serving.snapshots import SnapshotStore
from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet
from serving_harness import Harness, Req

CFG = cedar_tiny()
W, P = CFG.sliding_window, CFG.page_size
ATOL = 2e-3  # as in test_serving_bookkeeping.py
NUM_REQ_SLOTS, NUM_PAGES, MAX_LEN = 3, 1500, 2400


@pytest.fixture(scope="module")
def model():
    """The fast CPU backend where it builds (what serves), else the twins."""
    backend = "fast" if cpu_ext.available() else "torch"
    return random_model(CFG, seed=5).eval().use_kernels(KernelSet(backend))


class PagedHarness(Harness):
    """Token pages come from a free list and go back to it on eviction (so slots are reused)."""

    def __init__(self, model):
        super().__init__(model, num_slots=NUM_PAGES * P, num_reqs=NUM_REQ_SLOTS, max_len=MAX_LEN)
        self.free_pages = list(range(1, NUM_PAGES))  # page 0 is SGLang's padding page
        self.refs: dict[int, int] = {}  # page -> holders (running or cached requests)

    def alloc(self, req, n):
        out, last = [], req.token_slots[-1] if req.token_slots else None
        for p in range(len(req.token_slots), len(req.token_slots) + n):
            if p % P == 0:
                page = self.free_pages.pop(0)
                self.refs[page] = 1
                last = page * P
            else:
                last += 1
            out.append(last)
        return out

    def hold(self, token_slots):
        for page in {s // P for s in token_slots}:
            self.refs[page] += 1

    def drop(self, token_slots):
        for page in {s // P for s in token_slots}:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                self.free_pages.append(page)


@dataclass
class Running:
    req: Req
    prompt_len: int
    hit: int
    donor: "Cached | None"
    cache: SequenceCache | None = None  # the reference's own cache for this request
    floor: int = 0
    start: int = 0  # the first row the reference runs (the replay start, or the hit on a restore)
    decoded: int = 0


@dataclass
class Cached:
    rid: str
    ids: list[int]  # every token, the last (unfed) output included
    token_slots: list[int]  # fed tokens' slots (what the tree keeps)
    cache: SequenceCache


def truncated(cache: SequenceCache, hit: int) -> SequenceCache:
    """The reference's view of a snapshot restored at ``hit``: the finished state below it."""
    out = copy.deepcopy(cache)
    for s, store in out.sources.items():
        out.sources[s] = store.truncated(hit // store.ratio)
    for ring in out.rings.values():
        ring.pos[ring.pos >= hit] = -1
    out.seq_len = hit
    return out


class Sim:
    def __init__(self, model, data):
        self.model, self.data = model, data
        self.h = PagedHarness(model)
        self.store = SnapshotStore(2 * self.h.slots.bytes_per_slot)
        self.running: dict[str, Running] = {}
        self.cached: list[Cached] = []
        self.n = 0
        self.seen = {"restored": 0, "replayed": 0, "cold": 0}
        self.log: list[str] = []  # what happened, for the failure message

    def draw(self, strategy):
        return self.data.draw(strategy)

    def tokens(self, n):
        self.n += 1
        return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(1000 + self.n)).tolist()

    # ------------------------------------------------------------------ operations
    def op_new(self):
        used = {r.req.slot for r in self.running.values()}
        slot = min(set(range(NUM_REQ_SLOTS)) - used)
        donors = [c for c in self.cached if len(c.token_slots) >= P]
        donor = self.draw(st.sampled_from([None, *donors, *donors]))
        rid = f"r{self.n}"
        if donor is None:
            n = self.draw(st.one_of(st.sampled_from([W + P + 1, 2 * W + 3, 300, W - 1, P + 1]), st.integers(1, 300)))
            req, hit = Req(rid, slot, self.tokens(n)), 0
        else:
            fed = len(donor.token_slots)
            end = fed - fed % P
            hits = sorted({h for h in (P, W - P, W, W + P, 2 * W, end - 2 * P, end - P, end) if 0 < h <= end})
            hit = self.draw(st.sampled_from(hits))
            turn = hit >= end - P and len(donor.ids) < MAX_LEN - 400 and self.draw(st.booleans())  # next turn
            prefix = donor.ids if turn else donor.ids[:hit]
            req = Req(rid, slot, prefix + self.tokens(self.draw(st.integers(1, 160))))
            req.token_slots = donor.token_slots[:hit]
            self.h.hold(req.token_slots)
        self.running[rid] = Running(req, len(req.ids), hit, donor)
        self.log.append(f"new {rid} slot {slot} prompt {len(req.ids)} hit {hit} on {donor and donor.rid}")

    def _first_forward(self, r: Running) -> int:
        """The reference cache for r as its first forward finds the pools, and its first row."""
        req, hit = r.req, r.hit
        if r.donor is None:
            r.cache, start = new_cache(CFG, True), 0
            self.seen["cold"] += 1
        else:
            s = torch.tensor(req.token_slots[:hit])
            donor_rid = self.store.donor(hit, prefix_digest(s, self.h.pools.token_ids[s]))
            if donor_rid is not None:  # the planner will restore this snapshot
                finished = next(c for c in self.cached if c.rid == donor_rid)
                r.cache, start = truncated(finished.cache, hit), hit
                r.floor = r.cache.window_floor
                self.seen["restored"] += 1
                return start
            r.cache, start = cache_for_hit(r.donor.cache, CFG, hit, True), hit - min(W, hit)
            self.seen["replayed"] += 1
        r.floor = start
        return start

    def op_prefill(self):
        todo = [r for r in self.running.values() if len(r.req.token_slots) < r.prompt_len]
        batch = self.draw(st.lists(st.sampled_from(todo), min_size=1, max_size=len(todo), unique_by=lambda r: r.req.rid))
        rows, infos, expect = [], [], {}
        for r in batch:
            done = len(r.req.token_slots)
            n = self.draw(st.integers(1, r.prompt_len - done))
            end = done + n if done + n == r.prompt_len else (done + n) // P * P  # SGLang's page-aligned chunks
            if end <= done:
                end = r.prompt_len
            final = end == r.prompt_len
            if r.cache is None:
                r.start = self._first_forward(r)
            expect[r.req.rid] = None
            if final:  # NOTE: served chunks equal one unchunked prefill (test_serving_bookkeeping)
                plan = ExtendPlan(window_floor=r.floor, write_floor=r.hit, narrow=True)
                res = self.model.extend(r.cache, torch.tensor(r.req.ids[r.start:end]), r.start, plan)
                expect[r.req.rid] = res.logits[-1]
            rows.append((r.req, end - done))
            infos.append(RequestInfo(final_chunk=final))
            self.log.append(f"  prefill {r.req.rid} rows [{done}, {end}) final {final}")
        self.log.append("prefill step")
        out, _ = self.h.step(rows, infos, snapshots=self.store)
        for r in batch:
            want = expect[r.req.rid]
            if want is None:
                assert r.req.rid not in out, "a non-final chunk ran the decoder"
            else:
                self._check_and_feed(r, out[r.req.rid][-1], want)

    def op_decode(self):
        todo = [r for r in self.running.values() if len(r.req.token_slots) >= r.prompt_len and r.decoded < 6]
        batch = self.draw(st.lists(st.sampled_from(todo), min_size=1, max_size=len(todo), unique_by=lambda r: r.req.rid))
        expect = {r.req.rid: decode(self.model, r.cache, r.req.ids[-1]) for r in batch}
        out, _ = self.h.step([(r.req, 1) for r in batch], snapshots=self.store)
        self.log.append(f"decode {[r.req.rid for r in batch]}")
        for r in batch:
            r.decoded += 1
            self._check_and_feed(r, out[r.req.rid][-1], expect[r.req.rid])

    def _check_and_feed(self, r: Running, served, want):
        diff = (served - want).abs().max().item()
        assert diff <= ATOL, f"{r.req.rid}: logits differ by {diff} from the request's own reference"
        r.req.ids.append(int(served.argmax()))

    def op_finish(self):
        r = self.running.pop(self.draw(st.sampled_from(
            [rid for rid, r in self.running.items() if len(r.req.token_slots) >= r.prompt_len])))
        slot = r.req.slot
        if self.h.slots.owners[slot].rid == r.req.rid:  # what the release hook does
            self.store.save(self.h.slots, slot, self.h.slots.owners[slot].hasher)
        self.cached.append(Cached(r.req.rid, list(r.req.ids), list(r.req.token_slots), r.cache))
        self.log.append(f"finish {r.req.rid} ({len(self.store)} snapshots)")

    def op_abort(self):
        r = self.running.pop(self.draw(st.sampled_from(sorted(self.running))))
        self.h.drop(r.req.token_slots)
        self.log.append(f"abort {r.req.rid}")

    def op_evict(self):
        c = self.cached.pop(self.draw(st.integers(0, len(self.cached) - 1)))
        self.h.drop(c.token_slots)
        self.log.append(f"evict {c.rid}")

    def ops(self):
        """The operations possible now, weighted so that sessions run to their end and hit."""
        out, done = [], [r for r in self.running.values() if len(r.req.token_slots) >= r.prompt_len]
        pending = sum((r.prompt_len + 8 - len(r.req.token_slots)) // P + 1 for r in self.running.values())
        if len(self.running) < NUM_REQ_SLOTS and len(self.h.free_pages) - pending > 250:
            out += [self.op_new] * 2
        if len(done) < len(self.running):
            out += [self.op_prefill] * 3
        if any(r.decoded < 6 for r in done):
            out += [self.op_decode] * 2
        if done:
            out += [self.op_finish] * 2
        if self.running:
            out.append(self.op_abort)
        if len(self.cached) > 2:
            out.append(self.op_evict)
        return out

    def check(self):
        started = {r.req.slot: r.req.rid for r in self.running.values() if r.cache is not None}
        bad = slot_integrity(self.h.slots, self.store, running=started)
        assert not bad, bad


# NOTE: no shrinking (minutes here); a failure names every operation that led to it.
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_random_schedules_keep_every_request_on_its_own_state(model, data):
    sim = Sim(model, data)
    for _ in range(data.draw(st.integers(4, 40), label="steps")):
        ops = sim.ops()
        if not ops:
            break
        op = data.draw(st.sampled_from(ops), label="op")
        try:
            op()
            sim.check()
        except AssertionError as e:
            raise AssertionError(f"{e}\nafter:\n" + "\n".join(sim.log)) from None
