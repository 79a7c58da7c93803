"""`cedar evaluate`'s judges on hand-written right and wrong runs (no server): a coding task is
solved only when its test passes on the files left; the OpenAI-API loop's scoring; one bad task
does not stop the others (the evaluation and `cedar agent run function-calling`, the latter
through a real server)."""

import json
import subprocess
import sys

import pytest

from cedar.agents.api_loop import ERROR_RESULT, LoopTurn, pick_examples, reported_values, run_loop, score_loop, states
from cedar.training.corpus.build import make_tasks
from cedar.training.corpus.scripted import ScriptedBackend
from cedar.training.corpus.tasks import Task
from cedar.drivers.evaluate import evaluate_tasks, template_of
from cedar.agents.outcome import coding_test, outcome_ok, run_test

BUGGY = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n"
TASK = Task("coding", "coding", {"instruction": "The test in test_calc.py fails. Fix calc.py so that add(2, 3) == 5.",
                                 "files": {"calc.py": BUGGY, "test_calc.py": TEST}},
            expect={"test": "test_calc.py", "fixed_line": "return a + b"})


def coding_result(calc: str, test: str = TEST) -> dict:
    return {"files_after": {"calc.py": calc, "test_calc.py": test}, "session": {"answer": "fixed"}}


def test_a_coding_task_is_solved_only_when_its_test_passes():
    assert outcome_ok(TASK, coding_result("def add(a, b):\n    return a + b\n"))
    # the fixed line is there, but the test still fails: not solved
    decoy = "def add(a, b):\n    return a - b\n\n\ndef unused(a, b):\n    return a + b\n"
    assert "return a + b" in decoy and not outcome_ok(TASK, coding_result(decoy))
    # the other way round: no fixed line, the test passes: solved
    other = "def add(a, b):\n    return b + a\n"
    assert "return a + b" not in other and outcome_ok(TASK, coding_result(other))
    # an agent that rewrites the test does not grade itself: the task's own test runs
    assert not outcome_ok(TASK, coding_result(BUGGY, test="print('ok')\n"))
    run = coding_test(TASK, coding_result(BUGGY)["files_after"])
    assert not run.passed and "AssertionError" in run.output


def test_a_test_that_hangs_or_is_missing_fails():
    hang = run_test({"t.py": "while True:\n    pass\n"}, "t.py", timeout_s=1.0)
    assert not hang.passed and "killed" in hang.output
    assert not run_test({"calc.py": BUGGY}, "test_calc.py").passed


def test_generated_coding_tasks_pass_only_when_fixed():
    """A generated task's files fail its test; the scripted edit (the gold fix) makes it pass."""
    task = make_tasks(0, "heldout", {"coding": 1})[0]
    files = dict(task.inputs["files"])
    assert not outcome_ok(task, {"files_after": files, "session": {"answer": None}})
    edits = [json.loads(a) for answers in task.script.values() for a in answers
             if a.startswith("{") and '"old"' in a and '"new"' in a]
    assert edits, task.script
    fixed = dict(files)
    for e in edits:
        fixed[e["path"]] = fixed[e["path"]].replace(e["old"], e["new"], 1)
    assert fixed != files and outcome_ok(task, {"files_after": fixed, "session": {"answer": None}})


EXPECTED = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
REQUIRED = {"get_weather": frozenset({"city"})}


def call(city, **extra):
    return {"name": "get_weather", "arguments": json.dumps({"city": city, **extra})}


