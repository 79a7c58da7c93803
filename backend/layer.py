"""One CED layer: K = V MQA latent attention (window branch + optional global branch) and a
dense SwiGLU MLP. The layer owns weights and projections; *where keys come from* (a whole
sequence, explicit caches, SGLang's pools) is the caller's :class:`~cedar.backend.forward.KeySource`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .compressor import Compressor
from .config import CEDConfig, Role
from .modules import RMSNorm, SwiGLU, apply_rope


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

    def queries(self, hn: Tensor, pos: Tensor) -> Tensor:
        """hn: (T, hidden) normed input; pos: (T,) -> q (T, H, D) f32 with RoPE on the slice."""
        q = self.wq(hn).float().view(hn.shape[0], self.num_heads, self.latent)
        return apply_rope(q, pos, self.rope_dim, self.rope_theta)

    def window_kv(self, hn: Tensor, pos: Tensor) -> Tensor:
        """(T, hidden), (T,) -> this layer's window K = V rows (T, D) f32, after RoPE."""
        return apply_rope(self.kv_norm(self.wkv(hn)), pos, self.rope_dim, self.rope_theta)

    def index_queries(self, hn: Tensor) -> tuple[Tensor, Tensor]:
        """(T, hidden) -> indexer queries (T, Hi, Di) f32 and head weights (T, Hi) f32."""
        q = self.wq_index(hn).float().view(hn.shape[0], self.index_num_heads, self.index_dim)
        w = self.w_index(hn).float() / math.sqrt(self.index_num_heads * self.index_dim)
        return q, w

    def attn_output(self, o: Tensor, pos: Tensor) -> Tensor:
        """o: (T, H, D) merged attention output -> (T, hidden): inverse RoPE (K = V carried the
        keys' rotation), then the output projection."""
        o = apply_rope(o, pos, self.rope_dim, self.rope_theta, inverse=True)
        return self.wo(o.reshape(o.shape[0], self.num_heads * self.latent))
