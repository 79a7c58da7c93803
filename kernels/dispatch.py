"""One dispatch point for every hot operation: Triton on CUDA, the fast CPU backend elsewhere,
and the pure-torch twins (the references every other backend is tested against).

The fast CPU backend (``*_fast.py``) runs C++ kernels (``csrc/cedar_cpu.cpp``, built by the
setup script) over per-forward plans (``plans.py``), falling back to batched torch where the C++
library could not be built; it lists only the ops it speeds up, the rest resolve to the twins.

The table below maps an operation name to ``"module:function"`` strings per backend; modules are
imported lazily on first use, so importing this file defines no kernel and has no side effect
(important on CPU, where ``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` runs).

A caller resolves its operations once into a :class:`KernelSet` (the model does this in its
constructor) and calls ``kernels.op_name(...)``. Tests and benchmarks pass ``backend=`` explicitly.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

# op name -> backend -> "module:function" (relative to cedar.kernels)
OPS: dict[str, dict[str, str]] = {
    "fp4_quantize": {"torch": "fp4_ref:fp4_quantize", "triton": "fp4_triton:fp4_quantize",
                     "fast": "codec_fast:fp4_quantize"},
    "fp4_dequantize": {"torch": "fp4_ref:fp4_dequantize", "triton": "fp4_triton:fp4_dequantize",
                       "fast": "codec_fast:fp4_dequantize"},
    "fp8_quantize": {"torch": "fp8_ref:fp8_quantize", "triton": "fp8_triton:fp8_quantize",
                     "fast": "codec_fast:fp8_quantize"},
    "fp8_dequantize": {"torch": "fp8_ref:fp8_dequantize", "triton": "fp8_triton:fp8_dequantize"},
    "window_attention": {
        "torch": "window_attention_ref:window_attention",
        "triton": "window_attention_triton:window_attention",
        "fast": "window_attention_fast:window_attention",
    },
    "indexer_scores": {
        "torch": "sparse_attention_ref:indexer_scores",
        "triton": "sparse_attention_triton:indexer_scores",
        "fast": "sparse_attention_fast:indexer_scores",
    },
    "topk_select": {
        "torch": "sparse_attention_ref:topk_select",
        "triton": "sparse_attention_triton:topk_select",
        "fast": "sparse_attention_fast:topk_select",
    },
    "indexer_topk": {
        "torch": "sparse_attention_ref:indexer_topk",
        "triton": "sparse_attention_triton:indexer_topk",
        "fast": "sparse_attention_fast:indexer_topk",
    },
    "sparse_attention": {
        "torch": "sparse_attention_ref:sparse_attention",
        "triton": "sparse_attention_triton:sparse_attention",
        "fast": "sparse_attention_fast:sparse_attention",
    },
    "merge_states": {"torch": "merge_ref:merge_states", "triton": "merge_triton:merge_states",
                     "fast": "merge_fast:merge_states"},
    "quantize_scatter_window": {
        "torch": "cache_write_ref:quantize_scatter_window",
        "triton": "cache_write_triton:quantize_scatter_window",
    },
    "quantize_scatter_global": {
        "torch": "cache_write_ref:quantize_scatter_global",
        "triton": "cache_write_triton:quantize_scatter_global",
    },
}

BACKENDS = ("torch", "triton", "fast")


def default_backend(device: str) -> str:
    """Triton where a CUDA device runs the model, the batched CPU ops (``*_fast``) elsewhere."""
    return "triton" if str(device).startswith("cuda") else "fast"


@functools.cache  # NOTE: every layer of every forward looks ops up through KernelSet
def resolve(op: str, backend: str) -> Callable:
    """Import and return the implementation of ``op`` for ``backend`` (raises on unknown names)."""
    if op not in OPS:
        raise KeyError(f"unknown kernel op {op!r}; known: {sorted(OPS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    # NOTE: the fast CPU backend only lists the ops it speeds up; the rest are the twins
    module_name, fn_name = OPS[op].get(backend, OPS[op]["torch"]).split(":")
    module = importlib.import_module(f"cedar.kernels.{module_name}")
    return getattr(module, fn_name)


@dataclass(frozen=True)
class KernelSet:
    """The operations one model instance calls, resolved once for one backend.

    ``overrides`` maps op name -> backend for a mixed set (e.g. Triton codecs, torch attention).
    """

    backend: str = "torch"
    overrides: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {self.backend!r}; choose one of {BACKENDS}")
        for op, b in self.overrides.items():
            if op not in OPS or b not in BACKENDS:
                raise ValueError(f"bad kernel override {op!r} -> {b!r}")

    @classmethod
    def for_device(cls, device: str, backend: str | None = None) -> "KernelSet":
        return cls(backend=backend or default_backend(device))

    def backend_of(self, op: str) -> str:
        return self.overrides.get(op, self.backend)

    def __getattr__(self, op: str) -> Callable:
        if op.startswith("_") or op not in OPS:
            raise AttributeError(op)
        return resolve(op, self.backend_of(op))