def test_loop_scoring_right_run_and_wrong_runs():
    right = score_loop([LoopTurn("u", EXPECTED, [call("Oslo", unit="celsius")], "It is 4 C in Oslo.", 2)], REQUIRED)
    assert right.ended and right.solved and not right.hit_limit and (right.calls_right, right.calls_made) == (1, 1)
    # `unit` is not required: leaving it out is still right
    assert score_loop([LoopTurn("u", EXPECTED, [call("Oslo")], "4 C", 2)], REQUIRED).solved
    # ... unless the schema requires it
    assert not score_loop([LoopTurn("u", EXPECTED, [call("Oslo")], "4 C", 2)],
                          {"get_weather": frozenset({"city", "unit"})}).solved
    limit = score_loop([LoopTurn("u", EXPECTED, [call("Oslo", unit="celsius")] * 6, None, 6, hit_limit=True)],
                       REQUIRED)
    assert limit.hit_limit and not limit.ended and not limit.solved and limit.calls_right == 1
    assert (limit.limit_after_right, limit.limit_after_error) == (1, 0)  # it kept calling after its result
    retries = score_loop([LoopTurn("u", EXPECTED, [call("Paristory")] * 6, None, 6, hit_limit=True)], REQUIRED)
    assert (retries.limit_after_right, retries.limit_after_error) == (0, 1)  # every attempt got an error
    assert (right.limit_after_right, right.limit_after_error) == (0, 0)
    wrong_value = score_loop([LoopTurn("u", EXPECTED, [call("Paristory", unit="celsius")], "done", 2)], REQUIRED)
    assert wrong_value.ended and not wrong_value.solved and wrong_value.calls_right == 0
    extra = score_loop([LoopTurn("u", EXPECTED, [call("Lima"), call("Oslo")], "4 C", 3)], REQUIRED)
    assert extra.ended and not extra.solved and (extra.calls_right, extra.calls_made) == (1, 2)
    markup = score_loop([LoopTurn("u", EXPECTED, [call("Oslo")], '<tool_call>{"name":"get_weather"', 2)], REQUIRED)
    assert markup.markup_answer and not markup.ended and not markup.solved
    # a second turn without an answer spoils the loop
    two = score_loop([LoopTurn("u", EXPECTED, [call("Oslo")], "4 C", 2), LoopTurn("v", EXPECTED, [], "", 1)], REQUIRED)
    assert not two.ended and not two.solved


def test_the_loops_kept_as_examples_show_each_outcome_that_occurred():
    def transcript(name, solved=False, ended=True, hit_limit=False):
        return {"task": name, "score": {"solved": solved, "ended": ended, "hit_limit": hit_limit}}
    runs = [transcript("a", solved=True), transcript("b", solved=True), transcript("c", solved=True),
            transcript("d"), transcript("e", ended=False, hit_limit=True), transcript("f")]
    assert [t["task"] for t in pick_examples(runs, 3)] == ["a", "d", "e"]  # not the first three (all solved)
    assert [t["task"] for t in pick_examples(runs, 4)] == ["a", "b", "d", "e"]  # then the earliest others
    assert [t["task"] for t in pick_examples(runs, 1)] == ["a"]
    only_solved = [transcript("a", solved=True), transcript("b", solved=True)]
    assert [t["task"] for t in pick_examples(only_solved, 3)] == ["a", "b"]
    assert pick_examples([], 3) == []


def test_an_answer_states_its_results_only_with_every_value_whole():
    assert reported_values('{"status": "queued", "id": 4417}') == ["4417"]
    assert reported_values('{"result": -21.99}') == ["-21.99"]
    assert reported_values('{"a": {"b": [1, "x"]}, "status": "ok"}') == ["1", "x"]
    assert reported_values("ok") == [] and reported_values(ERROR_RESULT) == [] and reported_values("[1, 2]") == []
    assert states("The result is -21.99.", "-21.99") and not states("The result is -21.99.", "21.99")
    assert states("Done, the id is 4417.", "4417") and not states("Done, the id is 44170.", "4417")
    assert not states("It is 4417.5 now", "4417") and states('Done, the reference is "Nain".', "Nain")
    queued = ['{"status": "queued", "id": 4417}']

    def turn(answer, results, hit=False):
        return LoopTurn("u", EXPECTED, [call("Oslo")], answer, 2, hit_limit=hit, results=results)

    said = score_loop([turn("Done, the id is 4417.", queued)], REQUIRED)
    assert (said.answers_due, said.answers_stating) == (1, 1) and said.solved
    vague = score_loop([turn("Done.", queued)], REQUIRED)
    assert (vague.answers_due, vague.answers_stating) == (1, 0) and vague.solved  # counted apart from solved
    wrong = score_loop([turn("Done, the id is 4471.", queued + ['{"result": 3.5}'])], REQUIRED)
    assert (wrong.answers_due, wrong.answers_stating) == (1, 0)
    half = score_loop([turn("The id is 4417.", queued + ['{"result": 3.5}'])], REQUIRED)
    assert (half.answers_due, half.answers_stating) == (1, 0)  # every value of every result
    for nothing in (turn("Done.", ["ok"]), turn(None, queued, hit=True), turn("Done.", [])):
        sc = score_loop([nothing], REQUIRED)
        assert (sc.answers_due, sc.answers_stating) == (0, 0)


