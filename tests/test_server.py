"""The CED model served by SGLang's real runtime (HTTP server in a child process) against the
pure-torch reference on the same weights: cold prefill and decode, hits shorter and longer than
the window, concurrent requests sharing and diverging from prefixes, the pool's integrity after
every test (``checked_server``), eviction under a small pool, and bad input.

Outputs are compared as greedy token ids (exact) and their log-probabilities (LOGPROB_ATOL:
the served batch runs the same layer code over differently shaped batches; quantized caches).
"""

import concurrent.futures as cf
import json
import socket
import urllib.request

import pytest
import torch

from cedar.backend.cache import new_cache
from cedar.backend.replay import greedy, prefill, replay_span
from cedar.kernels.dispatch import KernelSet

from conftest import start_server, wait_idle_and_check
from server_helpers import LOGPROB_ATOL, NEW, W, assert_matches, generate, prompt, reference

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("n", [40, W, 300])
def test_cold_prefill_and_decode_equal_reference(checked_server, ref, n):
    ids = prompt(n, 100 + n)
    served = generate(checked_server, ids)
    assert served[2]["cached_tokens"] == 0 and served[2]["replayed_tokens"] == 0
    assert_matches(served, reference(ref, ids))


def test_hit_within_window_replays_from_zero_and_equals_cold(checked_server, ref):
    a = prompt(100, 1)
    c = a[:60] + prompt(30, 14)  # shares 60 <= W tokens, away from a's snapshot boundaries
    generate(checked_server, a)
    warm = generate(checked_server, c)
    assert warm[2]["cached_tokens"] == 60 and warm[2]["replayed_tokens"] == 60  # replay from 0
    assert warm[2]["restored_tokens"] == 0
    assert_matches(warm, reference(ref, c))  # a cold run: replay from 0 is exact


def test_full_repeat_restores_the_snapshot_and_is_identical(checked_server):
    ids = prompt(100, 15)
    cold = generate(checked_server, ids)
    warm = generate(checked_server, ids)
    assert warm[2]["cached_tokens"] == 98  # a full repeat matches len - 1 tokens, page-aligned
    assert warm[2]["restored_tokens"] == 98 and warm[2]["replayed_tokens"] == 0
    assert warm[0] == cold[0]  # exact state, recomputing rows 98-99 only: equal up to reassociation
    assert max(abs(x - y) for x, y in zip(warm[1], cold[1])) <= LOGPROB_ATOL


def test_hit_beyond_window_equals_reference_bounded_replay(checked_server, ref):
    a = prompt(400, 2)
    b = a[:300] + prompt(50, 3)
    generate(checked_server, a)
    served = generate(checked_server, b)
    H = served[2]["cached_tokens"]
    assert H == 300 and served[2]["replayed_tokens"] == W
    assert_matches(served, reference(ref, b, hit=H, donor_ids=a))


def test_concurrent_requests_sharing_and_diverging(checked_server, ref):
    shared = prompt(260, 4)
    generate(checked_server, shared)  # warm the prefix with a cold computation
    prompts = [shared[:200] + [9 + i] + prompt(20 + 7 * i, 50 + i) for i in range(6)]  # hits of 200
    prompts += [prompt(90 + 40 * i, 70 + i) for i in range(2)]  # cold, diverging from the start
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(checked_server, p), prompts))
    for p, served in zip(prompts, results):
        H = served[2]["cached_tokens"]
        assert H in (0, 200), H
        assert served[2]["replayed_tokens"] == min(W, H)
        assert_matches(served, reference(ref, p, hit=H, donor_ids=shared))


def test_streaming_and_openai_endpoints(checked_server):
    req = urllib.request.Request(checked_server.url + "/generate", data=json.dumps({
        "input_ids": prompt(30, 5), "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).encode(),
        headers={"Content-Type": "application/json"})
    chunks = [line for line in urllib.request.urlopen(req, timeout=120).read().decode().splitlines()
              if line.startswith("data:") and "[DONE]" not in line]
    assert len(chunks) >= 2 and len(json.loads(chunks[-1][5:])["output_ids"]) == 5
    status, out = checked_server.post("/v1/chat/completions", {
        "model": "cedar", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]})
    assert status == 200 and out["usage"]["completion_tokens"] <= 4


def test_server_reports_memory_budget(server):
    from cedar.backend.memory import memory_report
    from cedar.backend.memory import budget_bytes_per_token

    state = server.cedar_state()
    report = memory_report(server_cfg := ref_cfg(server))
    assert state["global_bytes_per_token"] == report.global_bytes_per_token
    assert state["swa_bytes_per_request"] == report.swa_bytes_per_request
    assert state["budget_bytes_per_token"] == budget_bytes_per_token(server_cfg)
    assert state["token_pool_bytes"] >= state["token_slots"] * report.global_bytes_per_token
    assert state["swa_bytes_per_request_allocated"] >= report.swa_bytes_per_request


def ref_cfg(server):
    from cedar.backend.config import CEDConfig

    return CEDConfig.load(server.cfg.model)


@pytest.mark.parametrize("payload, message", [
    ({"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "[a-"}}, "regex"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": "{\"type\": 12}"}}, "schema"),
    ({"input_ids": [8 + i % 500 for i in range(4200)], "sampling_params": {"max_new_tokens": 2}}, "context length"),
    ({"input_ids": [9, 10, 600], "sampling_params": {"max_new_tokens": 2}}, "out of range"),
    ({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, "empty"),
    # fields that size a tensor in the scheduler: a top-k past the vocabulary killed the server
    ({"input_ids": [9, 10, 11], "return_logprob": True, "top_logprobs_num": 100000,
      "sampling_params": {"max_new_tokens": 2}}, "top_logprobs_num"),
    ({"input_ids": [9, 10, 11], "return_logprob": True, "token_ids_logprob": [9, 100000],
      "sampling_params": {"max_new_tokens": 2}}, "token_ids_logprob"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 0}}, "sampling_params.n"),
    # a logprob start below -1 failed an assertion in SGLang's logprob processor: the scheduler died
    ({"input_ids": [9, 10, 11], "return_logprob": True, "logprob_start_len": -7,
      "sampling_params": {"max_new_tokens": 2}}, "logprob_start_len"),
])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(checked_server, payload, message):
    status, out = checked_server.post("/generate", payload)
    assert 400 <= status < 500, (status, out)
    assert message in json.dumps(out).lower() or message in str(out), out
    ids, _, meta = generate(checked_server, prompt(20, 6), n=2)
    assert len(ids) == 2


