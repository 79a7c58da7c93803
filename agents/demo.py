"""`make demo`: serve the shipped model, run the coding agent on a small task (a forked parallel
step and a subagent among its turns), then two tasks from held-out templates (a tool schema and a
bug kind no training task uses, ``tasks/demo_heldout.json``) each judged by its own check, and an
OpenAI-client tool call against it; print the transcripts with per-request prompt / cached /
replayed / restored / new tokens, check the pools, and stop the server."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cedar.frontend.server import connect

from .cli import print_transcript
from .coding import EXAMPLE_TASK
from .outcome import outcome_ok, tests_pass
from .runs import TASKS_DIR, run_agent

CHECKS = {"coding": "the task's own test, run in a fresh sandbox over the files the agent left, passes",
          "function-calling": "every call has the right name and argument values"}


@dataclass(frozen=True)
class DemoTask:
    """A generated task as the corpus writes it (``Task.to_json``): what ``outcome_ok`` judges."""

    agent: str
    kind: str
    template: str
    inputs: dict
    expect: dict


def demo_tasks(path: Path = TASKS_DIR / "demo_heldout.json") -> list[DemoTask]:
    return [DemoTask(**t) for t in json.loads(path.read_text())]


def run_heldout(backend, task: DemoTask, model: str) -> bool:
    """Run one held-out task, print its transcript and whether its own check passes. A
    function-calling task also runs narrowed to the stated values: through the frontend, and as an
    OpenAI-API loop with narrowed tools (``model``: the name the OpenAI API takes)."""
    print(f"[demo] a task from a held-out template ({task.template}; {task.agent}):")
    if task.agent == "coding":
        print(f"[demo] task: {task.inputs['instruction']}")
    else:
        print(f"[demo] tools: {', '.join(t['function']['name'] for t in task.inputs['tools'])}; "
              f"first request: {task.inputs['turns'][0]['user']!r}")
    result = run_agent(task.agent, backend, task.inputs)
    print_transcript(result)
    ok = outcome_ok(task, result)
    print(f"[demo] solved ({CHECKS[task.agent]}): {'yes' if ok else 'no'}")
    if task.agent == "function-calling":  # the frontend's help, reported apart (cedar.frontend.stated_values)
        narrowed = run_agent(task.agent, backend, task.inputs, stated_values=True)
        calls = [f"{c['got_name']}({c['got_arguments']})" for c in narrowed["scores"]["per_task"][task.inputs["name"]]]
        print(f"[demo] again with every free argument value narrowed to the values the conversation states "
              f"(--stated-values): {'; '.join(calls)}; solved: {'yes' if outcome_ok(task, narrowed) else 'no'}")
        print(f"[demo] as an OpenAI-API loop (openai client, tool_choice=auto), the tools narrowed before each "
              f"request (narrow_tools): {openai_narrowed_loop(backend.base_url, model, task.inputs)}")
    return ok


def openai_narrowed_loop(base_url: str, model: str, task: dict) -> str:
    """A function-calling task as an OpenAI-API loop whose tools are narrowed to the stated values
    before each request (`api_loop.run_loop`, ``tools_mode="stated"``): its calls and its score."""
    import openai

    from .api_loop import run_loop, score_loop
    from .function_calling import required_arguments

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    turns = run_loop(client, model, task, tools_mode="stated")
    score = score_loop(turns, required_arguments(task["tools"]))
    calls = [f"{c['name']}({c['arguments']})" for t in turns for c in t.calls]
    return (f"{'; '.join(calls) or '(no call)'}; ended on its own: {'yes' if score.ended else 'no'}; "
            f"solved: {'yes' if score.solved else 'no'}")


DEMO_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"]}}},
]


def openai_tool_call(base_url: str, model: str, question: str = "What time is it in Oslo?") -> str:
    """One unconstrained (`tool_choice: auto`) call through the `openai` client."""
    import openai

    from cedar.frontend.tools import ToolRegistry

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    tools = ToolRegistry.from_openai(DEMO_TOOLS).openai_tools()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       tools=tools, tool_choice="auto", max_tokens=64, temperature=0)
    calls = r.choices[0].message.tool_calls or []
    return "; ".join(f"{c.function.name}({c.function.arguments})" for c in calls) or \
        f"(no call; text {r.choices[0].message.content!r})"


def run_demo(model_dir: Path) -> int:
    print(f"[demo] starting `cedar serve` with {model_dir} (about 20 s)")
    with connect(model=model_dir) as backend:
        info = backend.server_info()
        cedar = info["internal_states"][0]["cedar"]
        print(f"[demo] server budgets {cedar['budget_bytes_per_token']} B/token; tool-call parser "
              f"{info.get('tool_call_parser')}; grammar backend {info.get('grammar_backend')}")
        print("[demo] the coding agent on a small task (a forked parallel step first, a subagent at turn 2):")
        print(f"[demo] task: {EXAMPLE_TASK['instruction']}")
        result = run_agent("coding", backend)
        print_transcript(result)
        files = result["files_after"]
        print(f"[demo] calc.py after the session:\n{files.get('calc.py', '(missing)')}")
        print(f"[demo] test_calc.py passes now: {tests_pass(files, 'test_calc.py')}")
        for task in demo_tasks():
            run_heldout(backend, task, str(model_dir))
        print(f"[demo] OpenAI client, tool_choice=auto, 'What time is it in Oslo?': "
              f"{openai_tool_call(backend.base_url, str(model_dir))}")
        state = backend.server_info()["internal_states"][0]["cedar"]
        print(f"[demo] replayed tokens in total: {state['replayed_tokens_total']}; pool integrity ok: "
              f"{state['integrity']['tokens_ok']}")
    print("[demo] server stopped")
    return 0