def test_a_loop_keeps_the_results_of_right_calls_only():
    """`run_loop`'s bookkeeping (a scripted client: a wrong call, the right one, a text answer): the
    turn keeps the result the right call got, not the error the wrong one got."""
    from types import SimpleNamespace as NS

    def reply(content=None, *calls):
        tool_calls = [NS(function=NS(name="get_weather", arguments=a)) for a in calls] or None
        return NS(choices=[NS(message=NS(content=content, tool_calls=tool_calls))])

    replies = iter([reply(None, call("Lima")["arguments"]), reply(None, call("Oslo")["arguments"]),
                    reply("It is 4 C, id 7.")])
    sent = []

    def create(**kw):
        sent.append([m["content"] for m in kw["messages"] if m["role"] == "tool"])
        return next(replies)

    client = NS(chat=NS(completions=NS(create=create)))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"]}}}]
    task = {"tools": tools, "turns": [{"user": "Weather in Oslo?", "expected": EXPECTED,
                                       "results": ['{"temp": 4, "id": 7}']}]}
    turns = run_loop(client, "m", task)
    assert sent[-1] == [ERROR_RESULT, '{"temp": 4, "id": 7}']  # what the model was sent back
    assert turns[0].results == ['{"temp": 4, "id": 7}'] and turns[0].answer == "It is 4 C, id 7."
    sc = score_loop(turns, REQUIRED)
    assert (sc.answers_due, sc.answers_stating, sc.calls_made, sc.calls_right) == (1, 1, 2, 1)


def merged_backend(tasks: list[Task]) -> ScriptedBackend:
    script = {}
    for t in tasks:
        script.update(t.script)
    return ScriptedBackend(script)


