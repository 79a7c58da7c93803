"""The ``cedar`` command. Each subcommand belongs to the layer that owns it and is loaded only
when it runs (``cedar serve`` imports the serving core, not the trainer); no entry point is
needed, so the command is complete in a plain checkout (``python -m cedar.cli``).

``COMMANDS``: subcommand -> (module with a ``register(subparsers)``, one line of help).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "init-model": ("cedar.backend.cli", "write a random-init model in HF format"),
    "memory": ("cedar.backend.cli", "cache byte accounting of a geometry"),
    "generate": ("cedar.backend.cli", "greedy generation through the reference path"),
    "serve": ("cedar.backend.cli", "serve a CED model with SGLang's HTTP server (unknown flags go to SGLang)"),
    "serve-demo": ("cedar.backend.cli", "serve the shipped model and send it raw requests (cache counters)"),
    "agent": ("cedar.agents.cli", "run Cedar's agent programs against a server"),
    "demo": ("cedar.agents.cli", "the main job: serve the shipped model and run an agent session on it"),
    "train": ("cedar.training.cli", "build the agent corpus and train a CED model on CPU (resumable)"),
    "curriculum": ("cedar.training.cli", "a synthetic copy or recall curriculum from a model folder (resumable)"),
    "stage": ("cedar.training.cli", "keep a finished training stage in the repo (float16) or restore it"),
    "bench": ("cedar.drivers.cli", "benchmarks against the real SGLang server"),
    "soak": ("cedar.drivers.cli", "agent load with disconnects, aborts and bad input, checked every phase"),
    "evaluate": ("cedar.drivers.cli", "the model on generated tasks through a real server, held-out apart"),
    "fidelity": ("cedar.drivers.cli", "bounded replay and narrowing vs exact on held-out sessions, served"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "usage: cedar <command> [...]   (cedar <command> --help documents each)\n\ncommands:\n" + "\n".join(lines)


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``command``'s module (only that module is imported)."""
    p = argparse.ArgumentParser(prog="cedar", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    importlib.import_module(COMMANDS[command][0]).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"cedar: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    parser = build_parser(argv[0])
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args, extra) if getattr(args, "passthrough", False) else args.fn(args)
    except ValueError as e:  # bad geometry, bad model folder, bad weights: a clear message
        print(f"cedar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
