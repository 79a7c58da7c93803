"""Scoring of the function-calling runner and its task-file checks (no server)."""

import json

import pytest

from cedar.agents.function_calling import (TaskError, TaskFileError, load_tasks, read_tasks, same_json, score_call,
                                           summarize, whole_value)


def test_same_json():
    assert same_json({"a": 1, "b": [1, 2.0]}, {"b": [1.0, 2], "a": 1.0})
    assert not same_json({"a": 1}, {"a": 1, "b": 2})
    assert not same_json({"a": True}, {"a": 1})
    assert not same_json({"a": "1"}, {"a": 1})
    assert not same_json([1, 2], [2, 1])


def test_score_call_and_summary():
    exp = {"name": "f", "arguments": {"x": 1}}
    right = score_call(0, 0, exp, "f", '{"x": 1.0}')
    wrong_args = score_call(0, 1, exp, "f", '{"x": 2}')
    wrong_name = score_call(1, 0, exp, "g", '{"x": 1}')
    broken = score_call(1, 1, exp, "f", '{"x": ')
    assert right.ok and not wrong_args.ok and wrong_args.name_ok
    assert not wrong_name.name_ok and not wrong_name.arguments_ok and not broken.ok
    s = summarize({"t1": [right, wrong_args], "t2": [right], "t3": [wrong_name, broken]})
    assert (s["calls"], s["calls_ok"], s["names_ok"], s["tasks"], s["tasks_ok"]) == (5, 2, 4, 3, 1)
    assert s["call_accuracy"] == round(2 / 5, 4) and s["task_accuracy"] == round(1 / 3, 4)


def test_values_are_broken_down_by_kind():
    exp = {"name": "f", "arguments": {"n": 3, "x": 1.5, "s": "a b", "e": ["u"], "b": False}}
    got = score_call(0, 0, exp, "f", '{"n": 3, "x": 1.25, "s": "a b", "e": ["v"], "b": 0}')
    other_tool = score_call(0, 1, exp, "g", json.dumps(exp["arguments"]))  # right values, wrong tool
    kinds = summarize({"t": [got, other_tool]})["values_by_kind"]
    assert kinds == {"integer": {"values": 2, "ok": 1}, "number": {"values": 2, "ok": 0},
                     "string": {"values": 2, "ok": 1}, "array": {"values": 2, "ok": 0},
                     "bool": {"values": 2, "ok": 0}}
    assert sum(d["ok"] for d in kinds.values()) == got.values_ok + other_tool.values_ok


def test_values_not_right_are_told_apart_by_where_they_came_from():
    """A wrong value stated in the conversation before the call is another span copied; one stated
    nowhere is made up; a missing one is left out; a wrong tool's values are all its own kind.
    Every expected value is right or missed once."""
    context = ('<|user|>Book it for 4417 guests, room "Nain", and the id is 12.5 or 7.<|end|>'
               '<|tool|>{"status": "ok", "ref": "Ostra"}<|end|>')
    exp = {"name": "f", "arguments": {"n": 4417, "s": "Nain", "x": 7, "r": "Ostra", "a": [1, 2], "o": "q"}}
    got = score_call(0, 0, exp, "f", '{"n": 4417, "s": "Ostra", "x": 12.5, "r": "Ostr", "a": [12.5, 441]}',
                     context=context)
    # s, x: copied from elsewhere; r: "Ostr" is inside "Ostra", not whole; a: 441 inside 4417; o: left out
    assert got.values_ok == 1
    assert got.misses == {"stated_elsewhere": 2, "stated_nowhere": 2, "left_out": 1}
    other_tool = score_call(0, 1, exp, "g", json.dumps(exp["arguments"]), context=context)
    assert other_tool.misses == {"wrong_tool": 6}
    s = summarize({"t": [got, other_tool]})
    assert s["values_missed"] == {"left_out": 1, "stated_elsewhere": 2, "stated_nowhere": 2, "wrong_tool": 6}
    assert sum(s["values_missed"].values()) == s["values"] - s["values_ok"]
    # a value stated only inside a longer number or as part of a decimal is not stated whole
    assert whole_value("5").search("-5 15 5.3 x5") is None and whole_value("5").search("it is 5.")
    assert whole_value("-5").search("t-5") is None and whole_value("-5").search("at -5 C")


def test_task_files_load_and_bad_ones_are_refused(tmp_path):
    assert [t["name"] for t in load_tasks("tests/data/fc_forced.json")] == ["colors", "levels"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(t) for t in load_tasks("tests/data/fc_forced.json")))
    assert len(load_tasks(jsonl)) == 2
    bad = [{"name": "x", "tools": [{"type": "function", "function": {"name": "f"}}],
            "turns": [{"user": "u", "expected": [{"name": "g", "arguments": {}}]}]}]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(TaskFileError, match="names no listed tool"):
        load_tasks(p)
    p.write_text("{not json")
    with pytest.raises(TaskFileError, match="neither JSON nor JSONL"):
        load_tasks(p)


