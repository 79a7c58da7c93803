"""How ``cedar serve`` starts SGLang's own HTTP server with the CED model: the command line and
the environment, in one place (the CLI, the demo, the tests and the benchmarks all use it).

``python -m cedar.backend.serving.launch SGLANG_FLAGS...`` is the server's entry point: what
``sglang serve`` runs for a language model (plugins, server args, ``run_server``, the process
tree killed at exit).
NOTE: not ``python -m sglang.launch_server`` (deprecated in 0.5.23: it warns at every start) and
not ``sglang serve`` itself (it first probes whether the model is a diffusion pipeline, which
imports SGLang's diffusion registry: ~8 s of CPU per start)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

from ..chat_template import TOOL_CALL_PARSER
from .planner import ServingFlags

CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--dtype": "float32",
    "--max-total-tokens": "65536",  # NOTE: always bound the KV budget on CPU (else ~70% of RAM)
    "--max-running-requests": "16",
    "--chunked-prefill-size": "2048",
    "--mem-fraction-static": "0.5",
}
# Tool calling and constrained output, on every device (the agents rely on them):
# NOTE: without the whitespace flag a weak model spends a constrained call's whole budget on
# free JSON whitespace (xgrammar and llguidance honour it; outlines has its own pattern flag).
TOOL_DEFAULTS = {"--tool-call-parser": TOOL_CALL_PARSER}
TOOL_SWITCHES = ("--constrained-json-disable-any-whitespace",)
# SGLang's SGLANG_TOOL_STRICT_LEVEL=2 (PARAMETER): `required` and named calls are constrained by
# the function's JSON schema, not only by the call's tags (level 0 leaves arguments free).
TOOL_ENV = {"SGLANG_TOOL_STRICT_LEVEL": "2"}
GPU_CHOOSES = {"--device", "--attention-backend", "--dtype"}  # left to SGLang where CUDA runs
# NOTE: SGLang 0.5.23 warns on every CPU start, from module imports in each of its processes, that
# AWQ / GGUF quantization (CUDA-only) and Triton are unavailable on this platform; true on any CPU
# host and nothing Cedar uses, so a CPU server's Python processes ignore exactly these (prefixes).
CPU_IGNORED_WARNINGS = ("ignore:Only CUDA:UserWarning",
                        "ignore:Triton is not supported on current platform:UserWarning")


@dataclass(frozen=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    flags: ServingFlags = field(default_factory=ServingFlags)  # travel in the HF config
    extra: tuple[str, ...] = field(default_factory=tuple)  # further SGLang server flags
    threads: int | None = None  # CPU threads of the server's torch (OMP_NUM_THREADS); None: torch's default

    @property
    def api_key(self) -> str | None:
        """The value of an ``--api-key`` among the SGLang flags, if any."""
        extra = list(self.extra)
        return extra[extra.index("--api-key") + 1] if "--api-key" in extra[:-1] else None

    def argv(self) -> list[str]:
        from ..config import CEDConfig

        page = CEDConfig.load(self.model).page_size
        args = [sys.executable, "-m", "cedar.backend.serving.launch", "--model-path", self.model,
                "--host", self.host, "--port", str(self.port), "--page-size", str(page),
                "--json-model-override-args",
                json.dumps({"cedar_serving": dataclasses.asdict(self.flags)})]
        given = {e.split("=", 1)[0] for e in self.extra}
        cuda = _has_cuda()
        valued = {**{f: v for f, v in CPU_DEFAULTS.items() if not (cuda and f in GPU_CHOOSES)}, **TOOL_DEFAULTS}
        args += [a for flag, value in valued.items() if flag not in given for a in (flag, value)]
        args += [flag for flag in TOOL_SWITCHES if flag not in given]
        if self.flags.replay == "off" and "--disable-radix-cache" not in given:
            args.append("--disable-radix-cache")
        return args + list(self.extra)

    def env(self) -> dict[str, str]:
        env = {**TOOL_ENV, **os.environ}  # the caller's environment wins
        env.update(CEDAR_SGLANG_PLUGIN="1", SGLANG_EXTERNAL_MODEL_PACKAGE="cedar.backend.sglang_models")
        if not _has_cuda():
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONWARNINGS"] = ",".join(filter(None, (*CPU_IGNORED_WARNINGS, env.get("PYTHONWARNINGS"))))
        if self.flags.kernels == "triton" and not _has_cuda():
            env.setdefault("TRITON_INTERPRET", "1")  # NOTE: Triton runs on CPU only interpreted
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str]) -> None:
    """Run SGLang's HTTP server with ``argv`` (SGLang's flags, as :meth:`ServeConfig.argv` writes
    them); kill the server's child processes whatever ends it."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
