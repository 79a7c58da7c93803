"""The load a soak puts on a server: multi-turn sessions, chaos (disconnects, aborts), a steady
stream of bad input, and sentinel requests whose greedy answers are checked against the
reference afterwards. Every request is counted in :class:`Counts`; nothing here decides
whether the run passed (see :mod:`cedar.drivers.soak.run`).

Sessions talk token ids to ``/generate`` (the shared system prompt, a per-session marker, then
turns of new "user" tokens and the model's own output, so every turn is a prefix hit and a
finished turn's snapshot can continue the next), with a few OpenAI chat calls with tools in
between. A turn is, at random: plain, streamed, streamed and cut by the client after a few
chunks, or aborted through SGLang's ``/abort_request`` while it runs.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..bench.common import data_chunks, fresh_ids
from cedar.backend.serving.process import ServerClient
from .bad_input import TOOLS, BadRequest, has_message

SYSTEM_SEED = 7_000_000  # the system prompt every session shares
SESSION_SEED = 8_000_000  # per-session markers
SENTINEL_SEED = 9_000_000  # sentinel prompts: their first page is unique (never a chance hit)


@dataclass
class LoadConfig:
    sessions: int = 16
    max_context: int = 2048  # a session starts over past this many tokens
    system_tokens: int = 256
    max_think_s: float = 0.3
    p_stream: float = 0.2
    p_disconnect: float = 0.06
    p_abort: float = 0.06
    p_chat: float = 0.05
    bad_every_s: float = 1.0
    sentinel_every_s: float = 4.0
    sentinel_new_tokens: int = 8
    hang_s: float = 180.0  # a request with no answer within this is hung


@dataclass
class Counts:
    """What happened to every request (thread-safe through ``add``)."""

    sent: int = 0
    finished: int = 0
    aborted: int = 0  # by our abort, answered with finish_reason abort
    disconnected: int = 0  # the client cut the stream on purpose
    rejected: int = 0  # bad input answered 4xx with a message
    hung: int = 0  # no answer within hang_s
    lost: int = 0  # a good request that failed (5xx, connection error, an abort we did not ask for)
    bad_input_failures: list = field(default_factory=list)
    lost_details: list = field(default_factory=list)
    tokens_in: int = 0
    tokens_cached: int = 0
    tokens_replayed: int = 0
    tokens_restored: int = 0
    tokens_out: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                if isinstance(v, list):
                    getattr(self, k).extend(v)
                else:
                    setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        with self._lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class SentinelRecord:
    ids: list[int]
    output_ids: list[int]
    cached_tokens: int
    restored_tokens: int
    donor_ids: list[int] | None = None
    retractions: int = 0  # SGLang's num_retractions: retracted under pool pressure and re-admitted


class Load:
    """Runs the load threads against ``client``'s server until ``stop``; ``gate`` pauses new
    requests (between phases) and ``inflight`` says how many are still out."""

    def __init__(self, client: ServerClient, vocab_size: int, bad: list[BadRequest], cfg: LoadConfig,
                 seed: int = 0) -> None:
        self.host, self.port, self.vocab, self.bad, self.cfg = client.host, client.port, vocab_size, bad, cfg
        self.headers = client.headers()
        self.seed = seed
        self.counts = Counts()
        self.sentinels: list[SentinelRecord] = []
        self.stop, self.gate = threading.Event(), threading.Event()
        self._inflight, self._cv = 0, threading.Condition()
        self._threads: list[threading.Thread] = []
        self.system = fresh_ids(SYSTEM_SEED + seed, cfg.system_tokens, vocab_size)
        self._sessions = itertools.count(1)  # NOTE: next() on a count is atomic: one marker each

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.gate.set()
        targets = [self._session] * self.cfg.sessions + [self._bad_input, self._sentinel]
        for i, fn in enumerate(targets):
            t = threading.Thread(target=fn, args=(random.Random(self.seed * 1000 + i),), daemon=True)
            t.start()
            self._threads.append(t)

    def pause(self, timeout_s: float) -> bool:
        """Stop sending; wait until nothing is in flight (False if something still is)."""
        self.gate.clear()
        with self._cv:
            return self._cv.wait_for(lambda: self._inflight == 0, timeout=timeout_s)

    def resume(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.stop.set()
        self.gate.set()
        for t in self._threads:
            t.join(timeout=self.cfg.hang_s + 10)

    def _admit(self) -> bool:
        """Wait for the gate, then count one request in flight (False: the run is over)."""
        while not self.gate.wait(0.5):
            if self.stop.is_set():
                return False
        if self.stop.is_set():
            return False
        with self._cv:
            self._inflight += 1
        return True

    def _done(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ HTTP
    def _post(self, path: str, body, stream_chunks: int | None = None) -> tuple[int, object]:
        """POST; (status, parsed body). stream_chunks: read the streamed answer (all of it when
        0, else cut the connection after that many chunks: returns status -1)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.cfg.hang_s)
        try:
            conn.request("POST", path, data, self.headers)
            resp = conn.getresponse()
            if stream_chunks is None or resp.status != 200:
                raw = resp.read().decode(errors="replace")
                try:
                    return resp.status, json.loads(raw)
                except json.JSONDecodeError:
                    return resp.status, {"raw": raw}
            last = None
            for n, last in enumerate(data_chunks(resp), 1):
                if stream_chunks and n >= stream_chunks:
                    return -1, last
            return 200, last
        finally:
            conn.close()

    def _send(self, what: str, path: str, body, chunks: int | None = None, bad: bool = False):
        """Count one request sent and POST it: (status, answer), or None when it hung or the
        connection failed (counted against ``what``; a bad input's failure as such)."""
        self.counts.add(sent=1)
        try:
            return self._post(path, body, chunks)
        except socket.timeout:
            self._fail(what, "hung", bad, hung=True)
        except (OSError, http.client.HTTPException) as e:
            self._fail(what, f"{type(e).__name__}: {e}", bad)
        return None

    def _fail(self, what: str, why: str, bad: bool = False, hung: bool = False) -> None:
        if bad:
            self.counts.add(hung=int(hung), bad_input_failures=[{"name": what, "status": why}])
        else:
            self.counts.add(hung=int(hung), lost=int(not hung), lost_details=[f"{what}: {why}"])

    def _generate(self, ids: list[int], max_new: int, *, mode: str = "plain", rid: str | None = None,
                  ignore_eos: bool = False, cut_after: int = 1) -> dict | None:
        """One good /generate, counted. Returns its final answer (None if cut, aborted or lost).
        mode: plain | stream | disconnect (cut after ``cut_after`` chunks) | abort."""
        body = {"input_ids": ids, "rid": rid or uuid.uuid4().hex,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": ignore_eos}}
        chunks = None
        if mode in ("stream", "disconnect"):
            body["stream"] = True
            chunks = 0 if mode == "stream" else cut_after
        answer = self._send(f"{mode} request of {len(ids)} tokens", "/generate", body, chunks)
        if answer is None:
            return None
        status, out = answer
        if status == -1:
            self.counts.add(disconnected=1)
            return None
        if status != 200 or out is None:
            self._fail(mode, f"HTTP {status}: {str(out)[:200]}")
            return None
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") == "abort":
            if mode == "abort":
                self.counts.add(aborted=1)
            else:
                self._fail(mode, f"aborted by the server: {finish}")
            return None
        meta = out["meta_info"]
        self.counts.add(finished=1, tokens_in=len(ids), tokens_cached=int(meta.get("cached_tokens") or 0),
                        tokens_replayed=int(meta.get("replayed_tokens") or 0),
                        tokens_restored=int(meta.get("restored_tokens") or 0), tokens_out=len(out["output_ids"]))
        return out

    # ------------------------------------------------------------------ threads
    def _session(self, rng: random.Random) -> None:
        ctx: list[int] = []
        while not self.stop.is_set():
            if not ctx or len(ctx) > self.cfg.max_context - 400:
                marker = fresh_ids(SESSION_SEED + self.seed * 100_000 + next(self._sessions), 8, self.vocab)
                ctx = self.system + marker
            new = [rng.randrange(16, self.vocab - 64) for _ in range(rng.randint(16, 240))]
            if not self._admit():
                return
            try:
                roll = rng.random()
                c = self.cfg
                if roll < c.p_chat:
                    self._chat(rng)
                    continue
                mode = ("disconnect" if roll < c.p_chat + c.p_disconnect else
                        "abort" if roll < c.p_chat + c.p_disconnect + c.p_abort else
                        "stream" if roll < c.p_chat + c.p_disconnect + c.p_abort + c.p_stream else "plain")
                out = self._turn(ctx + new, rng.randint(8, 48), mode, rng)
                ctx = ctx + new + (out["output_ids"] if out is not None else [])
            finally:
                self._done()
            time.sleep(rng.random() * self.cfg.max_think_s)

    def _turn(self, ids: list[int], max_new: int, mode: str, rng: random.Random) -> dict | None:
        if mode != "abort":
            return self._generate(ids, max_new, mode=mode, cut_after=rng.randint(1, 3))
        rid = uuid.uuid4().hex
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(out=self._generate(ids, max_new, mode="abort", rid=rid)))
        worker.start()
        time.sleep(rng.uniform(0.02, 0.5))
        try:
            self._post("/abort_request", {"rid": rid})
        except (OSError, http.client.HTTPException) as e:
            self.counts.add(lost=1, lost_details=[f"abort_request: {e}"])
        worker.join()
        return result.get("out")

    def _chat(self, rng: random.Random) -> None:
        choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "read_file"}}])
        body = {"model": "cedar", "max_tokens": 48, "temperature": 0, "tools": TOOLS, "tool_choice": choice,
                "messages": [{"role": "user", "content": f"Read the file notes/{rng.randrange(1000)}.txt"}]}
        answer = self._send("chat", "/v1/chat/completions", body)
        if answer is None:
            return
        status, out = answer
        if status == 200 and out.get("choices"):
            self.counts.add(finished=1)
        else:
            self._fail("chat", f"HTTP {status}: {str(out)[:200]}")

    def _bad_input(self, rng: random.Random) -> None:
        i = 0
        while not self.stop.is_set():
            bad = self.bad[i % len(self.bad)]
            i += 1
            if not self._admit():
                return
            try:
                answer = self._send(bad.name, bad.path, bad.body, bad=True)
                if answer is None:
                    continue
                status, out = answer
                if 400 <= status < 500 and has_message(out):
                    self.counts.add(rejected=1)
                else:
                    self._fail(bad.name, f"HTTP {status}: {str(out)[:200]}", bad=True)
            finally:
                self._done()
            time.sleep(self.cfg.bad_every_s * rng.uniform(0.5, 1.5))

    def _sentinel(self, rng: random.Random) -> None:
        k, n = 0, self.cfg.sentinel_new_tokens
        while not self.stop.is_set():
            time.sleep(self.cfg.sentinel_every_s * rng.uniform(0.5, 1.5))
            k += 1
            donor = fresh_ids(SENTINEL_SEED + self.seed * 100_000 + k, rng.randint(300, 800), self.vocab)
            if not self._admit():
                return
            try:
                out = self._generate(donor, n, ignore_eos=True)
                if out is None:
                    continue
                self._record(donor, out)
                if k % 2:  # every other sentinel plants a prefix and hits it
                    hit = rng.randrange(132, len(donor) - 16) // 2 * 2  # away from its snapshot's boundaries
                    ids = donor[:hit] + [rng.randrange(16, self.vocab - 64) for _ in range(rng.randint(16, 64))]
                    out = self._generate(ids, n, ignore_eos=True)
                    if out is not None:
                        self._record(ids, out, donor)
            finally:
                self._done()

    def _record(self, ids, out, donor=None) -> None:
        meta = out["meta_info"]
        self.sentinels.append(SentinelRecord(ids, list(out["output_ids"]), int(meta.get("cached_tokens") or 0),
                                             int(meta.get("restored_tokens") or 0), donor,
                                             int(meta.get("num_retractions") or 0)))
