"""`make demo`: serve the shipped model, run the coding agent on a small task (a forked parallel
step and a subagent among its turns) and an OpenAI-client tool call against it, print the
transcript with per-request prompt / cached / replayed / restored / new tokens, check the pools,
and stop the server."""

from __future__ import annotations

import json
from pathlib import Path

from cedar.frontend.server import connect

from .cli import print_transcript
from .runs import run_agent


def openai_tool_call(base_url: str, model: str) -> str:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    tools = [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                       "required": ["path"]}}}]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Show me calc.py"}],
                                       tools=tools, tool_choice="required", max_tokens=64, temperature=0)
    calls = r.choices[0].message.tool_calls or []
    return "; ".join(f"{c.function.name}({c.function.arguments})" for c in calls) or "(no call)"


def run_demo(model_dir: Path) -> int:
    print(f"[demo] starting `cedar serve` with {model_dir} (about 20 s)")
    with connect(model=model_dir) as backend:
        info = backend.server_info()
        cedar = info["internal_states"][0]["cedar"]
        print(f"[demo] server budgets {cedar['budget_bytes_per_token']} B/token; tool-call parser "
              f"{info.get('tool_call_parser')}; grammar backend {info.get('grammar_backend')}")
        print("[demo] the coding agent on a small task (a forked parallel step first, a subagent at turn 2); "
              "the shipped model has random weights, so its text is noise, but every call is well-formed:")
        result = run_agent("coding", backend)
        print_transcript(result)
        print(f"[demo] files after the session: {json.dumps(sorted(result['files_after']))}")
        print(f"[demo] OpenAI client, tool_choice=required: {openai_tool_call(backend.base_url, str(model_dir))}")
        state = backend.server_info()["internal_states"][0]["cedar"]
        print(f"[demo] replayed tokens in total: {state['replayed_tokens_total']}; pool integrity ok: "
              f"{state['integrity']['tokens_ok']}")
    print("[demo] server stopped")
    return 0
