"""One helper that points programs at a Cedar server: an existing one (`url`), or `cedar serve`
started in a child process for the duration of a `with` block (`model`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from cedar.backend.cli import DEFAULT_MODEL_DIR  # noqa: F401 - the shipped model, re-exported

from .endpoint import CedarEndpoint



@contextlib.contextmanager
def connect(url: str | None = None, model: str | Path | None = None, serve_args: tuple[str, ...] = (),
            api_key: str | None = None, log_path: Path | None = None) -> Iterator[CedarEndpoint]:
    """`with connect(url=...) as backend:` or `with connect(model=DIR) as backend:`."""
    if url:
        yield CedarEndpoint(url.rstrip("/"), api_key=api_key)
        return
    with serve(model, serve_args, log_path) as srv:
        yield CedarEndpoint(srv.url, api_key=api_key)


@contextlib.contextmanager
def serve(model: str | Path | None = None, serve_args: tuple[str, ...] = (),
          log_path: Path | None = None):
    """`cedar serve` on `model` (default: the shipped model) in a child process for the block;
    yields the `ServerProcess` (`.url`, `.post(path, payload)`)."""
    from cedar.backend.serve_demo import ensure_model
    from cedar.backend.serving.launch import ServeConfig
    from cedar.backend.serving.process import ServerProcess, free_port

    model_dir = Path(model or DEFAULT_MODEL_DIR)
    ensure_model(model_dir)
    cfg = ServeConfig(model=str(model_dir), port=free_port(), extra=tuple(serve_args))
    with ServerProcess(cfg, log_path=log_path) as srv:
        yield srv
