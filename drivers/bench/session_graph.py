"""Closed-loop replay of request graphs: agent sessions recorded as token ids, or traces.

A workload is a list of :class:`GraphRequest` in send order. Requests are grouped into *units*
(one agent session with its branches and subagents, or one independent trace request); a
closed-loop user runs one unit at a time, and ``concurrency`` users run at once. Inside a unit a
request is sent once every request in its ``deps`` is answered and its think time has passed, so
parallel branches run in parallel and a subagent's join holds the parent's next turn.

A prompt is ``full(base)[:base_len] + tail``, where ``full(j)`` is request j's prompt followed by
the output the server generated for it *in this replay*: a next turn extends the model's actual
output, as an agent's does, so a mode that changes the numerics (exact replay, narrowing off)
still gets a workload of identical shape (outputs have fixed lengths: ``ignore_eos``) whose turns
continue exactly what the server holds. A unit's root prompts start with a per-unit marker
(one page), so units (and replays of the same recorded session) never share cache by accident,
as AgentX does; a trace of independent requests (Mooncake) replays without markers.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .common import stream_chunks
from .traces import TokenMap


@dataclass(frozen=True)
class GraphRequest:
    unit: int
    tail: tuple[int, ...]  # prompt ids after the base's
    output_len: int  # tokens generated (ignore_eos); 0 = a prefill (a fork's shared prefix)
    base: int | None = None  # an earlier request of the unit whose prompt + output this prompt extends
    base_len: int = 0  # tokens of full(base) taken
    deps: tuple[int, ...] = ()  # earlier requests of the unit answered before this one is sent
    think_s: float = 0.0  # after the last dep is answered (tool time)
    label: str = ""


@dataclass
class Answered:
    """One request as the replay sent it and the server answered it (times: perf_counter s)."""

    index: int
    unit: int
    prompt: list[int]
    output: list[int]
    sent_s: float
    first_s: float
    done_s: float
    cached: int
    replayed: int
    restored: int

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s


def check_graph(reqs: list[GraphRequest]) -> None:
    """Raise ValueError unless every base / dep names an earlier request of the same unit and
    every base_len fits the base's prompt + output."""
    plen: list[int] = []
    for i, r in enumerate(reqs):
        refs = ([r.base] if r.base is not None else []) + list(r.deps)
        for j in refs:
            if not 0 <= j < i or reqs[j].unit != r.unit:
                raise ValueError(f"request {i}: base/dep {j} is not an earlier request of unit {r.unit}")
        if r.base is None and r.base_len:
            raise ValueError(f"request {i}: base_len {r.base_len} without a base")
        if r.base is not None and not 0 < r.base_len <= plen[r.base] + reqs[r.base].output_len:
            raise ValueError(f"request {i}: base_len {r.base_len} outside its base's {plen[r.base]} + "
                             f"{reqs[r.base].output_len} tokens")
        if r.output_len < 0 or not r.tail and r.base is None:
            raise ValueError(f"request {i}: an empty prompt or a negative output length")
        plen.append(r.base_len + len(r.tail))


def prompt_lengths(reqs: list[GraphRequest]) -> list[int]:
    return [r.base_len + len(r.tail) for r in reqs]