def test_a_refused_free_form_call_is_counted_under_the_registrys_reason():
    from cedar.drivers.evaluate import invalid_reason
    from cedar.frontend.tools import ToolRegistry

    registry = ToolRegistry.from_openai([{"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])

    def why(name, arguments):
        with pytest.raises(ValueError) as e:
            registry.validate(name, arguments)
        return invalid_reason(str(e.value))

    assert why("get_wether", '{"city": "Oslo"}') == "unknown tool"
    assert why("get_weather", '{"city": "Oslo"') == "not JSON"
    assert why("get_weather", '["Oslo"]') == "not JSON"
    assert why("get_weather", '{"town": "Oslo"}') == "schema"
    assert why("get_weather", '{"city": 3}') == "schema"
    assert registry.validate("get_weather", '{"city": "Oslo"}') == {"city": "Oslo"}


class ScriptedClient:
    """A stand-in for the `openai` client's chat.completions.create (bookkeeping only): it
    replies from a script, each reply (tool calls as (name, arguments) pairs, finish reason), and
    keeps the conversations it was sent."""

    def __init__(self, replies):
        from types import SimpleNamespace as NS

        self.sent, self.replies = [], list(replies)
        self.chat = NS(completions=NS(create=self.create))

    def create(self, *, messages, max_tokens, **_):
        from types import SimpleNamespace as NS

        self.sent.append((list(messages), max_tokens))
        calls, finish = self.replies.pop(0)
        tool_calls = [NS(id=f"r{len(self.sent)}_{i}", function=NS(name=n, arguments=a)) for i, (n, a) in enumerate(calls)]
        return NS(choices=[NS(message=NS(tool_calls=tool_calls or None, content=""), finish_reason=finish)])


def test_a_turns_calls_may_come_one_request_at_a_time():
    from cedar.drivers.evaluate import _turn_calls

    turn = {"expected": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}, {"name": "c", "arguments": {}}],
            "results": ["ra", "rb", "rc"]}
    budget = (lambda pending: 10 * len(pending))
    # all three in one reply
    client = ScriptedClient([([("a", "{}"), ("b", "{}"), ("c", "{}")], "tool_calls")])
    got, requests, at_once, cut = _turn_calls(client, "m", [{"role": "user", "content": "go"}], [], turn, budget)
    assert [g.function.name for g in got] == ["a", "b", "c"] and requests == 1 and at_once and not cut
    # one, then two: the second request carries the first call and the first expected result
    client = ScriptedClient([([("a", "{}")], "tool_calls"), ([("b", "{}"), ("c", "{}")], "tool_calls")])
    got, requests, at_once, cut = _turn_calls(client, "m", [{"role": "user", "content": "go"}], [], turn, budget)
    assert [g.function.name for g in got] == ["a", "b", "c"] and requests == 2 and not at_once
    second, max_tokens = client.sent[1]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"] and second[2]["content"] == "ra"
    assert second[2]["tool_call_id"] == second[1]["tool_calls"][0]["id"] and max_tokens == 20
    # one call, then a text answer: the turn is short of calls
    client = ScriptedClient([([("a", "{}")], "tool_calls"), ([], "stop")])
    got, requests, at_once, cut = _turn_calls(client, "m", [], [], turn, budget)
    assert len(got) == 1 and requests == 2 and not at_once and not cut
    # a reply cut off by max_tokens before its call parsed
    client = ScriptedClient([([], "length")])
    got, requests, at_once, cut = _turn_calls(client, "m", [], [], turn, budget)
    assert got == [] and requests == 1 and cut
    # never more requests than expected calls, never more calls than expected
    client = ScriptedClient([([("a", "{}")], "tool_calls")] * 3 + [([("d", "{}")], "tool_calls")])
    got, requests, _, _ = _turn_calls(client, "m", [], [], turn, budget)
    assert requests == 3 and len(got) == 3 and len(client.replies) == 1


def test_one_bad_task_does_not_stop_the_evaluation():
    tasks = make_tasks(0, "heldout", {"coding": 1, "function-calling": 2, "react": 1})
    bad = Task("coding", "coding", {"instruction": "Fix nothing.py please."}, {}, {"test": "t.py", "fixed_line": "x"})
    out = evaluate_tasks(merged_backend(tasks), tasks[:2] + [bad] + tasks[2:], log=None)
    assert [(e["index"], e["kind"]) for e in out["errors"]] == [(2, "coding")] and "files" in out["errors"][0]["reason"]
    kinds = out["per_kind"]
    assert (kinds["coding"]["tasks"], kinds["coding"]["ok"], kinds["coding"]["errors"]) == (2, 1, 1)
    assert kinds["function-calling"]["ok"] == 2 and kinds["react"]["ok"] == 1
    assert kinds["coding"]["fixed_line_present"] == 1 and kinds["coding"]["finished"] == 1
    fc = out["function_calling"]
    assert fc["tasks"] == fc["tasks_ok"] == fc["tasks_exact"] == 2 and fc["calls"] == fc["calls_exact"] >= 2
    assert fc["values_ok"] == fc["values"] > 0
    templates = out["per_template"]  # each task under its template ("coding" for the bad one: it has none)
    assert set(templates) == {template_of(t) for t in tasks} | {"coding"}
    assert sum(g["tasks"] for g in templates.values()) == 5 and sum(g["ok"] for g in templates.values()) == 4


def fc_task(name, tools=None, expected=None):
    return {"name": name, "tools": tools or [{"type": "function", "function": {
        "name": "pick", "parameters": {"type": "object", "properties": {"color": {"type": "string", "enum": ["red"]}},
                                       "required": ["color"]}}}],
            "turns": [{"user": f"pick red for {name}",
                       "expected": expected or [{"name": "pick", "arguments": {"color": "red"}}]}]}


BAD_SCHEMA = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"color": {}}}}}]


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    from conftest import start_server

    srv = start_server(tiny_model_dir, "--context-length", "4096")
    yield srv
    srv.stop()


