"""The coding agent's sandbox: nothing it does reaches outside its directory, and a snippet past
its time limit is killed."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from cedar.agents.sandbox import Sandbox


@pytest.fixture
def box():
    with Sandbox(snippet_timeout_s=2.0) as b:
        b.write_files({"src/a.py": "def f():\n    return 1\n", "README.md": "hello\n"})
        yield b


def test_file_tools_work_inside(box):
    r = box.tools()
    assert r.call("list_dir", {}).text.splitlines() == ["README.md", "src/", "src/a.py"]
    assert r.call("read_file", {"path": "src/a.py"}).text.startswith("def f")
    assert r.call("grep", {"pattern": "return"}).text == "src/a.py:2:    return 1"
    assert r.call("edit_file", {"path": "src/a.py", "old": "return 1", "new": "return 2"}).ok
    assert r.call("write_file", {"path": "new/b.txt", "content": "x"}).ok and (box.root / "new/b.txt").read_text() == "x"
    assert r.call("run_python", {"code": "import sys; sys.path.insert(0, 'src'); import a; print(a.f())"}).text == "exit 0\n2\n"


@pytest.fixture
def short_tmp():
    """An outside directory with a short path (tool paths are at most 40 characters)."""
    d = Path(tempfile.mkdtemp(prefix="cx"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_paths_outside_are_refused(box, short_tmp):
    tmp_path = short_tmp
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (box.root / "link").symlink_to(tmp_path)
    r = box.tools()
    for name, args in [("read_file", {"path": "../outside.txt"}), ("read_file", {"path": str(outside)}),
                       ("read_file", {"path": "link/outside.txt"}), ("write_file", {"path": "../x.txt", "content": "x"}),
                       ("edit_file", {"path": str(outside), "old": "secret", "new": "gone"}),
                       ("list_dir", {"path": "/"}), ("grep", {"pattern": "s", "path": ".."})]:
        obs = r.call(name, args)
        assert not obs.ok and "outside the sandbox" in obs.text, (name, obs)
    assert outside.read_text() == "secret" and not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("code", [
    "open({p!r}, 'w').write('x')",
    "import os; os.remove({p!r})",
    "import os; os.rename({p!r}, {p!r} + '2')",
    "import shutil; shutil.rmtree({d!r})",
    "import os; os.system('touch ' + {p!r})",
    "import subprocess; subprocess.run(['touch', {p!r}])",
    "print(open({p!r}).read())",
])
def test_snippets_cannot_touch_files_outside(box, tmp_path, code):
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    out = box.run_snippet(code.format(p=str(target), d=str(tmp_path)))
    assert "PermissionError: sandbox" in out, out
    assert target.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["victim.txt"]


def test_snippet_past_its_time_limit_is_killed(box):
    t0 = time.monotonic()
    out = box.run_snippet("import time\nwhile True: time.sleep(0.01)")
    assert out.startswith("killed") and time.monotonic() - t0 < 6


def test_snippet_memory_is_limited(box):
    assert "MemoryError" in box.run_snippet("x = bytearray(4 * 2**30)")


def test_sandbox_is_removed_on_exit():
    with Sandbox() as b:
        root = Path(b.root)
        assert root.is_dir()
    assert not root.exists()
