"""The attention layer of a decoder: hands q, k, v to the backend chosen by the runner."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext


class Attention(nn.Module):
    """Paged causal attention for one layer; holds no weights, only its place in the cache list."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: [T, num_heads * head_dim], k and v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]."""
        tokens = q.shape[0]
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        assert ctx.attn is not None, "decoder attention needs attention metadata"
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn, self.scale)
        return out.reshape(tokens, self.num_heads * self.head_dim)
