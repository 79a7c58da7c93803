"""A fix to SGLang's frontend interpreter, installed as a pinned hook (like the server's hooks in
``cedar.backend.serving``) when a backend that runs programs is made (a :class:`~.endpoint.
CedarEndpoint`, the corpus's scripted backend), never on import: importing ``cedar.frontend``
changes nothing in SGLang.

SGLang's ``StreamExecutor.__del__`` and ``ProgramState.__del__`` call ``end()``, whose
``Thread.is_alive()`` deadlocks when the cyclic GC runs it inside threading's bookkeeping of a thread being started (seen: a subagent
started from a tool thread hung forever in ``Thread.start``, and a corpus build of scripted ReAct
sessions hung at the tool pool's ``Thread.start`` through ``ProgramState.__del__``; ``_maintain_shutdown_locks`` holds
``_shutdown_locks_lock`` and ``is_alive`` -> ``_stop`` waits for it). A collected executor is
unreachable, so stopping its worker through its queue is enough: no thread call needed.

Installed through SGLang's ``HookRegistry`` by ``cedar.backend.serving.seam`` (an AROUND hook that
does not call the original), refused for another SGLang version; ``tests/test_sglang_hooks.py``
pins the targets and ``installed()`` reads them back from the live classes.
"""

from __future__ import annotations

from cedar.backend.serving import seam

TARGETS = {"executor_del": "sglang.lang.interpreter.StreamExecutor.__del__",
           "state_del": "sglang.lang.interpreter.ProgramState.__del__"}


def executor_del(original, self):
    """Stop a collected executor's worker without touching its thread (see the module doc)."""
    if getattr(self, "use_thread", False) and getattr(self, "queue", None) is not None:
        self.queue.put(None)
    backend = getattr(self, "backend", None)
    if backend is not None:
        backend.end_program(self)


def state_del(original, self):
    """A collected program state ends its executor (``ProgramState.__del__`` calls ``end()``, the
    same ``is_alive`` deadlock): stopped the same way."""
    executor = getattr(self, "stream_executor", None)
    if executor is not None:
        executor_del(None, executor)


HOOKS = {"executor_del": (executor_del, "around"), "state_del": (state_del, "around")}


def installed() -> bool:
    """Is the fix live on SGLang's StreamExecutor and ProgramState in this process?"""
    return all(seam.installed(target, __name__) for target in TARGETS.values())


def install() -> None:
    """Register and apply the hook (idempotent); refuses another SGLang version."""
    import sys

    seam.check_version("frontend fix", ", ".join(TARGETS.values()))
    if installed():
        return
    seam.register(sys.modules[__name__])
    seam.apply()
    if not installed():
        raise RuntimeError(f"cedar's frontend fix did not install on {', '.join(TARGETS.values())}")
