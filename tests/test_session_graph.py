"""The agent-load benchmark's bookkeeping: recorded sessions become request graphs (bases, deps,
tails), copies keep their structure, the theoretical hit rate is an infinite cache's at each send,
throughput at a floor is read off the curve, and the AgentX-shaped trace has AgentX's shape."""

import json

import pytest

from cedar.drivers.bench.agentx_like import AgentShape, agentx_like_rows, write_agentx_like
from cedar.drivers.bench.load_metrics import run_metrics, theoretical_hits, throughput_at_floor
from cedar.drivers.bench.session_graph import (Answered, GraphRequest, Logged, check_graph, graph_from_log,
                                               load_graph, markers, prompt_lengths, replicate, save_graph)
from cedar.drivers.bench.trace_replay import graph_from_trace
from cedar.drivers.bench.traces import TokenMap, load_trace


def _fork_session():
    """A system prompt turn, a fork prefill, two branches sent together, a join turn that extends
    the first turn's prompt + output."""
    sys_ = tuple(range(100, 140))
    t0 = Logged(sys_ + (1, 2), (50, 51, 52), 0.0, 1.0, "main")
    fork = Logged(sys_ + (1, 2, 50, 51, 52, 9, 9), (), 1.1, 1.2, "fork")
    a = Logged(fork.prompt + (3, 3), (60, 61), 1.3, 2.0, "a")
    b = Logged(fork.prompt + (4, 4), (70,), 1.3, 1.9, "b")
    join = Logged(t0.prompt + t0.output[:2] + (8, 8, 8), (80, 81), 2.5, 3.0, "join")
    return [t0, fork, a, b, join]


def test_recorded_sessions_become_a_graph_of_bases_deps_and_tails():
    log = _fork_session()
    g = graph_from_log([log, log[:1]])
    assert [r.unit for r in g] == [0] * 5 + [1]
    t0, fork, a, b, join, other = g
    assert (t0.base, t0.tail, t0.deps) == (None, log[0].prompt, ())
    assert (fork.base, fork.base_len, fork.tail) == (0, len(log[0].prompt) + 3, (9, 9))  # extends t0's output
    assert (a.base, a.base_len, a.tail, a.deps) == (1, len(log[1].prompt), (3, 3), (0, 1))
    assert b.deps == (0, 1)  # sent beside a: neither waits for the other
    # the join's longest shared prefix is with t0's prompt + 2 of its output tokens (the fork's
    # prompt diverges after t0's output), and it waits for everything answered before it
    assert (join.base, join.base_len, join.deps) == (0, len(log[0].prompt) + 2, (0, 1, 2, 3))
    assert join.think_s == pytest.approx(0.5)  # after b ... a answered at 2.0, sent at 2.5
    assert (other.unit, other.base, other.deps) == (1, None, ())  # units never reference each other
    assert prompt_lengths(g) == [len(x.prompt) for x in log] + [len(log[0].prompt)]
    assert [r.output_len for r in g[:5]] == [3, 0, 2, 1, 2]


def test_graph_checks_refuse_what_cannot_be_replayed(tmp_path):
    ok = [GraphRequest(0, (9, 9), 2), GraphRequest(0, (8,), 1, base=0, base_len=4, deps=(0,))]
    check_graph(ok)
    save_graph(ok, tmp_path / "g.jsonl")
    assert load_graph(tmp_path / "g.jsonl") == ok
    for bad, msg in (([GraphRequest(0, (9,), 1, base=0, base_len=1)], "not an earlier"),
                     ([ok[0], GraphRequest(1, (8,), 1, base=0, base_len=1)], "not an earlier"),
                     ([ok[0], GraphRequest(0, (8,), 1, base=0, base_len=5)], "outside"),
                     ([GraphRequest(0, (), 1)], "empty prompt"),
                     ([GraphRequest(0, (9,), 1, base_len=3)], "without a base")):
        with pytest.raises(ValueError, match=msg):
            check_graph(bad)


def test_copies_keep_each_units_structure_under_new_numbers():
    g = graph_from_log([_fork_session(), _fork_session()[:2]])
    rep = replicate(g, copies=3, seed=1)
    assert len(rep) == 3 * len(g) and len({r.unit for r in rep}) == 6
    check_graph(rep)
    by_unit: dict[int, list] = {}
    for r in rep:
        by_unit.setdefault(r.unit, []).append(r)
    shapes = sorted(tuple((r.tail, r.base_len, r.output_len) for r in rs) for rs in by_unit.values())
    assert shapes == sorted([tuple((r.tail, r.base_len, r.output_len) for r in g[:5])] * 3
                            + [tuple((r.tail, r.base_len, r.output_len) for r in g[5:])] * 3)
    assert [r.unit for r in rep] != sorted(r.unit for r in rep)  # units come shuffled
    m = markers(rep, 2, 512, seed=7)
    assert len({tuple(v) for v in m.values()}) == 6 and m == markers(rep, 2, 512, seed=7)
    assert m != markers(rep, 2, 512, seed=8)