def test_client_disconnect_mid_stream_is_cleaned_up(checked_server):
    body = json.dumps({"input_ids": prompt(50, 7), "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})
    host, port = checked_server.cfg.host, checked_server.cfg.port
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall((f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        assert b"data:" in s.recv(4096) or b"data:" in s.recv(4096)
    # the abort reaches the scheduler; checked_server then verifies nothing is left behind
    ids, _, _ = generate(checked_server, prompt(20, 8), n=2)
    assert len(ids) == 2


def test_small_pool_chunked_mixed_batches_and_eviction(tiny_model_dir, ref):
    """A second server: 1024 token slots, 160-token chunks (the least that leaves room for a
    hit's W replay rows is W + a page), mixed prefill/decode batches."""
    srv = start_server(tiny_model_dir, "--max-total-tokens", "1024", "--chunked-prefill-size", "160",
                       "--max-running-requests", "4", "--enable-mixed-chunk")
    try:
        prompts = [prompt(150 + 60 * i, 300 + i) for i in range(3)]
        with cf.ThreadPoolExecutor(3) as pool:  # chunks of one request ride with others' decodes
            served = list(pool.map(lambda p: generate(srv, p, n=8), prompts))
        for p, out in zip(prompts, served):
            assert_matches(out, reference(ref, p, n=8))
        first = prompt(300, 200)
        cold = generate(srv, first)
        for i in range(8):  # 8 x 300 tokens through a 1024-token pool: the first prompt is evicted
            generate(srv, prompt(300, 201 + i))
        again = generate(srv, first)
        assert again[2]["cached_tokens"] == 0 and again[2]["restored_tokens"] == 0
        assert again[0] == cold[0]
        assert_matches(again, reference(ref, first))  # chunked by SGLang into 160-token pieces
        state = wait_idle_and_check(srv)
        assert state["tokens"]["cached"] <= 1024
    finally:
        srv.stop()


def test_prometheus_counts_replayed_tokens(checked_server):
    def replayed_metric():
        text = urllib.request.urlopen(checked_server.url + "/metrics", timeout=60).read().decode()
        lines = [l for l in text.splitlines() if l.startswith("cedar:replayed_tokens_total")]
        return sum(float(l.split()[-1]) for l in lines)

    before = replayed_metric()
    a = prompt(200, 9)
    generate(checked_server, a, n=1)
    served = generate(checked_server, a[:160] + prompt(10, 10), n=1)
    assert served[2]["replayed_tokens"] == W
    assert replayed_metric() - before == W


def test_multi_turn_session_restores_its_snapshot_and_replays_nothing(checked_server, ref):
    from cedar.backend.replay import continue_prefill

    p1 = prompt(300, 11)
    out1, _, _ = generate(checked_server, p1, n=6)
    new = prompt(40, 12)
    turn2 = generate(checked_server, p1 + out1 + new, n=4)
    meta = turn2[2]
    assert meta["cached_tokens"] >= 300 and meta["replayed_tokens"] == 0
    assert meta["restored_tokens"] == meta["cached_tokens"]
    # the reference continues its own exact state: prompt, 5 fed outputs, then the new turn
    cache = new_cache(ref.cfg, True)
    res = prefill(ref, cache, torch.tensor(p1), replay_span(0, W))
    assert greedy(ref, cache, res.logits[-1], 6) == out1
    res2 = continue_prefill(ref, cache, torch.tensor([out1[-1]] + new))
    toks = greedy(ref, cache, res2.logits[-1], 4)
    assert turn2[0] == toks
    assert abs(turn2[1][0] - float(torch.log_softmax(res2.logits[-1], -1)[toks[0]])) <= LOGPROB_ATOL
    assert checked_server.cedar_state()["snapshots"]["restored"] >= 1


def test_concurrent_duplicate_prefixes_still_restore(checked_server, ref):
    """Sessions that computed the same cold prefix at once: the tree keeps one copy and frees
    the others' slots; every session's next turn still restores its snapshot (re-keyed to the
    kept slots) and equals the reference continuing its own exact state."""
    from cedar.backend.replay import continue_prefill

    base = prompt(200, 31)
    firsts = [base + prompt(11, 40 + i) for i in range(3)]  # odd length: the last page is partial
    with cf.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: generate(checked_server, p, n=5)[0], firsts))
    news = [prompt(9, 50 + i) for i in range(3)]
    with cf.ThreadPoolExecutor(3) as pool:
        turns = list(pool.map(lambda i: generate(checked_server, firsts[i] + outs[i] + news[i], n=3), range(3)))
    for i, (toks, lps, meta) in enumerate(turns):
        assert meta["replayed_tokens"] == 0 and meta["restored_tokens"] == meta["cached_tokens"] >= 210, meta
        cache = new_cache(ref.cfg, True)
        res = prefill(ref, cache, torch.tensor(firsts[i]), replay_span(0, W))
        assert greedy(ref, cache, res.logits[-1], 5) == outs[i]
        res2 = continue_prefill(ref, cache, torch.tensor([outs[i][-1]] + news[i]))
        assert toks == greedy(ref, cache, res2.logits[-1], 3)
        assert abs(lps[0] - float(torch.log_softmax(res2.logits[-1], -1)[toks[0]])) <= LOGPROB_ATOL


def switch(server, **values):
    status, out = server.post("/set_internal_state", {"server_args": values})
    assert status == 200 and out == [True], out  # one scheduler accepted the update


def reference_untrimmed(ref, ids, n=NEW):
    cache = new_cache(ref.cfg, True)
    res = prefill(ref, cache, torch.tensor(ids), replay_span(0, W), narrow=False)
    toks = greedy(ref, cache, res.logits[-1], n)
    return toks, float(torch.log_softmax(res.logits[-1], -1)[toks[0]]), res


def test_narrowing_off_equals_the_untrimmed_reference(checked_server, ref):
    ids = prompt(300, 16)
    switch(checked_server, cedar_narrow=0)
    try:
        assert checked_server.cedar_state()["flags"]["narrow"] is False
        served = generate(checked_server, ids)
    finally:
        switch(checked_server, cedar_narrow=1)
    toks, lp, _ = reference_untrimmed(ref, ids)
    assert_matches(served, (toks, lp))
    assert reference(ref, ids)[1] != lp  # narrowing does change the result: the test can tell


def test_exact_mode_after_a_hit_equals_cold(checked_server, ref):
    a = prompt(400, 17)
    b = a[:300] + prompt(40, 18)
    generate(checked_server, a)
    switch(checked_server, cedar_replay_exact=1)
    try:
        served = generate(checked_server, b)
    finally:
        switch(checked_server, cedar_replay_exact=0)
    assert served[2]["cached_tokens"] == 300 and served[2]["replayed_tokens"] == 300
    toks, lp, _ = reference_untrimmed(ref, b)
    assert_matches(served, (toks, lp))


def test_prompt_logprobs_run_untrimmed(checked_server, ref):
    ids = prompt(260, 19)
    status, out = checked_server.post("/generate", {
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert status == 200, out
    served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None]
    _, _, res = reference_untrimmed(ref, ids, n=1)
    logp = torch.log_softmax(res.logits[:-1], -1)  # row i predicts token i + 1
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert len(served) == len(want)
    assert max(abs(a - b) for a, b in zip(served, want)) <= LOGPROB_ATOL


def test_server_runs_the_fast_cpu_kernels(checked_server):
    """The served model runs the dispatch table's fast CPU backend, with the C++ kernels where
    this machine builds them (what the reference fixture runs too)."""
    from cedar.kernels import cpu_ext

    kernels = checked_server.cedar_state()["kernels"]
    assert kernels == {"backend": KernelSet.for_device("cpu").backend, "cpu_ext": cpu_ext.available()}
    assert kernels["backend"] == "fast"


def test_decode_steps_run_on_one_thread_and_the_switch_gives_them_the_servers(checked_server, ref):
    """``decode_threads`` (1 by default): after a generation the scheduler's torch is on one
    thread (the last step decoded); with the benchmark switch off, on the server's; the tokens
    are the reference's either way."""
    ids, other = prompt(200, 41), prompt(200, 42)
    assert_matches(generate(checked_server, ids), reference(ref, ids))
    threads = checked_server.cedar_state()["threads"]
    assert threads["decode"] == 1 and threads["now"] == 1 and threads["server"] >= 1
    switch(checked_server, cedar_decode_one_thread=0)
    try:
        assert_matches(generate(checked_server, other), reference(ref, other))
        threads = checked_server.cedar_state()["threads"]
        assert threads["decode"] == threads["now"] == threads["server"]
    finally:
        switch(checked_server, cedar_decode_one_thread=1)
