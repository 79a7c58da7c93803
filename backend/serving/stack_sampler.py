"""A sampling profiler for the server's own processes, for ``cedar bench scheduler``: where a
served step's time goes on the scheduler's thread (Cedar's forward, SGLang's allocation,
sampling, streaming), which the in-process step benchmark cannot see. py-spy cannot attach on
this kind of machine ("Failed to find python version"), so each process samples itself.

Off unless ``CEDAR_STACK_SAMPLE_DIR`` is set in the server's environment; then the plugin
(:mod:`plugin`, which runs in every SGLang process) starts :func:`start` and a daemon thread
reads the main thread's stack every ``PERIOD_S`` while the control file ``DIR/on`` exists. When
the file goes away the process writes what it saw to ``DIR/stacks-<process name>-<pid>.txt``
(one ``frame;frame;... count`` line per distinct stack, outermost frame first, frames as
``file.py:function``) and starts afresh the next time the file appears.

NOTE: reading another thread's frames needs the GIL, so a sample lands at the main thread's next
bytecode boundary: a long C call that holds the GIL is charged to the Python line that called
it, and the sampler's own GIL requests slow the server a little (measure speed without it).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

ENV = "CEDAR_STACK_SAMPLE_DIR"
PERIOD_S = 0.002
_STARTED: set[int] = set()  # pids that run a sampler (the plugin may be loaded twice in a process)


def main_stack(main_id: int) -> str | None:
    """The main thread's stack as ``file.py:function`` frames joined by ``;``, outermost first."""
    frame = sys._current_frames().get(main_id)
    frames = []
    while frame is not None:
        frames.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return ";".join(reversed(frames)) or None


def write_stacks(path: Path, counts: collections.Counter) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{stack} {n}\n" for stack, n in counts.most_common()))
    tmp.replace(path)  # NOTE: a reader never sees half a file


def start(directory: str | os.PathLike) -> threading.Thread | None:
    """Sample this process's main thread while ``directory/on`` exists (a daemon thread; None if
    this process already runs one)."""
    if os.getpid() in _STARTED:
        return None
    _STARTED.add(os.getpid())
    out, main_id = Path(directory), threading.main_thread().ident
    name = multiprocessing.current_process().name.replace(" ", "_")

    def run() -> None:
        counts: collections.Counter = collections.Counter()
        while True:
            if (out / "on").exists():
                stack = main_stack(main_id)
                if stack:
                    counts[stack] += 1
            elif counts:
                write_stacks(out / f"stacks-{name}-{os.getpid()}.txt", counts)
                counts = collections.Counter()
            time.sleep(PERIOD_S)

    thread = threading.Thread(target=run, name="cedar-stack-sampler", daemon=True)
    thread.start()
    return thread
