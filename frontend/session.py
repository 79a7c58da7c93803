"""Session state of a multi-turn agent loop: the steps taken, the answer, and what the cache did
for each request (from `CedarEndpoint.records`), for transcripts and the prefix-reuse figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .endpoint import RequestRecord


@dataclass(frozen=True)
class Step:
    """One tool step: what the model wrote and what came back."""

    thought: str
    tool: str
    arguments: str
    observation: str
    ok: bool


@dataclass
class Session:
    """Written by one agent program (its `steps` and `answer`), read by the CLI and the tests."""

    agent: str
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    children: list["Session"] = field(default_factory=list)  # subagent sessions

    def add(self, step: Step) -> None:
        self.steps.append(step)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ReuseFigures:
    """Prefix reuse over a list of requests: the share of prompt tokens served from the cache,
    and the share of continuations (requests whose prompt extends an earlier request's prompt
    and output, as the next turn of a session does) that restored a snapshot and replayed
    nothing."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    continuations: int
    snapshot_continued: int

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def snapshot_share(self) -> float:
        return self.snapshot_continued / self.continuations if self.continuations else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "cached_share": round(self.cached_share, 4),
                "snapshot_share": round(self.snapshot_share, 4)}


def reuse_figures(records: list[RequestRecord]) -> ReuseFigures:
    nexts = [r for r in records if r.continues]
    continuations = len(nexts)
    restored = sum(r.restored_tokens > 0 and r.replayed_tokens == 0 for r in nexts)
    return ReuseFigures(len(records), sum(r.prompt_tokens for r in records),
                        sum(r.cached_tokens for r in records), continuations, restored)


def format_table(records: list[RequestRecord]) -> str:
    """One line per request: label, prompt / cached / replayed / restored / new / output tokens."""
    head = f"{'#':>3} {'state':<18} {'prompt':>6} {'cached':>6} {'replay':>6} {'restor':>6} {'new':>5} {'out':>4}"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(records):
        lines.append(f"{i:>3} {r.label[:18]:<18} {r.prompt_tokens:>6} {r.cached_tokens:>6} {r.replayed_tokens:>6} "
                     f"{r.restored_tokens:>6} {r.new_tokens:>5} {r.completion_tokens:>4}")
    return "\n".join(lines)
