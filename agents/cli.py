"""`cedar agent run NAME ...` and `cedar demo`, registered into the `cedar` command through the
`cedar.commands` entry point (so `cedar.backend` never imports `cedar.agents`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from cedar.frontend.endpoint import RequestRecord
from cedar.frontend.server import DEFAULT_MODEL_DIR, connect, serve
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
    with connect(url=args.server, model=None if args.server else args.model) as backend:
        result = run_agent(args.name, backend, task)
    print_transcript(result)
    _write_json(args.json, result)
    return 0


def _write_json(path: str | None, obj) -> None:
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
    _write_json(args.json, {k: {"reuse": v["reuse"], "records": v["records"]} for k, v in results.items()})
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.model))


def _heldout(seed: int, kinds: list[str] | None, limit: int | None):
    from .corpus.build import HELDOUT, make_tasks

    counts = {k: min(n, limit or n) for k, n in HELDOUT.items() if not kinds or k in kinds}
    return make_tasks(seed, "heldout", counts)


@contextlib.contextmanager
def _server(args):
    """A running server (--server URL) or `cedar serve` on --model for the block; yields an
    object with `.url` and `.post(path, payload)`."""
    if args.server:
        from cedar.backend.serving.process import ServerClient

        yield ServerClient(args.server)
        return
    with serve(args.model) as srv:
        yield srv


def _model_info(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/get_model_info", timeout=60) as r:
        return json.loads(r.read())


SPLITS = ("heldout", "in-template")


def _split_tasks(seed: int, split: str, kinds: list[str] | None, limit: int | None):
    """(tasks, note) for one split of `cedar evaluate`; tasks None where the corpus cannot draw
    the split (the note says why)."""
    from dataclasses import fields

    from .corpus.build import HELDOUT, make_tasks
    from .corpus.tasks import Task

    counts = {k: min(n, limit or n) for k, n in HELDOUT.items() if not kinds or k in kinds}
    if "api-loop" in (kinds or ()) and "function-calling" not in counts:
        counts["function-calling"] = min(HELDOUT["function-calling"], limit or HELDOUT["function-calling"])
    try:
        tasks = make_tasks(seed, split, counts)
    except (ValueError, KeyError) as e:
        return None, f"make_tasks does not draw split {split!r} ({e}); only the other split is reported"
    if "template" not in {f.name for f in fields(Task)}:
        return tasks, ("tasks carry no template: every split is drawn from the training templates (the "
                       "same generators, bug kinds, tool schemas and phrasings), so this split is in-template "
                       "in all but name")
    return tasks, None


def _evaluate_split(srv, model: str, tasks, tok, kinds, loop_requests: int) -> dict:
    from cedar.frontend.endpoint import CedarEndpoint

    from .api_loop import run_loops
    from .evaluate import evaluate_tasks, template_of, unconstrained_calls

    agent_kinds = [t for t in tasks if not kinds or t.kind in kinds]
    out = evaluate_tasks(CedarEndpoint(srv.url), agent_kinds, tok)
    out["templates"] = sorted({template_of(t) for t in agent_kinds})
    fc = [t for t in tasks if t.agent == "function-calling"]
    if fc and (not kinds or "function-calling" in kinds):
        out["unconstrained_calls"] = unconstrained_calls(srv.url, model, fc)
    if fc and (not kinds or "api-loop" in kinds):
        out["api_loop"] = run_loops(srv.url, model, [t.inputs for t in fc], loop_requests)
    return out


def _cmd_evaluate(args: argparse.Namespace) -> int:
    """Each split apart, through a real server: task success per kind and per template, function
    calling per call, recall, unconstrained calls, OpenAI-API loops; a failed task is an error."""
    from tokenizers import Tokenizer

    drawn = {split: _split_tasks(args.seed, split, args.kinds, args.limit) for split in args.splits}
    with _server(args) as srv:
        info = _model_info(srv.url)
        tok = Tokenizer.from_file(str(Path(info["tokenizer_path"]) / "tokenizer.json"))
        report = {"model": info["model_path"], "seed": args.seed, "command": "cedar " + " ".join(sys.argv[1:]),
                  "splits": {}}
        for split, (tasks, note) in drawn.items():
            print(f"[evaluate] split {split}: {len(tasks or [])} tasks" + (f" ({note})" if note else ""), flush=True)
            report["splits"][split] = {"note": note, **(_evaluate_split(srv, info["model_path"], tasks, tok, args.kinds,
                                                                        args.loop_requests) if tasks else {})}
    print(evaluate_table(report))
    _write_json(args.json, report)
    return 0


def evaluate_table(report: dict) -> str:
    """The figures of `cedar evaluate`, one block per split."""
    lines = []
    for split, r in report["splits"].items():
        lines.append(f"== {split}" + (f"  (note: {r['note']})" if r.get("note") else ""))
        for kind, k in r.get("per_kind", {}).items():
            extra = f"  fixed line present {k['fixed_line_present']}/{k['tasks']}" if "fixed_line_present" in k else ""
            extra += f"  distance {k['distance_tokens']}" if "distance_tokens" in k else ""
            lines.append(f"{kind:<17} {k['ok']:>3}/{k['tasks']:<3} {k['success']:.1%}  errors {k['errors']}{extra}")
        fc = r.get("function_calling")
        if fc and fc["tasks"]:
            lines.append(f"function calls: names {fc['names_ok']}/{fc['calls']}, "
                         f"arguments {fc['calls_ok']}/{fc['calls']}, "
                         f"exact {fc['calls_exact']}/{fc['calls']}, values {fc['values_ok']}/{fc['values']}; "
                         f"tasks {fc['tasks_ok']}/{fc['tasks']} ({fc['task_errors']} in error)")
        u = r.get("unconstrained_calls")
        if u:
            lines.append(f"unconstrained tool calls: {u['valid']}/{u['calls']} valid ({u['valid_share']:.1%}), "
                         f"{u['right']}/{u['calls']} right ({u['right_share']:.1%})")
        lp = r.get("api_loop")
        if lp:
            lines.append(f"OpenAI-API loops: {lp['ended']}/{lp['loops']} end on their own, "
                         f"{lp['hit_limit']} hit the limit "
                         f"of {lp['max_requests_per_turn']}, {lp['solved']} solved; calls right "
                         f"{lp['calls_right']}/{lp['calls_expected']} ({lp['calls_made']} made)")
        if r.get("errors"):
            lines.append(f"errors: {len(r['errors'])} tasks (see the JSON)")
    return "\n".join(lines)


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from cedar.backend.config import CEDConfig
    from cedar.backend.tokenizer import ROLE_MARKERS, special_token_ids

    from .corpus.build import run_scripted, token_sessions
    from .fidelity import fidelity_report, plot, table_markdown

    tasks = _heldout(args.seed, None, None)
    texts = [{"kind": t.kind, "text": x} for t in tasks if t.kind in ("react", "recall", "coding", "function-calling")
             for x in run_scripted(t)[:1]]
    with _server(args) as srv:
        info = _model_info(srv.url)
        tok_dir = Path(info["tokenizer_path"])
        sessions = token_sessions(texts, tok_dir)
        vocab = CEDConfig.load(tok_dir).vocab_size
        react = [t for t in tasks if t.kind in ("react", "recall")][: args.tasks]
        report = fidelity_report(srv, sessions, special_token_ids(tok_dir)[ROLE_MARKERS["assistant"]], vocab,
                                 args.per_bucket, tasks=react, seed=args.seed)
    report["command"] = "cedar " + " ".join(sys.argv[1:])
    print(table_markdown(report))
    _write_json(args.json, report)
    if args.plot:
        plot(report, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


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
    run.set_defaults(fn=_cmd_agent_run)
    reuse = verbs.add_parser("reuse", help="run every agent once on one server; print each one's cached share "
                                           "and snapshot-continued share")
    _add_server_choice(reuse)
    reuse.add_argument("--json", default=None, help="also write the figures and per-request records here")
    reuse.set_defaults(fn=_cmd_agent_reuse)

    ev = sub.add_parser("evaluate", help="the model on generated tasks through a real server (greedy): the "
                                         "held-out and the in-template split apart")
    _add_server_choice(ev)
    ev.add_argument("--seed", type=int, default=0, help="corpus seed the held-out split is drawn from")
    ev.add_argument("--kinds", nargs="*", default=None,
                    help="task generators to run, and 'api-loop' for the OpenAI-API loops (default: all)")
    ev.add_argument("--limit", type=int, default=None, help="at most this many tasks per generator and split")
    ev.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS),
                    help="splits to run, each reported apart (default: both)")
    ev.add_argument("--loop-requests", type=int, default=6,
                    help="OpenAI-API loops: at most this many requests per user turn")
    ev.add_argument("--json", default=None)
    ev.set_defaults(fn=_cmd_evaluate)

    fid = sub.add_parser("fidelity", help="bounded replay and narrowing vs exact on held-out sessions, served")
    _add_server_choice(fid)
    fid.add_argument("--json", required=True)
    fid.add_argument("--plot", default=None)
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--per-bucket", type=int, default=12, help="cases per hit-length bucket")
    fid.add_argument("--tasks", type=int, default=20, help="held-out ReAct/recall tasks run per mode (0: none)")
    fid.set_defaults(fn=_cmd_fidelity)

    demo = sub.add_parser("demo", help="the main job: serve the shipped model and run an agent session on it")
    demo.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    demo.set_defaults(fn=_cmd_demo)
