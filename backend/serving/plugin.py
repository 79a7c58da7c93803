"""SGLang general plugin (entry point ``sglang.srt.plugins: cedar``), run in every SGLang
process: registers the ``cedar_ced`` config class and installs Cedar's hooks. It does nothing
unless ``CEDAR_SGLANG_PLUGIN=1`` (set by ``cedar serve`` and the test fixtures), so installing
Cedar never changes how SGLang serves other models.

A hook that does not install stops the process. SGLang 0.5.23's ``load_plugins`` catches any
``Exception`` from a plugin, and ``HookRegistry.apply_hooks`` any from a target, logs it and
carries on, so a moved target (tool calls, request validation, seed) would serve silently
without its fix. ``register`` therefore applies the hooks itself right after registering them
(``apply_hooks`` is idempotent: ``load_plugins``' own call then skips the patched targets), reads
the live objects back (``sglang_hooks.hook_status``) and raises ``SystemExit`` naming each missing
hook: ``SystemExit`` is not an ``Exception``, so it passes SGLang's handlers and the process exits
non-zero with the message. The first process to load plugins is the server's main one, before any
scheduler starts, so ``cedar serve`` (and ``ServerProcess.start``, which reports a child's exit
with its log) refuses to start. Checked in the process itself rather than over
``/get_server_info`` after start, because that reports the scheduler process only, and a server
that is up already serves requests.

NOTE: applying early means a plugin loaded after Cedar's that hooks one of Cedar's targets is
skipped there (the target is already patched); no such plugin is installed with Cedar.
"""

from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("CEDAR_SGLANG_PLUGIN") != "1":
        return
    from . import seam, stack_sampler
    from .hf_config import register_auto_config
    from .sglang_hooks import hook_status, install, missing_hooks_message

    register_auto_config()
    if os.environ.get(stack_sampler.ENV):  # `cedar bench scheduler`: each process samples itself
        stack_sampler.start(os.environ[stack_sampler.ENV])
    try:
        install()
    except Exception as e:  # SGLang's loader would log it and carry on
        raise SystemExit(f"cedar: installing the SGLang hooks failed: {e}") from e
    seam.apply()
    problem = missing_hooks_message(hook_status())
    if problem is not None:
        raise SystemExit(problem)
