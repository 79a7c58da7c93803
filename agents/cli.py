"""The agents' ``cedar`` subcommands: ``cedar agent run NAME ...``, ``cedar agent reuse`` and
``cedar demo`` (the ``cedar`` command itself is ``cedar.cli``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cedar.frontend.endpoint import RequestRecord
from cedar.frontend.server import DEFAULT_MODEL_DIR, connect
from cedar.frontend.session import format_table


def print_transcript(result: dict, out=sys.stdout) -> None:
    sessions = [result["session"]] if "session" in result else []
    while sessions:
        sess = sessions.pop(0)
        print(f"== {sess['agent']}", file=out)
        for i, st in enumerate(sess["steps"]):
            print(f"  [{i}] thought: {st['thought']!r}", file=out)
            print(f"      call: {st['tool']}({st['arguments']})", file=out)
            print(f"      -> {'' if st['ok'] else '(failed) '}{st['observation'][:160]!r}", file=out)
        print(f"  answer: {sess['answer']!r}", file=out)
        sessions += sess.get("children", [])
    if "scores" in result:
        sc = result["scores"]
        print(f"function calling: {sc['calls_ok']}/{sc['calls']} calls right, {sc['tasks_ok']}/{sc['tasks']} tasks "
              f"(names {sc['names_ok']}/{sc['calls']}, exact {sc['calls_exact']}/{sc['calls']}, "
              f"values {sc['values_ok']}/{sc['values']}; {sc['task_errors']} tasks in error)", file=out)
        for e in sc["errors"]:
            print(f"  error in task {e['index']} ({e['name']}): {e['reason']}", file=out)
        for name, calls in sc["per_task"].items():
            for c in calls:
                print(f"  {name} turn {c['turn']} call {c['index']}: {c['got_name']}({c['got_arguments']}) "
                      f"{'right' if c['ok'] else 'wrong'}", file=out)
    print(format_table([RequestRecord(**r) for r in result["records"]]), file=out)
    reuse = result["reuse"]
    print(f"prompt tokens cached: {reuse['cached_share']:.1%}; continuations restored from a snapshot: "
          f"{reuse['snapshot_continued']}/{reuse['continuations']} ({reuse['snapshot_share']:.1%})", file=out)


def _cmd_agent_run(args: argparse.Namespace) -> int:
    from .runs import load_task, run_agent

    task = load_task(args.name, args.task)
    if args.stated_values and args.name != "function-calling":
        print(f"cedar agent run: --stated-values is an option of function-calling, not of {args.name}", file=sys.stderr)
        return 2
    with connect(url=args.server, model=None if args.server else args.model) as backend:
        result = run_agent(args.name, backend, task, stated_values=args.stated_values)
    print_transcript(result)
    write_json(args.json, result)
    return 0


def write_json(path: str | None, obj) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1))
        print(f"wrote {path}")


def reuse_table(results: dict[str, dict]) -> str:
    head = f"{'agent':<17} {'steps':>5} {'requests':>8} {'cached share':>12} {'snapshot-continued':>18}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        reuse = r["reuse"]
        steps = len(r["session"]["steps"]) + sum(len(c["steps"]) for c in r["session"]["children"]) \
            if "session" in r else r["scores"]["calls"]
        lines.append(f"{name:<17} {steps:>5} {reuse['requests']:>8} {reuse['cached_share']:>12.1%} "
                     f"{reuse['snapshot_continued']:>7}/{reuse['continuations']:<3} {reuse['snapshot_share']:>6.1%}")
    return "\n".join(lines)


def _cmd_agent_reuse(args: argparse.Namespace) -> int:
    """Every agent once, on one server, in order: the prefix-reuse figures per agent."""
    from .runs import AGENTS, run_agent

    results = {}
    with connect(url=args.server, model=None if args.server else args.model) as backend:
        for name in AGENTS:
            results[name] = run_agent(name, backend)
            print(f"[agent reuse] {name}: {results[name]['reuse']}", flush=True)
    print(reuse_table(results))
    write_json(args.json, {k: {"reuse": v["reuse"], "records": v["records"]} for k, v in results.items()})
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.model))


def _add_server_choice(parser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server", default=None, help="URL of a running `cedar serve` (default: start one)")
    where.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model folder for the server it starts")


def register(sub) -> None:
    """Add `agent` and `demo` to the `cedar` command's subparsers."""
    from .runs import AGENTS

    agent = sub.add_parser("agent", help="run Cedar's agent programs against a server")
    verbs = agent.add_subparsers(dest="agent_command", required=True)
    run = verbs.add_parser("run", help="run one agent and print its transcript with per-request cache figures")
    run.add_argument("name", choices=sorted(AGENTS))
    _add_server_choice(run)
    run.add_argument("--task", default=None, help="task file (function-calling: a task list; others: one JSON object)")
    run.add_argument("--json", default=None, help="also write the whole result here")
    run.add_argument("--stated-values", action="store_true",
                     help="function-calling: narrow every free argument value to the values the conversation "
                          "states (PICARD-style; report its figures apart)")
    run.set_defaults(fn=_cmd_agent_run)
    reuse = verbs.add_parser("reuse", help="run every agent once on one server; print each one's cached share "
                                           "and snapshot-continued share")
    _add_server_choice(reuse)
    reuse.add_argument("--json", default=None, help="also write the figures and per-request records here")
    reuse.set_defaults(fn=_cmd_agent_reuse)

    demo = sub.add_parser("demo", help="the main job: serve the shipped model and run an agent session on it")
    demo.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    demo.set_defaults(fn=_cmd_demo)
