"""`CedarEndpoint`: SGLang's `RuntimeEndpoint` that carries token ids forward, and records
what the cache did for every request.

Why carry tokens: a frontend program's context is text, and the stock endpoint sends the whole
text with every call, so the server re-tokenizes it. A generated token sequence is often not the
canonical tokenization of its own text (BPE would merge it differently), so the next call's
prefix hit stops where the previous call's output began, and the finished request's window
snapshot (exact continuation) is never restored. This endpoint keeps a ledger of
(text, token ids) for every prompt it sent and every output it got back; a new call's text is
sent as `input_ids`: the ids of the longest ledger entry its text starts with, plus the
tokenization of the rest. Nothing changes on the server; a text with no ledger prefix is sent
as its plain tokenization (what the server would have computed).

NOTE: an output's trailing end-of-sequence token is not carried: the server never computed its
KV (a finished request's state ends before its last sampled token), so a continuation that
re-appends the role suffix `<|end|>` is tokenized to the same id anyway and its hit ends exactly
where the snapshot was taken.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.global_config import global_config
from sglang.utils import http_request

from .chat import TEMPLATE_NAME, register

LEDGER_ENTRIES = 1024



@dataclass(frozen=True)
class RequestRecord:
    """One request the endpoint sent, with what the server reported (meta_info)."""

    label: str  # the program state's label (see `label`), or its sid
    prompt_tokens: int
    cached_tokens: int
    replayed_tokens: int
    restored_tokens: int
    completion_tokens: int
    carried_tokens: int  # prompt ids taken from the ledger instead of re-tokenized
    continues: bool  # the prompt extends an earlier request's prompt + output (a next turn)
    latency_s: float

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class TokenLedger:
    """Known (text -> token ids) pairs, longest-prefix lookup; thread-safe, bounded LRU."""

    tokenizer: object
    entries: dict[str, tuple[list[int], bool]] = field(default_factory=dict)  # text -> (ids, is an output)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.special_ids = frozenset(self.tokenizer.all_special_ids)

    def encode(self, text: str) -> tuple[list[int], int, bool]:
        """(ids for `text`, how many came from the ledger, whether they end an earlier output)."""
        with self.lock:
            best = max((k for k in self.entries if text.startswith(k)), key=len, default="")
            ids, is_output = self.entries[best] if best else ([], False)
            if best:
                self.entries[best] = self.entries.pop(best)  # most recently used last
        rest = text[len(best):]
        return list(ids) + (self.tokenizer.encode(rest, add_special_tokens=False) if rest else []), len(ids), is_output

    def record(self, text: str, ids: list[int], is_output: bool = False) -> None:
        with self.lock:
            self.entries.pop(text, None)
            self.entries[text] = (list(ids), is_output)
            while len(self.entries) > LEDGER_ENTRIES:
                self.entries.pop(next(iter(self.entries)))


class CedarEndpoint(RuntimeEndpoint):
    """`sgl.set_default_backend(CedarEndpoint(url))` or `program.run(..., backend=...)`."""

    def __init__(self, base_url: str, api_key: str | None = None, carry_tokens: bool = True) -> None:
        register()
        from .executor_fix import install as install_executor_fix

        install_executor_fix()  # NOTE: before any program runs on this endpoint
        super().__init__(base_url, api_key=api_key, chat_template_name=TEMPLATE_NAME)
        self.ledger = TokenLedger(self._load_tokenizer()) if carry_tokens else None
        self.records: list[RequestRecord] = []
        self._records_lock = threading.Lock()

    def _load_tokenizer(self):
        from cedar.backend.serving.hf_config import load_tokenizer

        return load_tokenizer(self.model_info.get("tokenizer_path") or self.model_info["model_path"])

    # ------------------------------------------------------------------ requests
    def generate(self, s, sampling_params):
        self._handle_dtype_to_regex(sampling_params)
        params = {"skip_special_tokens": global_config.skip_special_tokens_in_output,
                  "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                  **sampling_params.to_srt_kwargs()}
        data = {"sampling_params": params}
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        obj = self._send(s, s.text_, data)
        return obj["text"], obj["meta_info"]

    def commit_lazy_operations(self, s):
        """The prefill a `fork` sends before its branches (the shared prefix, no output)."""
        self.prefill(s, s.text_)

    def prefill(self, s, text: str) -> None:
        """Compute `text` once (no output), so that requests which start with it and run
        concurrently hit it instead of each computing a copy (SGLang's radix tree keeps the first
        copy; a snapshot over a duplicate's token slots can never be restored)."""
        self._send(s, text, {"sampling_params": {"max_new_tokens": 0}})

    def _send(self, s, text: str, data: dict) -> dict:
        carried, continues = 0, False
        if self.ledger is not None:
            ids, carried, continues = self.ledger.encode(text)
            data = {**data, "input_ids": ids}
        else:
            data = {**data, "text": text}
        self._add_images(s, data)
        t0 = time.perf_counter()
        res = http_request(self.base_url + "/generate", json=data, api_key=self.api_key, verify=self.verify)
        self._assert_success(res)
        obj = res.json()
        if self.ledger is not None:
            self.ledger.record(text, data["input_ids"])
            self._record_output(text, data["input_ids"], obj)
        self._log(s, obj["meta_info"], carried, continues, time.perf_counter() - t0)
        self.observe(s, data, obj, t0, time.perf_counter())
        return obj

    def observe(self, s, data: dict, obj: dict, sent_s: float, done_s: float) -> None:
        """Called with every request sent (``data``, with ``input_ids`` when tokens are carried)
        and its answer; a hook for recorders (`cedar.drivers.bench.record`)."""

    def _record_output(self, text: str, prompt_ids: list[int], obj: dict) -> None:
        out_ids = list(obj.get("output_ids") or [])
        while out_ids and out_ids[-1] in self.ledger.special_ids:
            out_ids.pop()
        # NOTE: only when the ids spell exactly the returned text (a stop string trims the text,
        # not the ids): a wrong pair would make every later hit wrong
        if self.ledger.tokenizer.decode(out_ids, skip_special_tokens=True) == obj["text"]:
            self.ledger.record(text + obj["text"], prompt_ids + out_ids, is_output=bool(out_ids))

    def _log(self, s, meta: dict, carried: int, continues: bool, latency_s: float) -> None:
        rec = RequestRecord(label=_LABELS.get(s) or s.sid[:8],
                            prompt_tokens=int(meta.get("prompt_tokens", 0)),
                            cached_tokens=int(meta.get("cached_tokens", 0)),
                            replayed_tokens=int(meta.get("replayed_tokens", 0) or 0),
                            restored_tokens=int(meta.get("restored_tokens", 0) or 0),
                            completion_tokens=int(meta.get("completion_tokens", 0)),
                            carried_tokens=carried, continues=continues, latency_s=round(latency_s, 4))
        with self._records_lock:
            self.records.append(rec)

    def take_records(self) -> list[RequestRecord]:
        """The records so far, and forget them."""
        with self._records_lock:
            out, self.records = self.records, []
        return out

    def server_info(self) -> dict:
        res = http_request(self.base_url + "/get_server_info", api_key=self.api_key, verify=self.verify)
        self._assert_success(res)
        return res.json()


_LABELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # executor -> its label


def label(s, name: str) -> None:
    """Name a program state (`s` inside an `@sgl.function`, or a fork) in the request records
    (kept beside SGLang's executor, not on it)."""
    _LABELS[executor_of(s)] = name


def executor_of(s):
    """SGLang's executor behind a program state (`s` inside an `@sgl.function`, or a fork)."""
    return getattr(s, "stream_executor", s)


def backend_of(s):
    """The backend a program state runs on (a :class:`CedarEndpoint`, or the corpus's scripted one)."""
    return executor_of(s).backend


def sync(s) -> None:
    """Wait until every request a program state has issued so far is answered."""
    executor_of(s).sync()

