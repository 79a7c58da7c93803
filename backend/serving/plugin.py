"""SGLang general plugin (entry point ``sglang.srt.plugins: cedar``), run in every SGLang
process: registers the ``cedar_ced`` config class and installs Cedar's hooks. It does nothing
unless ``CEDAR_SGLANG_PLUGIN=1`` (set by ``cedar serve`` and the test fixtures), so installing
Cedar never changes how SGLang serves other models."""

from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("CEDAR_SGLANG_PLUGIN") != "1":
        return
    from .hf_config import register_auto_config
    from .sglang_hooks import install

    register_auto_config()
    install()
