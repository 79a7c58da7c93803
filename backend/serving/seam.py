"""Cedar's one door into SGLang's plugin API: the pinned version, registering a hook module's
hooks with SGLang's ``HookRegistry``, applying them, and reading back from the live SGLang objects
whether each is installed. The server's hook modules (:mod:`sglang_hooks`, :mod:`tool_call_hooks`,
:mod:`seed_hooks`) and the frontend's interpreter fix (``cedar.frontend.executor_fix``) declare
their hooks as tables; only this module touches ``HookRegistry``.

A hook module declares ``TARGETS`` (name -> dotted SGLang path) and ``HOOKS`` (name -> (function,
"before" | "after" | "around")); :func:`register` reads ``TARGETS`` when it runs, so a test can
point one at a moved target.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from types import ModuleType

SGLANG_VERSION = "0.5.23"


def check_version(what: str, recheck: str) -> None:
    """Refuse another SGLang than the one ``what`` was written for (RuntimeError)."""
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"cedar's {what} were written for sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}: re-check {recheck}")


def register(module: ModuleType) -> None:
    """Register every hook of a hook module with SGLang's registry (applied by :func:`apply`, or
    by SGLang's ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name, (fn, kind) in module.HOOKS.items():
        HookRegistry.register(module.TARGETS[name], fn, getattr(HookType, kind.upper()))


def apply() -> None:
    """Patch every registered target now (idempotent: a patched target is skipped)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


@dataclasses.dataclass(frozen=True)
class HookStatus:
    """One hook target and whether Cedar's hook is live on it in this process."""

    name: str  # the key in its module's TARGETS, e.g. "validate"
    module: str  # the Cedar module that owns the hook, e.g. "seed_hooks"
    target: str  # the dotted SGLang path
    installed: bool


def status(*modules: ModuleType) -> list[HookStatus]:
    """Every hook target of these modules with whether it is installed, read from the live SGLang
    objects (not from what was registered).

    A target counts as installed when the attribute now at its path is a wrapper chain (SGLang's
    ``_wrap_fn``: ``functools.wraps`` plus ``__wrapped__``) one of whose wrappers closes over a
    function defined in the owning Cedar module. A target that no longer resolves, or whose
    attribute is SGLang's own function, is not installed.
    """
    out = []
    for module in modules:
        short = module.__name__.rsplit(".", 1)[-1]
        for name, target in module.TARGETS.items():
            out.append(HookStatus(name, short, target, installed(target, module.__name__)))
    return out


def installed(target: str, module_name: str) -> bool:
    """Is a hook of ``module_name`` live on ``target`` (see :func:`status`)?"""
    owner_path, attr = target.rsplit(".", 1)
    try:
        fn = inspect.getattr_static(pkgutil.resolve_name(owner_path), attr)
    except (ImportError, AttributeError, ValueError):
        return False
    fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value) and getattr(value, "__module__", None) == module_name:
                return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def missing_message(hooks: list[HookStatus]) -> str | None:
    """The refusal naming every hook that is not installed, or None when all are."""
    missing = [h for h in hooks if not h.installed]
    if not missing:
        return None
    names = ", ".join(f"{h.module}.{h.name} ({h.target})" for h in missing)
    return (f"cedar: {len(missing)} SGLang hook(s) did not install: {names}. SGLang logs a failing "
            f"hook and carries on; Cedar refuses to serve without it (see the log above for why, "
            f"and re-check the target against sglang {SGLANG_VERSION})")
