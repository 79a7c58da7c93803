"""Trace replay: blocks map to tokens deterministically (equal hash, equal tokens; sessions never
share by accident), the theoretical hit rate is an infinite cache's, and through the real server
at concurrency 1 every request's measured hit equals it."""

import json
import urllib.request

import pytest

from cedar.drivers.bench.trace_replay import graph_from_trace, replay_trace
from cedar.drivers.bench.traces import TokenMap, TraceRequest, load_trace, theoretical_hits

MOONCAKE = "/work/shared/data/mooncake_fast25/conversation_trace.jsonl"


def test_blocks_map_to_tokens_deterministically():
    tm = TokenMap(vocab_size=512, tokens_per_block=4)
    a = TraceRequest(1200, 10, (5, 6, 7), 512)
    b = TraceRequest(1100, 10, (5, 6, 8), 512)
    pa, pb = tm.prompt(a), tm.prompt(b)
    assert pa[:8] == pb[:8] and pa != pb  # two shared blocks, then different ones
    assert len(pa) == 4 + 4 + round(176 / 512 * 4) and tm.prompt(a) == pa
    s1, s2 = (TraceRequest(1024, 10, (5, 6), 512, session=s) for s in ("x", "y"))
    assert tm.prompt(s1)[2:] == tm.prompt(s2)[2:] and tm.prompt(s1)[:2] != tm.prompt(s2)[:2]
    assert all(8 <= t < 512 for t in pa)


def test_theoretical_hits_are_an_infinite_caches():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5], [7, 7], [1, 2, 8]]
    assert theoretical_hits(prompts, page_size=2) == [0, 4, 4, 0, 2]  # a repeat matches len - 1


def test_mooncake_trace_loads_and_subagents_join_their_root(tmp_path):
    trace = load_trace(MOONCAKE, limit=50)
    assert len(trace) == 50 and trace[0].block_size == 512 and trace[0].hash_ids[0] == 0
    tm = TokenMap(vocab_size=512)
    graph = graph_from_trace(trace, tm)
    assert [(g.unit, g.deps, g.base) for g in graph] == [(i, (), None) for i in range(50)]
    assert list(graph[7].tail) == tm.prompt(trace[7]) and graph[7].output_len == tm.output_len(trace[7])
    rows = [{"session": "a", "input_length": 600, "output_length": 9, "hash_ids": [1, 2]},
            {"session": "a.sub", "parent": "a", "input_length": 512, "output_length": 9, "hash_ids": [3]},
            {"session": "b", "input_length": 512, "output_length": 9, "hash_ids": [4]},
            {"session": "a", "input_length": 1100, "output_length": 9, "hash_ids": [1, 2, 5]}]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    graph = graph_from_trace(load_trace(path), tm)
    # the subagent follows the parent's request before it; the parent's next one waits for it
    assert [(g.unit, g.deps) for g in graph] == [(0, ()), (0, (0,)), (1, ()), (0, (0, 1))]
    path.write_text(json.dumps({"session": "a", "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="input_length"):
        load_trace(path)


def _session_trace(path):
    """Three multi-turn sessions (each turn's prompt extends the last), one with a subagent."""
    rows, h = [], 100
    for s in range(3):
        blocks = []
        for turn in range(3):
            blocks = blocks + [h, h + 1]
            h += 2
            rows.append({"session": f"s{s}", "input_length": 512 * len(blocks) - 100, "output_length": 40,
                         "hash_ids": list(blocks), "block_size": 512, "think_s": 0.01})
            if s == 1 and turn == 0:
                rows.append({"session": "s1.sub", "parent": "s1", "input_length": 1024, "output_length": 20,
                             "hash_ids": [blocks[0], 999], "block_size": 512})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mooncake", "sessions"])
def test_measured_hit_rate_equals_the_theoretical_one(server, tmp_path, which):
    """One request at a time through a pool that holds them all: every request's hit is an
    infinite cache's (the first 80 Mooncake requests; a session trace with a subagent)."""
    with urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", data=b""), timeout=60) as r:
        assert r.status == 200  # a text answer
    trace = load_trace(MOONCAKE, limit=80) if which == "mooncake" else load_trace(_session_trace(tmp_path / "s.jsonl"))
    r = replay_trace(server.url, trace, TokenMap(vocab_size=512), page_size=2, concurrency=1)
    assert r["theoretical_hit_rate"] > (0.03 if which == "mooncake" else 0.4), r
    assert r["requests_off_theory"] == 0 and r["measured_hit_rate"] == r["theoretical_hit_rate"], r
