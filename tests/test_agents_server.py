"""Cedar's agent programs against a real `cedar serve` (random weights): every constrained call
parses and validates, cached tokens grow turn over turn, forks run and join, a subagent's
context holds none of its parent's history, failing tools come back as observations, the
function-calling runner scores a hand-written task file, and `cedar agent run` works."""

import json
import subprocess
import sys
from typing import Annotated

import pytest
import sglang as sgl
from pydantic import AfterValidator

from cedar.agents import react as react_mod
from cedar.agents.coding import EXAMPLE_TASK
from cedar.agents.function_calling import load_tasks, run_tasks
from cedar.agents.runs import run_agent
from cedar.agents.sandbox import Sandbox
from cedar.agents.steps import finish_tool, step
from cedar.agents.subagents import CHILD_SYSTEM, PARENT_SYSTEM, delegate_tool
from cedar.frontend.chat import system_text
from cedar.frontend.endpoint import CedarEndpoint, label
from cedar.frontend.stated_values import StatedValues
from cedar.frontend.tools import ToolRegistry
from test_tool_schemas import even

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backend(server):
    return CedarEndpoint(server.url)


def by_label(records, name):
    return [r for r in records if r["label"] == name]


def all_steps(session: dict) -> list[dict]:
    """The session's steps and, after them, its subagents' (recursively)."""
    return session["steps"] + [st for child in session["children"] for st in all_steps(child)]


def coding_registry():
    registry = Sandbox().tools()
    delegate_tool(registry, None, [])
    finish_tool(registry)
    return registry


def test_coding_session(checked_server, backend):
    task = {**EXAMPLE_TASK, "max_turns": 4, "parallel_hints": ["list the files", "read calc.py"], "delegate_at": 2}
    result = run_agent("coding", backend, task)
    session, records = result["session"], result["records"]
    registry = coding_registry()
    steps = session["steps"]
    assert 4 <= len(steps) <= 2 + 3
    for st in steps:  # every constrained call parses and validates against its tool's schema
        registry.validate(st["tool"], st["arguments"])
    # the forked first turn: two branches, joined back into the main context
    assert [st["thought"] for st in steps[:2]] == ["in parallel: list the files; read calc.py"] * 2
    assert {r["label"] for r in records} >= {"coding", "coding/fork/0", "coding/fork/1", "coding/sub0"}
    assert steps[3]["tool"] == "delegate"  # turn 2 (the fork was turn 0)
    assert len(session["children"]) == sum(st["tool"] == "delegate" for st in steps)
    # cached tokens grow turn over turn in the main session
    main = by_label(records, "coding")
    assert len(main) >= 4
    assert all(b["cached_tokens"] > a["cached_tokens"] for a, b in zip(main, main[1:])), main
    # a subagent starts from a fresh context: it shares only the markup's first tokens
    child = by_label(records, "coding/sub0")
    assert child[0]["cached_tokens"] < 32
    assert result["reuse"]["cached_share"] > 0.7 and result["reuse"]["snapshot_share"] > 0.5, result["reuse"]
    # the sandbox was real: every task file was read back from its directory, and each one no
    # successful write_file / edit_file / run_python step could have changed is byte-identical
    files = result["files_after"]
    assert set(EXAMPLE_TASK["files"]) <= set(files), sorted(files)
    changers = [st for st in all_steps(session) if st["ok"] and st["tool"] in ("write_file", "edit_file", "run_python")]
    touched = {json.loads(st["arguments"]).get("path", "").removeprefix("./") for st in changers}
    unchanged = {name for name in EXAMPLE_TASK["files"]
                 if name not in touched and not any(st["tool"] == "run_python" for st in changers)}
    assert {n: files[n] for n in unchanged} == {n: EXAMPLE_TASK["files"][n] for n in unchanged}, changers
    # and a file changed by one step only (no run_python, which could change anything) holds
    # what it wrote: a write_file's whole content, an edit_file's replacement text
    if not any(st["tool"] == "run_python" for st in changers):
        for path in touched:
            mine = [json.loads(st["arguments"]) | {"tool": st["tool"]} for st in changers
                    if json.loads(st["arguments"]).get("path", "").removeprefix("./") == path]
            if [m["tool"] for m in mine] == ["write_file"]:
                assert files.get(path) == mine[0]["content"], (path, mine)
            elif [m["tool"] for m in mine] == ["edit_file"] and mine[0]["new"]:
                assert mine[0]["new"] in files.get(path, ""), (path, mine)


def test_react_loop(checked_server, backend):
    result = run_agent("react", backend, {"question": react_mod.EXAMPLE_QUESTION, "facts": react_mod.EXAMPLE_FACTS,
                                          "max_steps": 3})
    registry = react_mod.react_tools(react_mod.EXAMPLE_FACTS)
    steps = result["session"]["steps"]
    assert 1 <= len(steps) <= 3
    for st in steps:
        registry.validate(st["tool"], st["arguments"])
        if st["tool"] == "lookup" and not st["ok"]:
            assert st["observation"].startswith("error: lookup raised KeyError")
    assert (steps[-1]["tool"] == "finish") == (result["session"]["answer"] is not None)


