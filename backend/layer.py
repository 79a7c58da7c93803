"""One CED layer: K = V MQA latent attention (window branch + optional global branch) and a
dense SwiGLU MLP. The layer owns weights and projections; *where keys come from* (a whole
sequence, explicit caches, SGLang's pools) is the caller's :class:`~cedar.backend.forward.KeySource`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .compressor import Compressor
from .config import CEDConfig, Role
from .modules import RMSNorm, Rope, SwiGLU, apply_rope, inference_cpp, linear, matmul_weight


@dataclass(frozen=True)
class Projections:
    """A layer's projections of its input rows (T of them)."""

    q: Tensor  # (T, H, D) f32 queries, RoPE'd
    kv: Tensor | None  # (T, D) f32 window K = V rows, normed and RoPE'd; None where the caller has them
    iq: Tensor | None  # (T, Hi, Di) f32 indexer queries; None without an indexer
    iw: Tensor | None  # (T, Hi) f32 indexer head weights


class CEDLayer(nn.Module):
    def __init__(self, cfg: CEDConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id, self.role = layer_id, cfg.role(layer_id)
        self.num_heads, self.latent = cfg.num_attention_heads, cfg.kv_latent_dim
        self.rope_dim, self.rope_theta = cfg.rope_dim, cfg.rope_theta
        self.scale = 1.0 / math.sqrt(cfg.kv_latent_dim)
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.kv_latent_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, cfg.kv_latent_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_latent_dim, eps)
        self.sink = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        self.wo = nn.Linear(cfg.num_attention_heads * cfg.kv_latent_dim, cfg.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.compressor = (Compressor(cfg.hidden_size, cfg.kv_latent_dim, cfg.index_head_dim,
                                      cfg.compress_ratios[layer_id], cfg.rope_dim, cfg.rope_theta, eps)
                           if self.role is Role.FULL else None)
        self.has_indexer = self.role in (Role.FULL, Role.REINDEX)
        if self.has_indexer:
            self.index_num_heads, self.index_dim = cfg.index_num_heads, cfg.index_head_dim
            self.wq_index = nn.Linear(cfg.hidden_size, cfg.index_num_heads * cfg.index_head_dim, bias=False)
            self.w_index = nn.Linear(cfg.hidden_size, cfg.index_num_heads, bias=False)

    def project(self, h: Tensor, rope: Rope, window: bool = True) -> Projections:
        """h: (T, hidden) layer input -> its queries, window rows (``window``) and indexer
        queries. NOTE: on the fast CPU backend's inference path, one C++ call running the same
        ATen ops (bit-identical; a decode step spends its time in per-call overhead)."""
        if inference_cpp(h, rope.fast):
            idx, T = self.has_indexer, h.shape[0]
            q, kv, iq, iw = torch.ops.cedar_cpu.layer_project(
                h, self.attn_norm.weight, self.attn_norm.eps, matmul_weight(self.wq.weight, T), self.num_heads, rope.cos,
                rope.sin, rope.partner, matmul_weight(self.wkv.weight, T) if window else None,
                self.kv_norm.weight if window else None, matmul_weight(self.wq_index.weight, T) if idx else None,
                matmul_weight(self.w_index.weight, T) if idx else None, self.index_num_heads if idx else 0,
                self._index_div if idx else 1.0)
            return Projections(q, kv if window else None, iq if idx else None, iw if idx else None)
        hn = self.attn_norm(h)
        iq, iw = self.index_queries(hn) if self.has_indexer else (None, None)
        return Projections(self.queries(hn, rope), self.window_kv(hn, rope) if window else None, iq, iw)

    def tail(self, h: Tensor, o: Tensor, rope: Rope) -> Tensor:
        """h: (T, hidden) layer input, o: (T, H, D) merged attention output -> the layer's output
        (T, hidden): h + the output projection, then + the MLP of its norm (one C++ call on the
        fast CPU backend's inference path, bit-identical)."""
        if inference_cpp(h, rope.fast):
            T, m = h.shape[0], self.mlp  # NOTE: only the MLP's weights carry bf16 copies (matmul_weight)
            return torch.ops.cedar_cpu.layer_tail(h, o, rope.cos, rope.sin_inverse, rope.partner,
                                                  matmul_weight(self.wo.weight, T),
                                                  self.mlp_norm.weight, self.mlp_norm.eps,
                                                  matmul_weight(m.gate_proj.weight, T),
                                                  matmul_weight(m.up_proj.weight, T), matmul_weight(m.down_proj.weight, T))
        h = h + self.attn_output(o, rope)
        return h + self.mlp(self.mlp_norm(h))

    def queries(self, hn: Tensor, pos: Tensor) -> Tensor:
        """hn: (T, hidden) normed input; pos: (T,) -> q (T, H, D) f32 with RoPE on the slice."""
        q = linear(hn, self.wq, self.attn_norm.fast).float().view(hn.shape[0], self.num_heads, self.latent)
        return apply_rope(q, pos, self.rope_dim, self.rope_theta)

    def window_kv(self, hn: Tensor, pos: Tensor) -> Tensor:
        """(T, hidden), (T,) -> this layer's window K = V rows (T, D) f32, after RoPE."""
        return apply_rope(self.kv_norm(linear(hn, self.wkv, self.attn_norm.fast)), pos, self.rope_dim, self.rope_theta)

    def index_queries(self, hn: Tensor) -> tuple[Tensor, Tensor]:
        """(T, hidden) -> indexer queries (T, Hi, Di) f32 and head weights (T, Hi) f32."""
        q = linear(hn, self.wq_index, self.attn_norm.fast).float().view(hn.shape[0], self.index_num_heads, self.index_dim)
        return q, linear(hn, self.w_index, self.attn_norm.fast).float() / self._index_div

    @property
    def _index_div(self) -> float:
        return math.sqrt(self.index_num_heads * self.index_dim)

    def attn_output(self, o: Tensor, pos: Tensor) -> Tensor:
        """o: (T, H, D) merged attention output -> (T, hidden): inverse RoPE (K = V carried the
        keys' rotation), then the output projection."""
        o = apply_rope(o, pos, self.rope_dim, self.rope_theta, inverse=True)
        return linear(o.reshape(o.shape[0], self.num_heads * self.latent), self.wo, self.attn_norm.fast)
