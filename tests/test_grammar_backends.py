"""The agents on the other grammar backends SGLang offers (`cedar serve --grammar-backend ...`):
llguidance runs every constrained call; outlines runs string-only tools and refuses numeric
ranges with a clear error (it cannot enforce them). xgrammar, the default, is what the other
server tests use."""

import pytest

from cedar.agents import react as react_mod
from cedar.agents.function_calling import load_tasks, run_tasks
from cedar.agents.runs import run_agent
from cedar.frontend.endpoint import CedarEndpoint

from conftest import start_server, wait_idle_and_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llguidance", "outlines"])
def backend_server(request, tiny_model_dir):
    srv = start_server(tiny_model_dir, "--context-length", "4096", "--grammar-backend", request.param)
    yield request.param, srv
    srv.stop()


def test_agents_on_other_grammar_backends(backend_server):
    name, srv = backend_server
    backend = CedarEndpoint(srv.url)
    result = run_agent("react", backend, {"question": react_mod.EXAMPLE_QUESTION, "facts": react_mod.EXAMPLE_FACTS,
                                          "max_steps": 2})
    registry = react_mod.react_tools(react_mod.EXAMPLE_FACTS)
    for st in result["session"]["steps"]:
        registry.validate(st["tool"], st["arguments"])
    tasks = load_tasks("tests/data/fc_forced.json")
    if name == "llguidance":
        summary = run_tasks(tasks, backend)
        assert (summary["calls"], summary["calls_ok"], summary["tasks_ok"]) == (3, 2, 1)
    else:  # integer ranges: outlines refuses them; the task is an error that says so, the rest still run
        summary = run_tasks(tasks, backend)
        assert (summary["tasks"], summary["task_errors"], summary["errors"][0]["name"]) == (2, 1, "levels")
        assert "not supported by outlines" in summary["errors"][0]["reason"]
        assert [c["ok"] for c in summary["per_task"]["colors"]] == [True, False]
    wait_idle_and_check(srv)
