"""A fix to SGLang's frontend interpreter, applied when `cedar.frontend` is imported.

SGLang's `StreamExecutor.__del__` calls `end()`, whose `Thread.is_alive()` deadlocks when the
cyclic GC runs it inside threading's bookkeeping of a thread being started (seen: a subagent
started from a tool thread hung forever in `Thread.start`; `_maintain_shutdown_locks` holds
`_shutdown_locks_lock` and `is_alive` -> `_stop` waits for it). A collected executor is
unreachable, so stopping its worker through its queue is enough: no thread call needed.
"""

from __future__ import annotations


def install() -> None:
    from sglang.lang.interpreter import StreamExecutor

    def __del__(self):  # noqa: N807
        if getattr(self, "use_thread", False) and getattr(self, "queue", None) is not None:
            self.queue.put(None)
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.end_program(self)

    StreamExecutor.__del__ = __del__