def save_graph(reqs: list[GraphRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def load_graph(path: Path) -> list[GraphRequest]:
    reqs = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            reqs.append(GraphRequest(**{**row, "tail": tuple(row["tail"]), "deps": tuple(row["deps"])}))
    check_graph(reqs)
    return reqs


def replicate(reqs: list[GraphRequest], copies: int, seed: int = 0) -> list[GraphRequest]:
    """``copies`` replays of every unit (renumbered: copy c of unit u is unit c * U + u), units in
    a seeded shuffled order, so a closed-loop user draws a mix of agents."""
    units = sorted({r.unit for r in reqs})
    order = [(c, u) for c in range(copies) for u in units]
    random.Random(seed).shuffle(order)
    out: list[GraphRequest] = []
    for c, u in order:
        idx = [i for i, r in enumerate(reqs) if r.unit == u]
        new = {old: len(out) + k for k, old in enumerate(idx)}
        for old in idx:
            r = reqs[old]
            out.append(GraphRequest(c * len(units) + units.index(u), r.tail, r.output_len,
                                    None if r.base is None else new[r.base], r.base_len,
                                    tuple(new[d] for d in r.deps), r.think_s, r.label))
    return out


def markers(reqs: list[GraphRequest], length: int, vocab_size: int, seed: int) -> dict[int, list[int]]:
    """A ``length``-token marker per unit, drawn from (seed, unit) as a trace session's is."""
    tokens = TokenMap(vocab_size, marker_tokens=length, seed=seed)
    return {u: tokens.marker(f"unit {u}") for u in sorted({r.unit for r in reqs})}


def replay_graph(url: str, reqs: list[GraphRequest], concurrency: int, unit_markers: dict[int, list[int]] | None = None,
                 think_cap_s: float = 1.0, api_key: str | None = None,
                 on_answer: Callable[[Answered], None] | None = None) -> tuple[list[Answered], float]:
    """Run the workload closed-loop; (every request answered, in index order; wall seconds)."""
    from cedar.backend.serving.process import ServerClient

    check_graph(reqs)
    client = ServerClient(url, api_key)
    units: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        units.setdefault(r.unit, []).append(i)
    queue = list(units.values())
    prompt_len = prompt_lengths(reqs)
    answered: dict[int, Answered] = {}
    done = {i: threading.Event() for i in range(len(reqs))}
    lock, errors = threading.Lock(), []

    def send(i: int) -> None:
        r = reqs[i]
        for d in r.deps:
            done[d].wait()
        if errors:
            return done[i].set()
        try:
            time.sleep(min(r.think_s, think_cap_s))
            if r.base is None:
                prompt = (unit_markers or {}).get(r.unit, []) + list(r.tail)
            else:
                b = answered[r.base]
                prompt = (b.prompt + b.output)[:r.base_len + len(b.prompt) - prompt_len[r.base]] + list(r.tail)
            body = json.dumps({"input_ids": prompt, "stream": True, "sampling_params": {
                "max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True}}).encode()
            t0, first, last = time.perf_counter(), None, None
            for t, last in stream_chunks(client.host, client.port, body, headers=client.headers()):
                first = t if first is None else first
            meta = last["meta_info"]
            a = Answered(i, r.unit, prompt, list(last.get("output_ids") or []), t0, first, time.perf_counter(),
                         int(meta["cached_tokens"]), int(meta.get("replayed_tokens") or 0),
                         int(meta.get("restored_tokens") or 0))
            if len(a.output) != r.output_len:
                raise RuntimeError(f"request {i}: {len(a.output)} output tokens, asked for {r.output_len}")
            with lock:
                answered[i] = a
            if on_answer is not None:
                on_answer(a)
        except Exception as e:  # noqa: BLE001 - reported after the join
            errors.append(f"request {i}: {e}")
        finally:
            done[i].set()

    def user() -> None:
        while not errors:
            with lock:
                if not queue:
                    return
                unit = queue.pop(0)
            threads = [threading.Thread(target=send, args=(i,)) for i in unit]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    t0 = time.perf_counter()
    users = [threading.Thread(target=user) for _ in range(concurrency)]
    for t in users:
        t.start()
    for t in users:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]}")
    return [answered[i] for i in range(len(reqs))], wall


@dataclass(frozen=True)
class Logged:
    """One request of a recorded session: the ids sent and received, and when."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    sent_s: float
    done_s: float
    label: str = ""


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def graph_from_log(sessions: list[list[Logged]]) -> list[GraphRequest]:
    """Recorded sessions (each a list in send order) as a workload: a request's base is the
    earlier answered request whose prompt + output shares the longest prefix with its prompt, its
    deps every request answered before it was sent, its think time the gap after the last one."""
    out: list[GraphRequest] = []
    for unit, log in enumerate(sessions):
        first = len(out)
        start = min((r.sent_s for r in log), default=0.0)
        for k, r in enumerate(log):
            before = [j for j in range(k) if log[j].done_s <= r.sent_s]
            best, best_len = None, 0
            for j in before:
                n = _common_prefix(r.prompt, log[j].prompt + log[j].output)
                if n > best_len:
                    best, best_len = j, n
            last_done = max((log[j].done_s for j in before), default=start)
            out.append(GraphRequest(unit, tuple(r.prompt[best_len:]), len(r.output),
                                    None if best is None else first + best, best_len,
                                    tuple(first + j for j in before), round(max(0.0, r.sent_s - last_done), 4), r.label))
    check_graph(out)
    return out