def test_parallel_forks_run_and_join(checked_server, backend):
    hints = ["look up the capital of France", "look up the river of Paris", "look up the length of the Seine"]
    result = run_agent("parallel", backend, {"question": "Q?", "facts": react_mod.EXAMPLE_FACTS, "hints": hints})
    steps, text = result["session"]["steps"], result["text"]
    assert len(steps) == len(hints) + 1 and steps[-1]["tool"] == "finish"
    labels = [r["label"] for r in result["records"]]
    assert {f"parallel/fork/{i}" for i in range(3)} <= set(labels)
    # joined: one assistant message with every branch's call, then one tool message per result
    from cedar.frontend.chat import tool_call_text

    calls = "".join(tool_call_text(st["tool"], st["arguments"]) for st in steps[:3])
    assert calls + "<|end|>" + "".join(f"<|tool|>{st['observation']}<|end|>" for st in steps[:3]) in text


def test_subagents_have_fresh_contexts(checked_server, backend):
    goal = "PARENT-ONLY-MARKER: how long is the river of the capital of France?"
    result = run_agent("subagents", backend, {"goal": goal, "facts": react_mod.EXAMPLE_FACTS,
                                              "subtasks": ["find the capital of France", "find the Seine's length"]})
    children = result["session"]["children"]
    assert len(children) == 2
    for text in result["child_texts"]:
        assert "PARENT-ONLY-MARKER" not in text and PARENT_SYSTEM not in text and CHILD_SYSTEM in text
    for i, child in enumerate(children):  # folded back into the parent's context
        assert f"<|tool|>subagent {i} answer: {child['answer'] or '(no answer)'}<|end|>" in result["text"]


def failing_tools() -> ToolRegistry:
    r = ToolRegistry()

    @r.tool
    def boom(x: int) -> str:
        """Always fails."""
        raise RuntimeError("boom failed")

    @r.tool(timeout_s=0.5)
    def hang(x: int) -> str:
        """Never returns in time."""
        import time

        time.sleep(3)
        return "late"

    @r.tool
    def halve(n: Annotated[int, AfterValidator(even)]) -> int:
        """Halve an even number."""
        return n // 2
    return r


@sgl.function
def failing_loop(s, registry):
    label(s, "failing")
    s += sgl.system(system_text("Use the tools.", registry.openai_tools()))
    s += sgl.user("Go.")
    out = []
    for i, name in enumerate(["boom", "hang", "halve", "halve", "halve"]):
        out.append(step(s, registry, f"s{i}", names=[name], thought=f"try {name}")[0])
    return out


def test_failing_tools_become_observations(checked_server, backend):
    state = failing_loop.run(registry=failing_tools(), backend=backend)
    steps = state.ret_value
    assert [st.tool for st in steps] == ["boom", "hang", "halve", "halve", "halve"]
    assert not steps[0].ok and "raised RuntimeError: boom failed" in steps[0].observation
    assert not steps[1].ok and "timed out after 0.5 s" in steps[1].observation
    for st in steps[2:]:  # the grammar admits any integer; validation decides
        n = json.loads(st.arguments)["n"]
        assert st.ok == (n % 2 == 0), st
        if n % 2:
            assert "must be even" in st.observation
    assert state.text().count("<|tool|>") == 5  # every failure went back to the model


def test_function_calling_runner_scores_hand_written_tasks(checked_server, backend):
    summary = run_tasks(load_tasks("tests/data/fc_forced.json"), backend)
    # colors: turn 0 right (the grammar admits only red), turn 1 wrong (blue expected); levels right
    assert (summary["calls"], summary["calls_ok"], summary["tasks"], summary["tasks_ok"]) == (3, 2, 2, 1)
    calls = summary["per_task"]["colors"]
    assert [c["ok"] for c in calls] == [True, False] and calls[1]["got_arguments"] == '{"color": "red"}'


def test_function_calling_runner_narrows_values_to_those_stated(checked_server, backend):
    # random weights: whatever the model prefers, every free value is one the conversation stated
    task = load_tasks("tests/data/fc_stated.json")[0]
    calls = run_tasks([task], backend, stated_values=True)["per_task"]["stated"]
    first, second = (json.loads(c["got_arguments"]) for c in calls)
    assert first["count"] == 48213 and set(first["ids"]) <= {48213}  # the one integer stated
    assert first["code"] in StatedValues.of([task["turns"][0]["user"]]).strings
    said = [task["turns"][0]["user"], task["turns"][0]["results"][0], task["turns"][1]["user"]]
    assert second["count"] in (48213, 777) and set(second["ids"]) <= {48213, 777}  # a tool result states 777
    assert second["code"] in StatedValues.of(said).strings


def test_cli_agent_run(checked_server, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "cedar.cli", "agent", "run", "function-calling",
                           "--server", checked_server.url, "--task", "tests/data/fc_forced.json", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prompt cached" in proc.stdout and "2/3 calls right" in proc.stdout
    result = json.loads(out.read_text())
    assert result["scores"]["calls_ok"] == 2 and len(result["records"]) >= 3
    bad = subprocess.run([sys.executable, "-m", "cedar.cli", "agent", "run", "function-calling",
                          "--server", checked_server.url, "--task", "README.md"], capture_output=True, text=True)
    assert bad.returncode == 2 and "neither JSON nor JSONL" in bad.stderr
