"""A scripted policy as an SGLang frontend backend: Cedar's own agent programs run unchanged, real
tools and all, while every `sgl.gen` is answered from a script that knows the answer.

A script is a set of queues keyed by the conversation a gen belongs to: the first user message of
its context (a parent and each of its subagents have their own), plus the branch number inside a
`fork` (the `[i] hint` line a branch writes). Each gen pops the next answer of its queue, which
must satisfy the gen's own regex (the JSON gens are checked by the tool registry when the call
runs). Every program's final text is kept: those texts are the corpus.
"""

from __future__ import annotations

import re
import threading
from collections import deque

from sglang.lang.backend.base_backend import BaseBackend

from cedar.backend.tokenizer import END, ROLE_MARKERS
from cedar.frontend.chat import register
from cedar.frontend.executor_fix import install as install_executor_fix

USER = ROLE_MARKERS["user"]
ASSISTANT = ROLE_MARKERS["assistant"]
BRANCH = re.compile(r"\n\[(\d+)\] [^\n]*\n[^\n]*$")


class ScriptError(RuntimeError):
    """The program asked for a gen the script has no (valid) answer for."""


def conversation_key(text: str) -> tuple[str, int | None]:
    """(first user message, fork branch or None) of a context."""
    start = text.find(USER)
    if start < 0:
        raise ScriptError("a gen before any user message")
    end = text.find(END, start)
    user = text[start + len(USER): end]
    last = text.rfind(ASSISTANT)
    m = BRANCH.search(text[last:]) if last >= 0 else None
    return user, (int(m.group(1)) if m else None)


class ScriptedBackend(BaseBackend):
    """``script``: {(first user message, branch or None): [answers in order]}."""

    def __init__(self, script: dict[tuple[str, int | None], list[str]]) -> None:
        super().__init__()
        install_executor_fix()  # NOTE: before any program runs on this backend (see executor_fix)
        self.chat_template = register()
        self.queues = {k: deque(v) for k, v in script.items()}
        self.lock = threading.RLock()  # NOTE: end_program may run from a GC'd executor's __del__
        self.finished: list[str] = []  # final texts of finished programs
        self.latest: dict[int, str] = {}  # executor id -> its text after its last gen

    def get_model_name(self) -> str:
        return "scripted"

    def generate(self, s, sampling_params):
        key = conversation_key(s.text_)
        with self.lock:
            queue = self.queues.get(key)
            if not queue:
                raise ScriptError(f"no scripted answer left for {key} at ...{s.text_[-120:]!r}")
            answer = queue.popleft()
            regex = sampling_params.regex
            if regex is not None and not re.fullmatch(regex, answer):
                raise ScriptError(f"scripted answer {answer!r} does not match the gen's regex {regex!r}")
            self.latest[id(s)] = s.text_ + answer
        return answer, {"prompt_tokens": 0, "completion_tokens": 0}

    def end_program(self, s):
        with self.lock:
            for e in s if isinstance(s, list) else [s]:
                self.latest.pop(id(e), None)
                self.finished.append(e.text_)

    def texts(self) -> list[str]:
        """Every finished program's text, and each fork branch's text after its last gen
        (texts that are a prefix of another are dropped)."""
        with self.lock:
            texts = sorted(set(self.finished) | set(self.latest.values()))
        return [t for t in texts if not any(o != t and o.startswith(t) for o in texts)]

    def leftover(self) -> dict:
        """Queues with answers the program never asked for (a script / program mismatch)."""
        return {k: list(q) for k, q in self.queues.items() if q}
