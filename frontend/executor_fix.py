"""A fix to SGLang's frontend interpreter, installed as a pinned hook (like the server's hooks in
``cedar.backend.serving``) when a :class:`~.endpoint.CedarEndpoint` is made, never on import:
importing ``cedar.frontend`` changes nothing in SGLang.

SGLang's ``StreamExecutor.__del__`` calls ``end()``, whose ``Thread.is_alive()`` deadlocks when the
cyclic GC runs it inside threading's bookkeeping of a thread being started (seen: a subagent
started from a tool thread hung forever in ``Thread.start``; ``_maintain_shutdown_locks`` holds
``_shutdown_locks_lock`` and ``is_alive`` -> ``_stop`` waits for it). A collected executor is
unreachable, so stopping its worker through its queue is enough: no thread call needed.

Installed through SGLang's ``HookRegistry`` (an AROUND hook that does not call the original),
refused for another SGLang version; ``tests/test_sglang_hooks.py`` pins the target and
``installed()`` reads it back from the live class.
"""

from __future__ import annotations

import inspect

SGLANG_VERSION = "0.5.23"
TARGETS = {"executor_del": "sglang.lang.interpreter.StreamExecutor.__del__"}


def executor_del(original, self):
    """Stop a collected executor's worker without touching its thread (see the module doc)."""
    if getattr(self, "use_thread", False) and getattr(self, "queue", None) is not None:
        self.queue.put(None)
    backend = getattr(self, "backend", None)
    if backend is not None:
        backend.end_program(self)


def installed() -> bool:
    """Is the fix live on SGLang's StreamExecutor in this process?"""
    from sglang.lang.interpreter import StreamExecutor

    fn = inspect.getattr_static(StreamExecutor, "__del__")
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if any(getattr(c, "cell_contents", None) is executor_del for c in (getattr(fn, "__closure__", None) or ())):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def install() -> None:
    """Register and apply the hook (idempotent); refuses another SGLang version."""
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"cedar's frontend fix was written for sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}: re-check {TARGETS['executor_del']}")
    if installed():
        return
    HookRegistry.register(TARGETS["executor_del"], executor_del, HookType.AROUND)
    HookRegistry.apply_hooks()
    if not installed():
        raise RuntimeError(f"cedar's frontend fix did not install on {TARGETS['executor_del']}")
