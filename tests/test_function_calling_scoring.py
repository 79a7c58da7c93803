"""Scoring of the function-calling runner and its task-file checks (no server)."""

import json

import pytest

from cedar.agents.function_calling import TaskFileError, load_tasks, same_json, score_call, summarize


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