def test_cli_agent_run_reports_a_bad_task_and_runs_the_rest(tiny_server, tmp_path):
    tasks = [fc_task("a"), fc_task("refused", tools=BAD_SCHEMA), {"name": "no-turns", "tools": fc_task("x")["tools"]},
             fc_task("b")]
    path, out = tmp_path / "tasks.json", tmp_path / "out.json"
    path.write_text(json.dumps(tasks))
    proc = subprocess.run([sys.executable, "-m", "cedar.cli", "agent", "run", "function-calling",
                           "--server", tiny_server.url, "--task", str(path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    scores = json.loads(out.read_text())["scores"]
    assert [(e["index"], e["name"]) for e in scores["errors"]] == [(1, "refused"), (2, "no-turns")]
    assert "refuses" in scores["errors"][0]["reason"] and "turns" in scores["errors"][1]["reason"]
    # the enum admits only red: both good tasks are solved under constraints
    assert (scores["tasks"], scores["tasks_ok"], scores["task_errors"], scores["calls_ok"]) == (4, 2, 2, 2)
    assert "error in task 1 (refused)" in proc.stdout


def test_cli_evaluate_writes_both_splits_and_the_api_loops(tiny_server, tmp_path):
    """The OpenAI-API loop through the real server and `openai` client (a random model: it must
    still come back with a transcript per loop, scored, and the JSON for each split)."""
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "cedar.cli", "evaluate", "--server", tiny_server.url,
                           "--kinds", "api-loop", "--limit", "1", "--loop-requests", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["splits"]) == {"heldout", "in-template"}
    for split in report["splits"].values():
        loops = split["api_loop"]
        assert loops["loops"] == 1 and not loops["errors"] and loops["max_requests_per_turn"] == 2
        assert loops["ended"] + loops["hit_limit"] <= 1 and loops["solved"] <= loops["ended"]
        turns = loops["examples"][0]["turns"]
        assert turns and all(1 <= t["requests"] <= 2 for t in turns)
        assert all(t["hit_limit"] == (t["answer"] is None) for t in turns)
        assert all(len(t["results"]) <= len(t["calls"]) for t in turns)
        assert 0 <= loops["answers_stating_results"] <= loops["answers_after_results"] <= len(turns)
    assert "OpenAI-API loops:" in proc.stdout and "answers that state their results" in proc.stdout


def test_cli_evaluate_reports_calls_narrowed_to_stated_values_apart(tiny_server, tmp_path):
    """`--stated-values` runs the function-calling tasks again under narrowing, reported beside
    the plain figures: the same tasks, calls and values, and (a random model) no value made up;
    and the OpenAI-API loops with strict tools, then strict and narrowed tools, each apart."""
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "cedar.cli", "evaluate", "--server", tiny_server.url,
                           "--kinds", "function-calling", "api-loop", "--limit", "2", "--splits", "heldout",
                           "--stated-values", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    split = json.loads(out.read_text())["splits"]["heldout"]
    plain, stated = split["function_calling"], split["function_calling_stated"]
    assert (stated["tasks"], stated["calls"], stated["values"]) == (plain["tasks"], plain["calls"], plain["values"])
    assert stated["values_missed"]["stated_nowhere"] == 0 and not stated["errors"]
    assert len(stated["wrong_calls"]) == stated["calls"] - stated["calls_ok"]
    assert "narrowed to stated values (apart)" in proc.stdout
    loops = [split[k] for k in ("api_loop", "api_loop_strict", "api_loop_stated")]
    assert [lp["tools_mode"] for lp in loops] == ["free", "strict", "stated"]
    assert all(lp["loops"] == 2 and not lp["errors"] for lp in loops)
    assert "loops with strict tools (apart)" in proc.stdout
    assert "loops with strict tools narrowed to stated values (apart)" in proc.stdout


def test_a_limit_above_the_heldout_count_draws_more_tasks_and_keeps_the_first():
    """`cedar evaluate --limit N` draws N tasks a generator and split, past the corpus's held-out
    count too; the default draw is its first tasks, unchanged."""
    from cedar.drivers.cli import _split_tasks
    from cedar.training.corpus.build import HELDOUT

    n = HELDOUT["function-calling"]
    for split in ("heldout", "in-template"):
        default, _ = _split_tasks(0, split, ["function-calling"], None)
        more, _ = _split_tasks(0, split, ["api-loop"], n + 5)
        assert len(default) == n and len(more) == n + 5
        assert [t.to_json() for t in more[:n]] == [t.to_json() for t in default]
        assert len({json.dumps(t.inputs, sort_keys=True) for t in more}) == n + 5
