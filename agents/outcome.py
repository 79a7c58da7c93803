"""Did a run end as its task expects? One judge for the corpus build (a scripted run must reach
its task's outcome) and for `cedar evaluate` (a model's run).

- **coding**: solved only when the task's test passes on the files the agent left: the files
  after the session are written into a fresh sandbox, the task's *original* test file over them
  (an agent that edits the test does not grade itself), and the test is run with Python there,
  with the sandbox's time and memory limits; exit status 0 passes. Whether the fixed line appears
  in the file does not count.
- **function calling**: every call of the task right (`function_calling.score_call`: the name,
  and each argument value; an optional argument may be left out).
- the others: the session's final answer equals the expected answer (stripped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .sandbox import Sandbox


class Task(Protocol):
    """What the judge reads of a task (``cedar.training.corpus.tasks.Task`` has it)."""

    agent: str
    inputs: dict
    expect: dict

TEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TestRun:
    """One run of a test file over a set of files."""

    __test__ = False  # not a pytest class

    passed: bool  # the test exited with status 0 within the limit
    output: str  # its exit line, stdout and stderr (tails), or why it was killed


def run_test(files: dict[str, str], test: str, timeout_s: float = TEST_TIMEOUT_S) -> TestRun:
    """Run the Python file `test` in a fresh sandbox holding `files` (relative path -> text)."""
    if test not in files:
        return TestRun(False, f"no test file {test!r} among the files")
    with Sandbox(snippet_timeout_s=timeout_s) as box:
        box.write_files(files)
        out = box.run_snippet(f"exec(compile(open({test!r}).read(), {test!r}, 'exec'))")
    return TestRun(out.startswith("exit 0\n"), out)


def tests_pass(files: dict[str, str], test: str) -> bool:
    """Does `test` pass over `files` (see `run_test`)?"""
    return run_test(files, test).passed


def coding_test(task: Task, files_after: dict[str, str]) -> TestRun:
    """The task's own test (as the task gave it) over the files the agent left."""
    test = task.expect["test"]
    original = task.inputs["files"].get(test)
    files = {**files_after, test: original} if original is not None else dict(files_after)
    return run_test(files, test)


def outcome_ok(task: Task, result: dict) -> bool:
    """Did a run (scripted, or a model's) end as the task expects?"""
    if task.agent == "function-calling":
        return result["scores"]["tasks_ok"] == result["scores"]["tasks"] > 0
    if task.agent == "coding":
        return coding_test(task, result["files_after"]).passed
    return (result["session"].get("answer") or "").strip() == task.expect["answer"]
