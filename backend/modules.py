"""Small building blocks of the CED model: RMSNorm, RoPE on a latent slice, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # (..., dim) -> (..., dim) float32
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (T, hidden) -> (T, hidden)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rope(x: Tensor, pos: Tensor, rope_dim: int, theta: float, inverse: bool = False) -> Tensor:
    """Rotate the last ``rope_dim`` dims of x by each row's position (rotate-half pairing).

    x: (T, ..., D) float32; pos: (T,) int64. ``inverse`` rotates by -pos: since K = V carries the
    rotation of its own position, the attention output is rotated back at the query's position.
    """
    half = rope_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)  # (half,)
    ang = pos.to(torch.float64)[:, None] * freqs[None, :]  # (T, half)
    cos, sin = ang.cos().float(), ang.sin().float()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    plain, rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim:]
    x1, x2 = rot[..., :half], rot[..., half:]
    return torch.cat([plain, x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
