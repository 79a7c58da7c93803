"""A throw-away sandbox directory for the coding agent, and its tools.

Files: every path argument is resolved (symlinks included) and must stay under the sandbox root;
anything else is refused with an error the model reads. Python snippets run in a subprocess
with the sandbox as working directory, a wall-clock limit (killed past it, with its process
group), an address-space and a CPU-time limit (`resource.setrlimit`), an empty environment, and
an audit hook (`sys.addaudithook`, which code cannot remove) that refuses to open a file for
writing, or to create, remove or rename one, outside the sandbox, and refuses subprocesses,
`os.system`, `fork` and `ctypes`. Reads outside the sandbox are allowed only under the Python
installation (imports need it).

NOTE: the audit hook is a guard against a model's mistakes, not a security boundary against
deliberately hostile native code; run untrusted workloads in a container as well.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from cedar.frontend.tools import ToolRegistry

PathArg = Annotated[str, Field(max_length=40)]
SNIPPET_TIMEOUT_S = 5.0
SNIPPET_MEMORY_MB = 512
MAX_READ_CHARS = 2000

_GUARD = r'''
import os, sys
_root = os.path.realpath(sys.argv[1])
_ok_read = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.__file__)})
def _inside(path, roots):
    try:
        p = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return any(p == r or p.startswith(r + os.sep) for r in roots)
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = any(c in str(mode or "") for c in "wax+") or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if not _inside(path, (_root,)) and (writing or not _inside(path, _ok_read)):
            raise PermissionError(f"sandbox: {path} is outside the sandbox")
    elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.symlink", "os.link",
                   "os.truncate", "shutil.rmtree", "os.utime", "os.chown"):
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, (_root,)):
                raise PermissionError(f"sandbox: {path} is outside the sandbox")
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "ctypes.dlopen", "ctypes.cdata"):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
del _hook
sys.path.insert(0, _root)  # the sandbox's own modules import (python -I leaves the cwd out)
_code = sys.stdin.read()
exec(compile(_code, "<snippet>", "exec"), {"__name__": "__main__"})
'''


class SandboxError(ValueError):
    """A request the sandbox refuses (path outside it, missing file, ...)."""


@dataclass
class Sandbox:
    """`with Sandbox() as box:` a fresh directory, removed on exit; `box.tools()` its registry."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cedar-sandbox-")))
    snippet_timeout_s: float = SNIPPET_TIMEOUT_S
    snippet_memory_mb: int = SNIPPET_MEMORY_MB

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def resolve(self, path: str) -> Path:
        root = self.root.resolve()
        p = (root / path).resolve()
        if p != root and root not in p.parents:
            raise SandboxError(f"{path!r} is outside the sandbox")
        return p

    def write_files(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            p = self.resolve(rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)

    # ------------------------------------------------------------------ tools
    def list_dir(self, path: PathArg = ".") -> str:
        """List the files under a directory of the sandbox.

        Args:
            path: directory, relative to the sandbox root
        """
        d = self.resolve(path)
        if not d.is_dir():
            raise SandboxError(f"{path!r} is not a directory")
        root = self.root.resolve()
        return "\n".join(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in sorted(d.rglob("*"))) or "(empty)"

    def read_file(self, path: PathArg) -> str:
        """Read a text file of the sandbox.

        Args:
            path: file path, relative to the sandbox root
        """
        p = self.resolve(path)
        if not p.is_file():
            raise SandboxError(f"no file {path!r}")
        return p.read_text(errors="replace")[:MAX_READ_CHARS]

    def grep(self, pattern: Annotated[str, Field(max_length=24)], path: PathArg = ".") -> str:
        """Search the sandbox's files for a regular expression; lines as file:line:text.

        Args:
            pattern: Python regular expression
            path: directory or file to search, relative to the sandbox root
        """
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise SandboxError(f"bad pattern {pattern!r}: {e}") from None
        base = self.resolve(path)
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        root = self.root.resolve()
        hits = [f"{f.relative_to(root)}:{i}:{line}" for f in files
                for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if rx.search(line)]
        return "\n".join(hits[:50]) or "(no match)"

    def write_file(self, path: PathArg, content: Annotated[str, Field(max_length=120)]) -> str:
        """Write a text file of the sandbox (replacing it if it exists).

        Args:
            path: file path, relative to the sandbox root
            content: the whole new text of the file
        """
        p = self.resolve(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        return f"wrote {len(content)} chars to {path}"

    def edit_file(self, path: PathArg, old: Annotated[str, Field(max_length=40)],
                  new: Annotated[str, Field(max_length=40)]) -> str:
        """Replace the one occurrence of a text in a file of the sandbox.

        Args:
            path: file path, relative to the sandbox root
            old: the exact text to replace (must occur once)
            new: the replacement text
        """
        p = self.resolve(path)
        if not p.is_file():
            raise SandboxError(f"no file {path!r}")
        text = p.read_text()
        count = text.count(old) if old else 0
        if count != 1:
            raise SandboxError(f"{old!r} occurs {count} times in {path}; it must occur once")
        p.write_text(text.replace(old, new, 1))
        return f"edited {path}"

    def run_python(self, code: Annotated[str, Field(max_length=120)]) -> str:
        """Run a Python snippet in the sandbox directory; returns its exit code, stdout and stderr.

        Args:
            code: Python source to run
        """
        return self.run_snippet(code)

    def run_snippet(self, code: str) -> str:
        limit = self.snippet_memory_mb * 2**20

        def limits() -> None:
            import resource

            os.setsid()
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            cpu = int(self.snippet_timeout_s) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

        proc = subprocess.Popen([sys.executable, "-I", "-c", _GUARD, str(self.root.resolve())], cwd=self.root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin"}, preexec_fn=limits, text=True)
        try:
            out, err = proc.communicate(code, timeout=self.snippet_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"killed: the snippet ran past its {self.snippet_timeout_s:g} s limit"
        return f"exit {proc.returncode}\n{out[-800:]}{err[-800:]}"

    def tools(self) -> ToolRegistry:
        registry = ToolRegistry()
        for fn in (self.list_dir, self.read_file, self.grep, self.write_file, self.edit_file):
            registry.add(fn)
        registry.add(self.run_python, timeout_s=self.snippet_timeout_s + 5)
        return registry
