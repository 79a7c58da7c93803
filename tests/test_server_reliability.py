"""The real server under what goes wrong in production: admission that counts replay rows, the
API key on every endpoint Cedar adds or changes, refused switches, a chunk too small for replay,
and a scheduler killed mid-request (``cedar serve`` exits non-zero, nothing is left behind, a
restarted server serves)."""

import concurrent.futures as cf
import http.client
import json
import sys
import time
import urllib.request

import psutil
import pytest

from cedar.backend.serving.launch import ServeConfig
from cedar.backend.serving.planner import ServingFlags
from cedar.backend.serving.process import ServerClient, ServerProcess, free_port

from conftest import start_server, wait_idle_and_check
from server_helpers import W, assert_matches, generate, prompt, reference

pytestmark = pytest.mark.slow
CHUNK = 256  # --chunked-prefill-size: two stale hits (W replay rows + their new rows) overflow it
KEY = "cedar-test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Small chunks, no snapshots (every hit is a stale one that replays W rows), an API key."""
    srv = start_server(tiny_model_dir, "--chunked-prefill-size", str(CHUNK), "--api-key", KEY,
                       "--context-length", "4096", flags=ServingFlags(snapshot_mb=0))
    yield srv
    srv.stop()


def test_admission_counts_replay_rows(server, ref):
    """Eight stale hits at once: each forward runs at most CHUNK rows, replay rows included
    (SGLang alone would batch them all: 8 x (W + 20) rows), and every answer is still the
    reference's bounded replay."""
    donors = [prompt(300, 500 + i) for i in range(8)]
    for d in donors:
        generate(server, d, n=1)
    hits = [d + prompt(20, 600 + i) for i, d in enumerate(donors)]
    with cf.ThreadPoolExecutor(len(hits)) as pool:
        served = list(pool.map(lambda p: generate(server, p), hits))
    for i, out in enumerate(served):
        assert out[2]["cached_tokens"] == 300 and out[2]["replayed_tokens"] == W, out[2]
    for i in (0, 5):
        assert_matches(served[i], reference(ref, hits[i], hit=300, donor_ids=donors[i]))
    state = server.cedar_state()
    assert 0 < state["forward_rows_max"]["extend"] <= CHUNK, state["forward_rows_max"]
    wait_idle_and_check(server)


def _status(url, method="GET", body=None, key=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers=ServerClient(url, key).headers(), method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


ENDPOINTS = [
    ("/generate", "POST", {"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/chat/completions", "POST", {"model": "cedar", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/get_server_info", "GET", None),
    ("/set_internal_state", "POST", {"server_args": {"cedar_narrow": 1}}),
    ("/flush_cache", "POST", None),
]


@pytest.mark.parametrize("path, method, body", ENDPOINTS)
def test_api_key_guards_every_endpoint_cedar_uses(server, path, method, body):
    assert _status(server.url + path, method, body) == 401
    assert _status(server.url + path, method, body, key="wrong") == 401
    assert _status(server.url + path, method, body, key=KEY) == 200
    assert _status(server.url + "/health") == 200  # probes stay open (SGLang's policy)


@pytest.mark.parametrize("args, message", [
    ({"cedar_narrow": 7}, "must be 0 or 1"),
    ({"cedar_replay_exact": 0.5}, "must be 0 or 1"),
    ({"cedar_snapshots": "yes"}, "valid number"),  # SGLang's own body schema
    ({"cedar_narow": 1}, "unknown cedar switch"),
])
def test_a_refused_switch_is_a_400_with_a_message(server, args, message):
    status, out = server.post("/set_internal_state", {"server_args": args})
    assert status == 400 and message in json.dumps(out).lower(), (status, out)
    assert server.cedar_state()["flags"]["narrow"] is True  # nothing changed
    status, out = server.post("/set_internal_state", {"server_args": {"cedar_narrow": 1}})
    assert status == 200 and out == [True]


def test_a_chunk_too_small_for_replay_is_refused_at_start(tiny_model_dir):
    with pytest.raises(RuntimeError) as err:
        start_server(tiny_model_dir, "--chunked-prefill-size", str(W))
    assert "--chunked-prefill-size 128 leaves no room" in str(err.value)


def _cedar_serve(model_dir, port, log_path):
    """``cedar serve`` itself (the CLI, which becomes SGLang's server), in a child process."""
    cfg = ServeConfig(model=str(model_dir), port=port)
    argv = [sys.executable, "-m", "cedar.cli", "serve", "--model", str(model_dir), "--port", str(port),
            "--sleep-on-idle"]
    return ServerProcess(cfg, log_path, argv=argv)


def test_killed_scheduler_stops_cedar_serve_and_a_restart_serves(tiny_model_dir, tmp_path):
    """kill -9 of the scheduler mid-stream: the streaming client gets an error (not a hang),
    ``cedar serve`` exits non-zero within seconds naming the crashed process, no child is left,
    and a new ``cedar serve`` on the same port answers again."""
    port = free_port()
    srv = _cedar_serve(tiny_model_dir, port, tmp_path / "serve.log").start()
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        scheduler = next(c for c in children if "scheduler" in c.name())
        body = json.dumps({"input_ids": prompt(30, 1), "stream": True,
                           "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}).encode()
        stream = urllib.request.urlopen(urllib.request.Request(
            srv.url + "/generate", data=body, headers=srv.headers()), timeout=60)
        assert stream.readline().startswith(b"data:")  # it is streaming
        scheduler.kill()
        t0 = time.time()
        with pytest.raises((OSError, http.client.HTTPException)):  # a cut stream; a hang would time out
            while line := stream.readline():
                assert b"[DONE]" not in line, "the request finished: the kill came too late"
            raise ConnectionError("the stream ended without its last chunk")
        code = srv.proc.wait(timeout=30)
        assert code != 0 and time.time() - t0 < 30, code
        alive = psutil.wait_procs(children, timeout=10)[1]
        assert not alive, f"orphans left: {alive}"
        log = srv.log_path.read_text()
        assert "Subprocess scheduler_0" in log and "crashed" in log
    finally:
        srv.stop()
    again = _cedar_serve(tiny_model_dir, port, tmp_path / "again.log").start()
    try:
        ids, _, _ = generate(again, prompt(20, 2), n=3)
        assert len(ids) == 3
    finally:
        again.stop()
