"""How the CED caches store rows: FP4 global rows / index keys and FP8 window rows, through the
kernel dispatch point, or plain float32 when quantization is switched off (the exactness tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cedar.kernels.dispatch import KernelSet
from cedar.kernels.formats import GLOBAL_ROW, INDEX_ROW, WINDOW_ROW

# kind -> (format, quantize op, dequantize op)
_KINDS = {
    "global": (GLOBAL_ROW, "fp4_quantize", "fp4_dequantize"),
    "index": (INDEX_ROW, "fp4_quantize", "fp4_dequantize"),
    "window": (WINDOW_ROW, "fp8_quantize", "fp8_dequantize"),
}


@dataclass(frozen=True)
class KVCodec:
    kernels: KernelSet
    quantize: bool = True

    def encode(self, kind: str, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """x: (N, D) f32 -> stored (codes uint8, scales uint8) or (x f32, None) when unquantized."""
        if not self.quantize:
            return x.float(), None
        fmt, q_op, _ = _KINDS[kind]
        return getattr(self.kernels, q_op)(x.float().contiguous(), fmt)

    def decode(self, kind: str, codes: Tensor, scales: Tensor | None) -> Tensor:
        """Stored rows -> (N, D) f32."""
        if scales is None:
            return codes
        fmt, _, dq_op = _KINDS[kind]
        return getattr(self.kernels, dq_op)(codes, scales, fmt, torch.float32)

    def roundtrip(self, kind: str, x: Tensor) -> Tensor:
        """What a reader of the cache sees for rows x: decode(encode(x))."""
        return self.decode(kind, *self.encode(kind, x))
