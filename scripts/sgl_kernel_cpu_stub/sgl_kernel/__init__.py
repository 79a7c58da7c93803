"""CPU stand-in for SGLang's CUDA-only ``sgl_kernel`` (see shared/notes/sglang-cpu.md).

SGLang's CPU code imports a few names from ``sgl_kernel`` at module level; with this stand-in
every layer takes its ``forward_native`` path. Any call raises ``NotImplementedError``.
"""

CEDAR_CPU_STANDIN = True
__version__ = "0.0.0+cedar.cpu"


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available on CPU (cedar stand-in)")

    fn.__name__ = name
    return fn


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
