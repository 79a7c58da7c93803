"""How ``cedar serve`` starts SGLang's own HTTP server with the CED model: the command line and
the environment, in one place (the CLI, the demo, the tests and the benchmarks all use it)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--dtype": "float32",
    "--max-total-tokens": "65536",  # NOTE: always bound the KV budget on CPU (else ~70% of RAM)
    "--max-running-requests": "16",
    "--chunked-prefill-size": "2048",
    "--mem-fraction-static": "0.5",
}


@dataclass(frozen=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    replay: str = "bounded"  # bounded | exact | off
    narrow: bool = True
    replay_per_request: bool = False
    snapshot_mb: float = 64.0
    extra: tuple[str, ...] = field(default_factory=tuple)  # further SGLang server flags

    def argv(self) -> list[str]:
        from ..config import CEDConfig

        page = CEDConfig.load(self.model).page_size
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
                "--host", self.host, "--port", str(self.port), "--page-size", str(page),
                "--json-model-override-args", json.dumps({"cedar_serving": {
                    "replay": self.replay, "narrow": self.narrow,
                    "replay_per_request": self.replay_per_request, "snapshot_mb": self.snapshot_mb}})]
        given = set(self.extra)
        for flag, value in CPU_DEFAULTS.items():
            if flag not in given and not any(e.startswith(flag + "=") for e in self.extra):
                if flag == "--device" and _has_cuda():
                    continue
                if flag in ("--device", "--attention-backend", "--dtype") and _has_cuda():
                    continue
                args += [flag, value]
        if self.replay == "off" and "--disable-radix-cache" not in given:
            args.append("--disable-radix-cache")
        return args + list(self.extra)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CEDAR_SGLANG_PLUGIN="1", SGLANG_EXTERNAL_MODEL_PACKAGE="cedar.backend.sglang_models")
        if not _has_cuda():
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