def _answered(i, prompt, output, sent, done, cached=0):
    return Answered(i, 0, list(prompt), list(output), sent, sent + 0.01, done, cached, 0, 0)


def test_theoretical_hits_hold_what_was_answered_before_each_send():
    a = _answered(0, [1, 2, 3, 4, 5], [6, 7, 8], 0.0, 1.0)
    b = _answered(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [1], 1.5, 2.0)  # extends a's output: its last token uncached
    c = _answered(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], [3], 1.6, 2.5)  # sent while b runs: only a is held
    d = _answered(3, [1, 2, 3, 4, 5, 6, 7, 8, 9], [5], 3.0, 3.5)  # a repeat of b: len - 1, page aligned
    assert theoretical_hits([a, b, c, d], page_size=2) == [0, 6, 6, 8]
    assert theoretical_hits([a, b, c, d], page_size=4) == [0, 4, 4, 8]
    m = run_metrics([a, b, c, d], 2.0, page_size=2)
    assert m["theoretical_hit_rate"] == round(20 / 34, 5) and m["measured_hit_rate"] == 0.0
    assert m["requests_off_theory"] == 3 and m["output_tokens"] == 6 and m["output_tok_s"] == 3.0


def test_interactivity_is_the_p90_of_seconds_per_token_inverted():
    rows = [_answered(i, [1, 2], [5] * 10, 0.0, 1.0 + i) for i in range(10)]  # 0.1 ... 1.0 s/token
    m = run_metrics(rows, 10.0, 2)
    assert m["interactivity_p90"] == pytest.approx(1 / 0.91, abs=1e-3)


def test_throughput_at_a_floor_is_read_off_the_curve():
    pts = [(40.0, 100.0), (20.0, 180.0), (8.0, 250.0), (3.0, 260.0)]  # concurrency 1, 2, 4, 8
    assert throughput_at_floor(pts, 20.0) == 180.0
    assert throughput_at_floor(pts, 10.0) == pytest.approx(180 + 70 * 10 / 12, abs=0.01)  # between C 2 and 4
    assert throughput_at_floor(pts, 2.0) == 260.0
    assert throughput_at_floor(pts, 50.0) == 0.0


def test_agentx_like_trace_has_agentx_shape(tmp_path):
    rows = agentx_like_rows(AgentShape(), seed=0)
    assert rows == agentx_like_rows(AgentShape(), seed=0) and rows != agentx_like_rows(AgentShape(), seed=1)
    roots = {r["session"] for r in rows if r["parent"] is None}
    subs = [r for r in rows if r["parent"] is not None]
    assert len(roots) == 12 and subs and all(r["parent"] in roots for r in subs)
    path = write_agentx_like(tmp_path / "t.jsonl", AgentShape(), seed=0)
    trace = load_trace(path)
    g = graph_from_trace(trace, TokenMap(2048, 8))
    check_graph(g)
    prompts = [list(r.tail) for r in g]
    from cedar.drivers.bench.traces import theoretical_hits as file_order_hits

    rate = sum(file_order_hits(prompts, 2)) / sum(map(len, prompts))
    assert 0.8 < rate < 0.97, rate  # AgentX: 86-97% with an infinite cache
    assert max(map(len, prompts)) < 16384  # fits the shipped model's context
    # a subagent starts from its parent's system prompt under the root's marker
    sub = next(i for i, r in enumerate(trace) if r.parent is not None)
    parent_first = next(i for i, r in enumerate(trace) if r.session == trace[sub].parent)
    assert prompts[sub][:100] == prompts[parent_first][:100]
    assert g[sub].deps == (sub - 1,) and json.loads(path.read_text().splitlines()[0])["block_size"] == 64


def test_replicas_share_the_cores_instead_of_each_taking_all(tmp_path):
    """N replicas on one machine: each server's torch gets cores // N threads (two 2-thread
    servers busy at once on 2 cores ran 25x slower), unless the config names its own count."""
    import os

    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.replicas import Replicas, RouterConfig

    reps = Replicas(ServeConfig(model="m", port=40000), 2, RouterConfig(port=40000), log_dir=tmp_path)
    want = max(1, (os.cpu_count() or 1) // 2)
    assert [s.cfg.threads for s in reps.servers] == [want, want]
    assert all(s.cfg.env()["OMP_NUM_THREADS"] == str(want) for s in reps.servers)
    own = Replicas(ServeConfig(model="m", port=40000, threads=3), 2, RouterConfig(port=40000), log_dir=tmp_path)
    assert [s.cfg.threads for s in own.servers] == [3, 3]
    assert "OMP_NUM_THREADS" not in ServeConfig(model="m").env() or os.environ.get("OMP_NUM_THREADS")
