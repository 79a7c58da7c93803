"""How ``cedar serve`` starts SGLang's own HTTP server with the CED model: the command line and
the environment, in one place (the CLI, the demo, the tests and the benchmarks all use it)."""

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
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
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
        if self.flags.kernels == "triton" and not _has_cuda():
            env.setdefault("TRITON_INTERPRET", "1")  # NOTE: Triton runs on CPU only interpreted
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
