"""Record Cedar's agent programs as token-level sessions for the load benchmark: every request an
agent sends (its prompt ids, the ids the server generated, when it was sent and answered), one
session per agent run, turned into a request graph (`cedar.drivers.bench.session_graph`)."""

from __future__ import annotations

import threading

from cedar.drivers.bench.session_graph import GraphRequest, Logged, graph_from_log
from cedar.frontend.endpoint import CedarEndpoint

from cedar.agents.runs import AGENTS, run_agent


class RecordingEndpoint(CedarEndpoint):
    """A `CedarEndpoint` that keeps every request's ids and times (tokens carried: ``input_ids``)."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        super().__init__(base_url, api_key=api_key, carry_tokens=True)
        self.log: list[Logged] = []
        self._log_lock = threading.Lock()

    def observe(self, s, data: dict, obj: dict, sent_s: float, done_s: float) -> None:
        entry = Logged(tuple(data["input_ids"]), tuple(obj.get("output_ids") or ()), sent_s, done_s,
                       getattr(s, "cedar_label", None) or "")
        with self._log_lock:
            self.log.append(entry)

    def take_log(self) -> list[Logged]:
        with self._log_lock:
            out, self.log = sorted(self.log, key=lambda r: r.sent_s), []
        return out


def record_agents(url: str, names: list[str] | None = None, api_key: str | None = None) -> tuple[list[GraphRequest], list[str]]:
    """Run each agent once (its example task) against the server at ``url``; (the request graph,
    one unit per agent in order, the agents' names)."""
    names = list(names or AGENTS)
    backend = RecordingEndpoint(url, api_key)
    sessions = []
    for name in names:
        backend.take_log()
        run_agent(name, backend)
        sessions.append(backend.take_log())
    return graph_from_log(sessions), names
