"""``cedar bench trace``: replay a request trace (:mod:`traces`) closed-loop against a server and
set the measured prefix-hit rate beside the trace's theoretical one.

Closed loop (:mod:`session_graph`): ``concurrency`` users; a Mooncake trace's requests are taken
in file order (a user sends the next when its last one is answered); a session trace runs each
root session on one user, its requests in order, a subagent started after the parent request that
precedes it in the file and joined before the parent's next request, think time kept (capped).
At concurrency 1 the server sees the trace's own order, so with a pool that holds the working
set the measured rate must equal the theoretical one (:mod:`load_metrics`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import machine_info
from .load_metrics import run_metrics
from .session_graph import GraphRequest, replay_graph
from .traces import TokenMap, TraceRequest, load_trace


def graph_from_trace(trace: list[TraceRequest], tokens: TokenMap) -> list[GraphRequest]:
    """The trace as a request graph: a Mooncake request is a unit of its own; a session trace's
    unit is a root session with its subagents. A session's requests follow one another; a
    subagent's first request follows the parent request before it in the file, and the parent's
    next request waits for the subagent's last one (subagents of one parent request run side by
    side). Prompts are the mapped blocks in full (the root session's marker is in them)."""
    if all(r.session is None for r in trace):
        return [GraphRequest(i, tuple(tokens.prompt(r)), tokens.output_len(r), think_s=r.think_s)
                for i, r in enumerate(trace)]
    root_of: dict[str, str] = {}
    last: dict[str, int] = {}  # session -> its latest request
    joins: dict[str, list[str]] = {}  # session -> subagents started since its latest request
    units: dict[str, int] = {}
    out: list[GraphRequest] = []
    for i, r in enumerate(trace):
        if r.session is None:
            raise ValueError(f"request {i}: a session trace needs a session on every request")
        new_session = r.session not in root_of
        root = root_of.setdefault(r.session, root_of.get(r.parent, r.parent) if r.parent else r.session)
        deps = []
        if r.session in last:
            deps.append(last[r.session])
        elif r.parent is not None:
            if r.parent not in last:
                raise ValueError(f"request {i}: subagent {r.session!r} before any request of its parent {r.parent!r}")
            deps.append(last[r.parent])
        if new_session and r.parent is not None:
            joins.setdefault(r.parent, []).append(r.session)
        deps += [last[sub] for sub in joins.pop(r.session, [])]
        out.append(GraphRequest(units.setdefault(root, len(units)), tuple(tokens.prompt(r, root)), tokens.output_len(r),
                                deps=tuple(sorted(set(deps))), think_s=r.think_s))
        last[r.session] = i
    return out


def replay_trace(url: str, trace: list[TraceRequest], tokens: TokenMap, page_size: int, concurrency: int = 1,
                 think_cap_s: float = 1.0) -> dict:
    answered, wall = replay_graph(url, graph_from_trace(trace, tokens), concurrency, think_cap_s=think_cap_s)
    return {"concurrency": concurrency, **run_metrics(answered, wall, page_size)}


def run_trace_benchmark(model_dir: Path, trace_path: Path, out_json: Path, limit: int | None, concurrency: int,
                        server_url: str | None = None, tokens_per_block: int = 4) -> dict:
    import sglang

    from cedar.backend.config import CEDConfig
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    cfg = CEDConfig.load(model_dir)
    trace = load_trace(trace_path, limit)
    tokens = TokenMap(cfg.vocab_size, tokens_per_block)
    srv = None
    if server_url is None:
        serve = ServeConfig(model=str(model_dir), port=free_port(), extra=("--sleep-on-idle",))
        srv = ServerProcess(serve, log_path=Path(f"/tmp/cedar-trace-{serve.port}.log")).start()
        server_url = srv.url
    try:
        result = replay_trace(server_url, trace, tokens, cfg.page_size, concurrency)
    finally:
        if srv is not None:
            srv.stop()
    report = {"what": "closed-loop trace replay: measured vs theoretical (infinite cache) prefix-hit rate",
              "trace": str(trace_path), "limit": limit, "tokens_per_block": tokens_per_block,
              "machine": machine_info(), "sglang_version": sglang.__version__, "model": str(model_dir),
              "server_argv": srv.cfg.argv() if srv is not None else None, **result}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    return report
