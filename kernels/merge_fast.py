"""Merging two attention partials: the CPU fast path of ``merge_ref`` (one C++ pass instead of
eight elementwise torch calls per layer; the twin where the C++ kernels are not built)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_ext, merge_ref


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """As ``merge_ref.merge_states``: out_* (T, H, D) f32, lse_* (T, H) f32 -> (out, lse)."""
    if not (cpu_ext.available() and out_a.device.type == "cpu" and out_a.shape == out_b.shape
            and lse_a.shape == lse_b.shape and out_a.shape[:2] == lse_a.shape):
        return merge_ref.merge_states(out_a, lse_a, out_b, lse_b)
    return torch.ops.cedar_cpu.merge_states(out_a.float().contiguous(), lse_a.float().contiguous(),
                                            out_b.float().contiguous(), lse_b.float().contiguous())
