"""The ``cedar`` subcommands of the tools that drive a server (the ``cedar`` command itself is
``cedar.cli``):

  bench     benchmarks against the real server (``hits``: TTFT of prefix-cache hits; ``prefill``:
            decoder narrowing; ``engine``: Cedar vs other engines serving the same dims;
            ``trace``: trace replay; ``agents``: the agent-load matrix)
  soak      a long run of agent load with chaos and bad input, every phase checked (JSON report)
  evaluate  the model on generated tasks through a real server, held-out and in-template apart
  fidelity  bounded replay and narrowing vs exact on held-out sessions, served
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from cedar.agents.cli import write_json
from cedar.backend.cli import WEIGHT_CHOICES
from cedar.frontend.server import DEFAULT_MODEL_DIR, serve

from .bench import agents_cli


def _cmd_bench_hits(args: argparse.Namespace) -> int:
    from cedar.drivers.bench.hits import format_table, run_hits_benchmark
    from cedar.backend.serve_demo import ensure_model

    ensure_model(Path(args.model))
    grid = dict(prefixes=(256, 1024), new_tokens=(16,), concurrency=(1, 8), repeats=2) if args.quick else {}
    report = run_hits_benchmark(Path(args.model), Path(args.json), args.plot, **grid)
    print(format_table(report["table"]))
    print(f"[bench hits] {report['num_mismatches']} cached/replayed mismatches; {report['wall_s']} s; "
          f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_bench_prefill(args: argparse.Namespace) -> int:
    from cedar.drivers.bench.prefill import run_prefill_benchmark
    from cedar.backend.serve_demo import ensure_model

    ensure_model(Path(args.model))
    grid = dict(prompt_lens=(512, 2048), repeats=2) if args.quick else {}
    report = run_prefill_benchmark(Path(args.model), Path(args.json), args.plot, **grid)
    print(f"[bench prefill] {report['wall_s']} s; wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from cedar.drivers.bench.engine import QUICK, EngineGrid, format_table, run_engine_benchmark
    from cedar.backend.serve_demo import ensure_model

    ensure_model(Path(args.model))
    from cedar.backend.serving.planner import ServingFlags

    report = run_engine_benchmark(Path(args.model), Path(args.json), args.plot, QUICK if args.quick else EngineGrid(),
                                  flags=ServingFlags(weights=args.weights), peer_dtype=args.peer_dtype)
    print(format_table(report["table"]))
    print(f"[bench engine] {report['wall_s']} s; wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_soak(args: argparse.Namespace) -> int:
    from cedar.backend.serve_demo import ensure_model
    from cedar.drivers.soak.load import LoadConfig
    from cedar.drivers.soak.run import SoakConfig, run_soak

    ensure_model(Path(args.model))
    cfg = SoakConfig(minutes=args.minutes, phase_s=args.phase_s, seed=args.seed,
                     load=LoadConfig(sessions=args.sessions, hang_s=args.hang_s))
    report = run_soak(cfg, Path(args.model), Path(args.json), args.server, args.api_key)
    c = report["counts"]
    print(f"[soak] {report['wall_s']} s: sent {c['sent']}, finished {c['finished']}, aborted {c['aborted']}, "
          f"cut {c['disconnected']}, rejected {c['rejected']}, hung {c['hung']}, lost {c['lost']}; "
          f"{len(c['bad_input_failures'])} bad inputs without a 4xx; sentinels {report['sentinels_checked']} checked, "
          f"{len(report['sentinel_mismatches'])} wrong, {report['sentinels_retracted']} retracted (not compared); RSS growth {report['rss_growth_after_warmup_pct']}%")
    print(f"[soak] goals: {report['goals_met']}; wrote {args.json}")
    return 0 if report["passed"] else 1


def _add_soak(sub) -> None:
    s = sub.add_parser("soak", help="agent load with disconnects, aborts and bad input; integrity, RSS and "
                       "reference-checked sentinels after every phase")
    s.add_argument("--minutes", type=float, default=30.0)
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--server", default=None, help="soak this server (URL) instead of starting one")
    s.add_argument("--api-key", default=None, help="the server's --api-key (a started server gets it too)")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="the served model (sentinels' reference)")
    s.add_argument("--sessions", type=int, default=16, help="concurrent multi-turn sessions")
    s.add_argument("--phase-s", type=float, default=120.0, help="seconds of load between two checks")
    s.add_argument("--hang-s", type=float, default=180.0, help="a request with no answer within this is hung")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_soak)


def _cmd_bench_trace(args: argparse.Namespace) -> int:
    from cedar.drivers.bench.trace_replay import run_trace_benchmark
    from cedar.backend.serve_demo import ensure_model

    ensure_model(Path(args.model))
    r = run_trace_benchmark(Path(args.model), Path(args.trace), Path(args.json), args.limit, args.concurrency,
                            args.server, args.tokens_per_block)
    print(f"[bench trace] {r['requests']} requests at concurrency {r['concurrency']}: hit rate measured "
          f"{r['measured_hit_rate']:.4f}, theoretical {r['theoretical_hit_rate']:.4f} ({r['requests_off_theory']} "
          f"requests off); TTFT p50 {r['ttft_ms_p50']} ms; wrote {args.json}")
    return 0


def _cmd_bench_bound(args: argparse.Namespace) -> int:
    from cedar.backend.config import CEDConfig

    from .bench.bound import bound_report, read_bandwidth
    from .bench.common import machine_info

    cfg = CEDConfig.load(Path(args.model))
    bw = read_bandwidth(threads=args.threads)
    points = [(1, 512), (8, 512), (1, 8192), (8, 8192)]
    rows = bound_report(cfg, points, bw["gb_s"], args.weight_bytes)
    report = {"machine": machine_info(), "model": args.model, "weight_bytes": args.weight_bytes,
              "bandwidth": bw, "rows": rows}
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for r in rows:
        print(f"[bench bound] b{r['batch']} ctx{r['context']}: {r['total'] / 1e6:.2f} MB/step -> "
              f"{r['bound_tok_s']} tok/s at {bw['gb_s']} GB/s")
    return 0


def _cmd_bench_scheduler(args: argparse.Namespace) -> int:
    from .bench.common import machine_info
    from .bench.scheduler import plot_report, run_scheduler_bench

    try:
        cases = tuple(tuple(int(x) for x in c.split("x")) for c in args.cases.split(","))
        if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--cases: expected BATCHxCONTEXT[,BATCHxCONTEXT...], got {args.cases!r}") from None
    try:
        ttft = tuple(int(x) for x in args.ttft.split(",")) if args.ttft else ()
        if any(n < 1 for n in ttft):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--ttft: expected LENGTH[,LENGTH...] (prompt tokens), got {args.ttft!r}") from None
    from cedar.backend.serving.planner import ServingFlags

    report = run_scheduler_bench(Path(args.model), cases, args.tokens, args.repeats,
                                 flags=ServingFlags(weights=args.weights), ttft=ttft, ttft_requests=args.ttft_requests)
    report["machine"] = machine_info()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_report(report, Path(args.plot))
    print(f"[bench scheduler] wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_bench_step(args: argparse.Namespace) -> int:
    from .bench.common import machine_info
    from .bench.step import DEFAULT_CASES, QUICK_CASES, run_step_bench

    report = run_step_bench(Path(args.model), QUICK_CASES if args.quick else DEFAULT_CASES, args.repeats, args.threads)
    report["machine"] = machine_info()
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    for c in report["cases"]:
        top = ", ".join(f"{o['op']} {o['self_ms']}" for o in c["top_ops"][:3])
        print(f"[bench step] {c['case']}: {c['rows']} rows, {c['ms_median']} ms (best {c['ms_best']}), "
              f"{c['aten_ops']} ATen ops; top: {top}")
    return 0


def _cmd_bench_report(args: argparse.Namespace, run) -> int:
    try:
        report = run()
    except RuntimeError as e:
        print(f"cedar bench {args.bench_command}: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _cmd_bench_linear(args: argparse.Namespace) -> int:
    from .bench.linear import run_linear_bench

    return _cmd_bench_report(args, run_linear_bench)


def _cmd_bench_indexer(args: argparse.Namespace) -> int:
    from .bench.indexer_kernel import run_indexer_bench

    return _cmd_bench_report(args, run_indexer_bench)


def _cmd_bench_idle(args: argparse.Namespace) -> int:
    from .bench.idle import run_idle_probe

    return _cmd_bench_report(args, lambda: run_idle_probe(args.model, args.rounds))


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks against the real SGLang server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, fn, help_, quick in (
            ("hits", _cmd_bench_hits, "TTFT of cold requests vs prefix-cache hits (replay in-forward, per "
             "request, restored snapshot)", "prefixes 256,1024; 16 new tokens; C 1,8; 2 repeats"),
            ("prefill", _cmd_bench_prefill, "TTFT of cold prefills with decoder narrowing on vs off (+ analytic bound)",
             "prompts 512, 2048; 2 repeats"),
            ("engine", _cmd_bench_engine, "Cedar vs stock SGLang serving a random Llama of the same dims: decode "
             "tok/s, cold TTFT, hits", "decode b1/b4 at 256, cold 256/1024, a 1024 hit; Cedar then stock once")):
        s = kinds.add_parser(name, help=help_)
        s.add_argument("--json", required=True, help="write the report here")
        s.add_argument("--plot", default=None, help="also write a PNG bar chart here")
        s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
        s.add_argument("--quick", action="store_true", help=quick)
        if name == "engine":
            s.add_argument("--weights", choices=WEIGHT_CHOICES, default="float32",
                           help="Cedar's servers' --weights (bf16-matmul: see README)")
            s.add_argument("--peer-dtype", choices=["float32", "bfloat16"], default="float32",
                           help="the peers' (vLLM's, llama.cpp's) weights and compute; stock SGLang stays float32")
        s.set_defaults(fn=fn)
    s = kinds.add_parser("bound", help="the memory-bandwidth bound of a decode step: bytes it must read "
                         "over this machine's measured read bandwidth")
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--weight-bytes", type=int, default=4, help="4: float32 weights as served; 2: bf16")
    s.add_argument("--threads", type=int, default=2, help="threads of the bandwidth probe (the server's)")
    s.set_defaults(fn=_cmd_bench_bound)
    s = kinds.add_parser("step", help="the served step in process (no HTTP or scheduler): decode and hit "
                         "step times, ATen ops per step, the ops that take the time")
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--repeats", type=int, default=20)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--quick", action="store_true", help="short contexts, 3 cases")
    s.set_defaults(fn=_cmd_bench_step)
    s = kinds.add_parser("trace", help="replay a Mooncake or Cedar-session trace closed-loop: measured vs "
                         "theoretical prefix-hit rate, TTFT, output tok/s")
    s.add_argument("--trace", required=True, help="JSONL trace (docs/bench/traces.md)")
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--server", default=None, help="replay against this server (URL) instead of starting one")
    s.add_argument("--limit", type=int, default=None, help="the first N requests only")
    s.add_argument("--concurrency", type=int, default=1)
    s.add_argument("--tokens-per-block", type=int, default=4, help="token ids per trace block")
    s.set_defaults(fn=_cmd_bench_trace)
    for name, fn, help_ in (("linear", _cmd_bench_linear, "a decode step's matmuls alone: MKL vs cedar_cpu::linear "
                             "at 1 and 8 rows, beside the streaming read speed"),
                            ("indexer-kernel", _cmd_bench_indexer, "the indexer top-k kernel alone (a hit's rows, "
                             "a decode step), 1 thread, with selection checksums for A/B")):
        s = kinds.add_parser(name, help=help_)
        s.add_argument("--json", default=None, help="also write the figures here")
        s.set_defaults(fn=fn)
    s = kinds.add_parser("idle", help="what --sleep-on-idle changes: idle CPU, short-prompt latency, decode "
                         "(servers alternating)")
    s.add_argument("--model", default="models/cedar-tiny")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--json", default=None, help="also write the figures here")
    s.set_defaults(fn=_cmd_bench_idle)
    s = kinds.add_parser("scheduler", help="where a served decode step's time goes on SGLang's scheduler thread "
                         "(each server process samples its own stack): Cedar's forward, LM head, allocation, streaming")
    s.add_argument("--json", required=True, help="write the report here")
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    s.add_argument("--tokens", type=int, default=200, help="tokens each request decodes")
    s.add_argument("--repeats", type=int, default=2, help="unsampled runs a case (their median tok/s)")
    s.add_argument("--cases", default="1x512,8x512", help="BATCHxCONTEXT, comma-separated")
    s.add_argument("--ttft", default="", help="prompt lengths, comma-separated: cold requests one at a time, their "
                   "TTFT and the scheduler's busy time a request (a request's fixed costs; default: none)")
    s.add_argument("--ttft-requests", type=int, default=30, help="requests a --ttft length (each run, unsampled and "
                   "sampled)")
    s.add_argument("--plot", default=None, help="also write a PNG (the buckets' shares a case) here")
    s.add_argument("--weights", choices=WEIGHT_CHOICES, default="float32", help="the server's --weights")
    s.set_defaults(fn=_cmd_bench_scheduler)
    agents_cli.register(kinds)  # `cedar bench agents`: the agent-load matrix


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

    from cedar.training.corpus.build import HELDOUT, make_tasks
    from cedar.training.corpus.tasks import Task

    # NOTE: a limit above the corpus's held-out count draws more tasks the same way (deterministic per
    # index: the first ones unchanged), from the same templates; held-out ones stay held-out
    # (tests/test_corpus.py checks the splits' templates apart at 300 function-calling tasks)
    counts = {k: limit or n for k, n in HELDOUT.items() if not kinds or k in kinds}
    if "api-loop" in (kinds or ()) and "function-calling" not in counts:
        counts["function-calling"] = limit or HELDOUT["function-calling"]
    try:
        tasks = make_tasks(seed, split, counts)
    except (ValueError, KeyError) as e:
        return None, f"make_tasks does not draw split {split!r} ({e}); only the other split is reported"
    if "template" not in {f.name for f in fields(Task)}:
        return tasks, ("tasks carry no template: every split is drawn from the training templates (the "
                       "same generators, bug kinds, tool schemas and phrasings), so this split is in-template "
                       "in all but name")
    return tasks, None


def _evaluate_split(srv, model: str, tasks, tok, kinds, loop_requests: int, stated_values: bool = False) -> dict:
    from cedar.frontend.endpoint import CedarEndpoint

    from cedar.agents.api_loop import run_loops
    from cedar.drivers.evaluate import evaluate_tasks, stated_value_calls, template_of, unconstrained_calls

    agent_kinds = [t for t in tasks if not kinds or t.kind in kinds]
    out = evaluate_tasks(CedarEndpoint(srv.url), agent_kinds, tok)
    out["templates"] = sorted({template_of(t) for t in agent_kinds})
    fc = [t for t in tasks if t.agent == "function-calling"]
    if fc and (not kinds or "function-calling" in kinds):
        out["unconstrained_calls"] = unconstrained_calls(srv.url, model, fc)
        if stated_values:
            out["function_calling_stated"] = stated_value_calls(CedarEndpoint(srv.url), fc)
    if fc and (not kinds or "api-loop" in kinds):
        loops = [t.inputs for t in fc]
        out["api_loop"] = run_loops(srv.url, model, loops, loop_requests)
        if stated_values:  # NOTE: the constraint alone, then with the narrowing: each one's share apart
            for mode in ("strict", "stated"):
                out[f"api_loop_{mode}"] = run_loops(srv.url, model, loops, loop_requests, tools_mode=mode)
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
                                                                        args.loop_requests, args.stated_values)
                                                        if tasks else {})}
    print(evaluate_table(report))
    write_json(args.json, report)
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
            if fc.get("values_by_kind"):
                lines.append("  values by kind: " + ", ".join(f"{kind} {d['ok']}/{d['values']}"
                                                            for kind, d in sorted(fc["values_by_kind"].items())))
            if fc.get("values_missed"):
                lines.append("  values not right: " + ", ".join(f"{why.replace('_', ' ')} {n}"
                                                              for why, n in fc["values_missed"].items()))
        st = r.get("function_calling_stated")
        if st and st["tasks"]:
            lines.append(f"function calls narrowed to stated values (apart): names {st['names_ok']}/{st['calls']}, "
                         f"arguments {st['calls_ok']}/{st['calls']}, exact {st['calls_exact']}/{st['calls']}, "
                         f"values {st['values_ok']}/{st['values']}; tasks {st['tasks_ok']}/{st['tasks']} "
                         f"({st['task_errors']} in error)")
            lines.append("  values not right: " + ", ".join(f"{why.replace('_', ' ')} {n}"
                                                          for why, n in st["values_missed"].items()))
        u = r.get("unconstrained_calls")
        if u:
            lines.append(f"unconstrained tool calls: {u['valid']}/{u['calls']} valid ({u['valid_share']:.1%}), "
                         f"{u['right']}/{u['calls']} right ({u['right_share']:.1%}); {u['made']} made, "
                         f"{u['valid_of_made']:.1%} of them valid; {u['turns_in_one_reply']}/{u['turns']} turns "
                         f"in one reply")
            if any(u["invalid"].values()):
                lines.append("  not valid: " + ", ".join(f"{why} {n}" for why, n in u["invalid"].items() if n))
        for key, what in (("api_loop", ""), ("api_loop_strict", " with strict tools (apart)"),
                          ("api_loop_stated", " with strict tools narrowed to stated values (apart)")):
            lines += _loop_lines(r.get(key), what)
        if r.get("errors"):
            lines.append(f"errors: {len(r['errors'])} tasks (see the JSON)")
    return "\n".join(lines)


def _loop_lines(lp: dict | None, what: str) -> list[str]:
    """The lines of one `run_loops` block (none where the split has none)."""
    if not lp:
        return []
    lines = [f"OpenAI-API loops{what}: {lp['ended']}/{lp['loops']} end on their own, {lp['hit_limit']} hit the "
             f"limit of {lp['max_requests_per_turn']}, {lp['solved']} solved; calls right "
             f"{lp['calls_right']}/{lp['calls_expected']} ({lp['calls_made']} made); turns at the "
             f"limit: {lp['turns_at_limit_after_right_calls']} after right calls, "
             f"{lp['turns_at_limit_after_errors']} after errors"]
    if "answers_after_results" in lp:
        lines.append(f"  answers that state their results: {lp['answers_stating_results']}/"
                     f"{lp['answers_after_results']} (turns answered after results worth reporting)")
    return lines


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from cedar.backend.config import CEDConfig
    from cedar.backend.tokenizer import ROLE_MARKERS, special_token_ids

    from cedar.training.corpus.build import HELDOUT, make_tasks, run_scripted, token_sessions
    from cedar.drivers.fidelity import fidelity_report, plot, table_markdown

    tasks = make_tasks(args.seed, "heldout", HELDOUT)
    texts = [{"kind": t.kind, "text": x} for t in tasks if t.kind in ("react", "recall", "coding", "function-calling")
             for x in run_scripted(t)[:1]]
    with _server(args) as srv:
        info = _model_info(srv.url)
        tok_dir = Path(info["tokenizer_path"])
        sessions = token_sessions(texts, tok_dir)
        vocab = CEDConfig.load(tok_dir).vocab_size
        # NOTE: N of each kind: recall's value lies beyond 4W, where bounded replay could hurt
        react = [t for kind in ("react", "recall") for t in [x for x in tasks if x.kind == kind][: args.tasks]]
        report = fidelity_report(srv, sessions, special_token_ids(tok_dir)[ROLE_MARKERS["assistant"]], vocab,
                                 args.per_bucket, tasks=react, seed=args.seed)
    report["command"] = "cedar " + " ".join(sys.argv[1:])
    print(table_markdown(report))
    write_json(args.json, report)
    if args.plot:
        plot(report, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0




def _add_server_choice(parser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server", default=None, help="URL of a running `cedar serve` (default: start one)")
    where.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model folder for the server it starts")


def register(sub) -> None:
    """Add `bench`, `soak`, `evaluate` and `fidelity` to the `cedar` command's subparsers."""
    _add_bench(sub)
    _add_soak(sub)
    ev = sub.add_parser("evaluate", help="the model on generated tasks through a real server (greedy): the "
                                         "held-out and the in-template split apart")
    _add_server_choice(ev)
    ev.add_argument("--seed", type=int, default=0, help="corpus seed the held-out split is drawn from")
    ev.add_argument("--kinds", nargs="*", default=None,
                    help="task generators to run, and 'api-loop' for the OpenAI-API loops (default: all)")
    ev.add_argument("--limit", type=int, default=None,
                    help="this many tasks per generator and split (default: the corpus's held-out count per "
                         "generator, 15-40; a larger limit draws more from the same templates)")
    ev.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS),
                    help="splits to run, each reported apart (default: both)")
    ev.add_argument("--loop-requests", type=int, default=6,
                    help="OpenAI-API loops: at most this many requests per user turn")
    ev.add_argument("--stated-values", action="store_true",
                    help="also run the function-calling tasks with every free argument value narrowed to the "
                         "values the conversation states (reported apart: function_calling_stated), and the "
                         "OpenAI-API loops with strict tools, then strict tools narrowed before each request "
                         "(api_loop_strict, api_loop_stated)")
    ev.add_argument("--json", default=None)
    ev.set_defaults(fn=_cmd_evaluate)

    fid = sub.add_parser("fidelity", help="bounded replay and narrowing vs exact on held-out sessions, served")
    _add_server_choice(fid)
    fid.add_argument("--json", required=True)
    fid.add_argument("--plot", default=None)
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--per-bucket", type=int, default=12, help="cases per hit-length bucket")
    fid.add_argument("--tasks", type=int, default=20, help="held-out ReAct and recall tasks (N of each) run per mode (0: none)")
    fid.set_defaults(fn=_cmd_fidelity)