def test_per_call_figures_name_arguments_exact_values():
    exp = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
    optional = frozenset({"city"})
    omitted = score_call(0, 0, exp, "get_weather", '{"city": "Oslo"}', optional)
    assert omitted.ok and not omitted.exact and (omitted.values, omitted.values_ok) == (2, 1)
    required = score_call(0, 0, exp, "get_weather", '{"city": "Oslo"}', frozenset({"city", "unit"}))
    assert not required.ok and required.name_ok
    wrong_value = score_call(0, 0, exp, "get_weather", '{"city": "Oslo", "unit": "fahrenheit"}', optional)
    assert wrong_value.name_ok and not wrong_value.ok and wrong_value.values_ok == 1
    extra = score_call(0, 0, exp, "get_weather", '{"city": "Oslo", "unit": "celsius", "days": 3}', optional)
    assert not extra.ok and not extra.exact and extra.values_ok == 2
    exact = score_call(0, 0, exp, "get_weather", '{"unit": "celsius", "city": "Oslo"}', optional)
    assert exact.ok and exact.exact and exact.values_ok == 2
    wrong_name = score_call(0, 0, exp, "get_time", '{"city": "Oslo", "unit": "celsius"}', optional)
    assert not wrong_name.ok and not wrong_name.exact and wrong_name.values_ok == 0
    s = summarize({"t1": [omitted, exact], "t2": [wrong_value]},
                  [TaskError(2, "t3", "a tool the runner refuses: ...")])
    assert (s["tasks"], s["tasks_ok"], s["tasks_exact"], s["task_errors"]) == (3, 1, 0, 1)
    assert (s["calls"], s["calls_ok"], s["calls_exact"], s["values"], s["values_ok"]) == (3, 2, 1, 6, 4)
    assert s["errors"] == [{"index": 2, "name": "t3", "reason": "a tool the runner refuses: ...", "stage": "check"}]


def good_task(name):
    return {"name": name, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}}],
            "turns": [{"user": f"x for {name}", "expected": [{"name": "f", "arguments": {"x": 3}}]}]}


def test_a_task_file_with_bad_tasks_keeps_the_good_ones(tmp_path):
    refused = good_task("refused")
    refused["tools"][0]["function"]["parameters"]["properties"]["x"] = {}  # no type: unbounded
    malformed = good_task("malformed")
    malformed["turns"][0] = {"user": 3, "expected": []}
    items = [good_task("a"), refused, malformed, "not a task", good_task("a"), good_task("b")]
    p = tmp_path / "tasks.json"
    p.write_text(json.dumps(items))
    ts = read_tasks(p)
    assert [t["name"] for t in ts.tasks] == ["a", "b"] and ts.indices == [0, 5]
    assert [(e.index, e.name) for e in ts.errors] == [(1, "refused"), (2, "malformed"), (3, None), (4, "a")]
    assert "refuses" in ts.errors[0].reason and "turns[0]" in ts.errors[1].reason and "task 0" in ts.errors[3].reason
    with pytest.raises(TaskFileError, match=r"\[1\]: .*refuses"):
        load_tasks(p)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps(good_task("a")) + "\n{broken\n" + json.dumps(good_task("b")) + "\n")
    ts = read_tasks(jsonl)
    assert [t["name"] for t in ts.tasks] == ["a", "b"] and [(e.index, e.name) for e in ts.errors] == [(1, None)]
    assert "not JSON" in ts.errors[0].reason


def test_the_runner_scores_the_good_tasks_beside_a_bad_one():
    from cedar.training.corpus.scripted import ScriptedBackend
    from cedar.agents.runs import run_function_calling

    tasks = [good_task("a"), good_task("bad"), good_task("b")]
    del tasks[1]["turns"]
    backend = ScriptedBackend({("x for a", None): ['{"x":3}'], ("x for b", None): ['{"x":4}']})
    sc = run_function_calling(backend, tasks)["scores"]
    assert (sc["tasks"], sc["tasks_ok"], sc["task_errors"], sc["calls"], sc["calls_ok"]) == (3, 1, 1, 2, 1)
    assert sc["errors"][0]["index"] == 1 and sc["errors"][0]["name"] == "bad"
    assert [c["ok"] for c in sc["per_task"]["b"]] == [False]


def test_the_evaluation_sums_the_kinds_over_tasks_and_counts_a_failed_run_as_a_task():
    from cedar.drivers.evaluate import Outcome, function_calling_figures

    exp = {"name": "f", "arguments": {"n": 3, "s": "a"}}
    runs = [summarize({"a": [score_call(0, 0, exp, "f", '{"n": 3, "s": "b"}')]}),
            summarize({"b": [score_call(0, 0, exp, "f", '{"n": 4, "s": "a"}')]})]
    outcomes = [Outcome(i, "function-calling", "t", False, {"scores": r}) for i, r in enumerate(runs)]
    outcomes.append(Outcome(2, "function-calling", "t", False, {"error": "the server went away"}))
    fig = function_calling_figures(outcomes)
    assert fig["values_by_kind"] == {"integer": {"values": 2, "ok": 1}, "string": {"values": 2, "ok": 1}}
    assert (fig["tasks"], fig["task_errors"], fig["values_ok"], fig["values"]) == (3, 1, 2, 4)
    assert fig["values_missed"] == {"left_out": 0, "stated_elsewhere": 0, "stated_nowhere": 2, "wrong_tool": 0}
