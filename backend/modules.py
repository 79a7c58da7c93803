"""Small building blocks of the CED model: RMSNorm, RoPE on a latent slice, SwiGLU MLP, and the
projections' linear on the fast CPU path with the weight copy each row count reads (packed for
few rows, bfloat16 for many under ``--weights bf16-matmul``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cedar.kernels import cpu_ext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fast = False  # NOTE: set by CEDModel on the fast CPU backend (one C++ call, no autograd)

    def forward(self, x: Tensor) -> Tensor:  # (..., dim) -> (..., dim) float32
        x = x.float()
        if inference_cpp(x, self.fast):
            return torch.ops.cedar_cpu.rms_norm(x.contiguous(), self.weight.detach(), self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


LINEAR_ROWS = 16  # NOTE: cedar_cpu::linear's few-row path (kLinearRows); more rows go to at::linear
BF16_MATMUL = "bf16_matmul"  # a projection weight's attribute: its bfloat16 copy, for matmuls of many rows
PACKED = "cedar_packed"  # a projection weight's attribute: ((its version counter, its data pointer), its pack_rows copy)


def pack_rows(w: Tensor) -> Tensor:
    """A projection weight (N, K) f32 -> (N / 8, K / 8, 8, 8) f32, block b's step s holding rows
    8b..8b+8's values 8s..8s+8 output by output (``cedar_cpu::linear_packed``'s layout: each block
    one sequential stream; its outputs the bits of the unpacked weight's). A copy, or ``w`` itself
    where N or K is not a multiple of 8 (2 index head weights: read unpacked)."""
    N, K = w.shape
    if N % 8 or K % 8 or w.dtype != torch.float32:
        return w
    return w.detach().view(N // 8, 8, K // 8, 8).permute(0, 2, 1, 3).contiguous()


def packed_weight(weight: Tensor, refresh: bool = False) -> Tensor:
    """``pack_rows(weight)``, made once and kept on the weight (attribute :data:`PACKED`): the
    copy every few-row matmul of it reads, a decode step's native call and a per-layer forward's
    alike. Made again when the weight changed in place (its version counter moved), when its
    storage is another (a ``.data`` swap, which leaves the counter too) or with ``refresh``
    (a write through ``.data``, which leaves the counter as it was)."""
    kept, stamp = getattr(weight, PACKED, None), (weight._version, weight.data_ptr())
    if refresh or kept is None or kept[0] != stamp:
        kept = (stamp, pack_rows(weight))
        setattr(weight, PACKED, kept)
    return kept[1]


def matmul_weight(weight: Tensor, rows: int) -> Tensor:
    """The weight a matmul of ``rows`` rows reads on the fast CPU path. Up to :data:`LINEAR_ROWS`
    rows: its packed copy (:func:`packed_weight`; ``cedar_cpu::linear`` runs its tiles, the bits
    of the unpacked weight's). More rows: ``weight`` itself, or, once ``cedar serve --weights
    bf16-matmul`` gave it a bfloat16 copy (attribute :data:`BF16_MATMUL`, set on the MLP's
    weights by ``native_step.round_to_bf16``), that copy: ``cedar_cpu::linear`` then multiplies
    in bf16 (the rows rounded to bf16, float32 sums). ``rows`` is a host fact (a shape), never a
    tensor's value."""
    if rows <= LINEAR_ROWS:
        return packed_weight(weight)
    bf16 = getattr(weight, BF16_MATMUL, None)
    return bf16 if bf16 is not None else weight


def linear(x: Tensor, layer: nn.Linear, fast: bool) -> Tensor:
    """layer(x) for x (T, in) -> (T, out); on the fast CPU backend's inference path through
    ``cedar_cpu::linear`` (a decode step's few rows at the memory's read speed, more rows by
    ``at::linear``, in bf16 under ``--weights bf16-matmul``: :func:`matmul_weight`): what the
    one-call C++ ops run, so the composition gives their bits."""
    if x.dim() == 2 and inference_cpp(x, fast):
        return torch.ops.cedar_cpu.linear(x, matmul_weight(layer.weight, x.shape[0]))
    return nn.functional.linear(x, layer.weight, layer.bias)  # NOTE: nn.Linear's forward (LMHead calls here)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fast = False  # NOTE: set by CEDModel on the fast CPU backend (see linear())

    def forward(self, x: Tensor) -> Tensor:  # (T, hidden) -> (T, hidden)
        f = self.fast
        return linear(nn.functional.silu(linear(x, self.gate_proj, f)) * linear(x, self.up_proj, f), self.down_proj, f)


class LMHead(nn.Linear):
    """The output projection, hidden -> vocab logits (no bias). On the fast CPU backend's inference
    path it multiplies through :func:`linear` as every other projection does (a decode step's few
    rows by ``cedar_cpu::linear``, the weight read once at the memory's speed; MKL's few-row GEMM
    reads it at about half that here, `cedar bench linear`); training and other backends take
    ``nn.Linear``'s path. SGLang's LogitsProcessor reaches the same forward (`served_model.HeadMethod`), so the
    served logits are the reference's bits."""

    fast = False  # NOTE: set by CEDModel on the fast CPU backend

    def forward(self, x: Tensor) -> Tensor:  # (T, hidden) -> (T, vocab)
        return linear(x, self, self.fast)


@dataclass(frozen=True)
class Rope:
    """RoPE of a set of rows as tables, computed once per forward and reused by every layer:
    ``x * cos + x[..., partner] * sin`` rotates the last ``rope_dim`` dims (rotate-half pairing);
    the plain dims have cos 1, sin 0. Bit-identical to rotating pair by pair."""

    cos: Tensor  # (T, D) float32
    sin: Tensor  # (T, D) float32, signed for the forward rotation
    sin_inverse: Tensor  # (T, D) float32, signed for the inverse rotation
    partner: Tensor  # (D,) int64 the dim each dim pairs with (itself for a plain dim)
    rope_dim: int
    fast: bool = False  # apply in one C++ call (the fast CPU backend, no autograd)

    def partners(self, x: Tensor) -> Tensor:
        """x[..., partner]; NOTE: where rope_dim divides D, swapping the halves of every
        rope_dim-wide chunk is one flip (the plain chunks' swaps meet sin = 0)."""
        D = x.shape[-1]
        if D % self.rope_dim:
            return x[..., self.partner]
        return x.reshape(*x.shape[:-1], D // self.rope_dim, 2, self.rope_dim // 2).flip(-2).reshape(x.shape)

    @classmethod
    def of(cls, pos: Tensor, dim: int, rope_dim: int, theta: float, fast: bool = False) -> "Rope":
        freqs, partner = rope_constants(dim, rope_dim, theta, pos.device)
        if inference_cpp(pos, fast, torch.int64):  # NOTE: the same ops in one C++ call (same bits)
            return cls(*torch.ops.cedar_cpu.rope_tables(pos, freqs, dim), partner, rope_dim, fast)
        ang = pos.to(torch.float64)[:, None] * freqs[None, :]  # (T, half)
        cos, sin = ang.cos().float(), ang.sin().float()
        ones = cos.new_ones(1, dim - rope_dim).expand(pos.shape[0], -1)
        zeros = cos.new_zeros(1, dim - rope_dim).expand(pos.shape[0], -1)
        return cls(torch.cat([ones, cos, cos], 1), torch.cat([zeros, -sin, sin], 1),
                   torch.cat([zeros, sin, -sin], 1), partner, rope_dim, fast)


_ROPE_CONSTANTS: dict = {}


def rope_constants(dim: int, rope_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """The frequencies ((rope_dim // 2,) float64) and the partner dims ((dim,) int64) of a RoPE
    geometry, made once per device: a decode step builds its tables from them in a few ops
    (they were a fifth of the ops of a step's RoPE tables)."""
    key = (dim, rope_dim, theta, str(device))
    if key not in _ROPE_CONSTANTS:
        half, plain = rope_dim // 2, dim - rope_dim
        freqs = theta ** (-torch.arange(half, dtype=torch.float64, device=device) / half)  # (half,)
        d = torch.arange(dim, device=device)
        partner = torch.where(d < plain, d, torch.where(d < plain + half, d + half, d - half))
        _ROPE_CONSTANTS[key] = (freqs, partner)
    return _ROPE_CONSTANTS[key]


def apply_rope(x: Tensor, pos: "Tensor | Rope", rope_dim: int, theta: float, inverse: bool = False) -> Tensor:
    """Rotate the last ``rope_dim`` dims of x by each row's position (rotate-half pairing).

    x: (T, ..., D) float32; pos: (T,) int64 or its :class:`Rope` tables. ``inverse`` rotates by
    -pos: since K = V carries the rotation of its own position, the attention output is rotated
    back at the query's position.
    """
    rope = pos if isinstance(pos, Rope) else Rope.of(pos, x.shape[-1], rope_dim, theta)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    sin = rope.sin_inverse if inverse else rope.sin
    if inference_cpp(x, rope.fast):
        return torch.ops.cedar_cpu.rope(x.contiguous(), rope.cos, sin, rope.partner)
    return x * rope.cos.view(shape) + rope.partners(x) * sin.view(shape)


def inference_cpp(x: Tensor, fast: bool, dtype: torch.dtype = torch.float32) -> bool:
    """Norms and RoPE in one C++ call each on a model of the fast CPU backend, where no autograd
    runs (training keeps the torch ops) and the C++ kernels are built."""
    return fast and not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == dtype \
        and cpu_ext.available()
