"""The attention layer of a decoder: hands q, k, v (or the raw qkv output) to the backend chosen by the runner."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext, QKVPrologue
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding


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

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        ctx: ForwardContext,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """qkv: the fused projection output [T, (num_heads + 2 * num_kv_heads) * head_dim] -> [T, num_heads * head_dim].

        Applies the per-head norms (both or neither), rotary, stores k and v and attends. A
        backend with ``forward_qkv`` (``FusedQKVBackend``: the Triton one) does all of it from
        qkv in one kernel plus attention; the others get the same steps as separate ops. The
        layer passes its rotary and norm modules rather than this layer owning them, so their
        parameters keep their Hugging Face names.
        """
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm go together: give both or neither")
        if q_norm is not None and k_norm is not None and q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm.eps {q_norm.eps} != k_norm.eps {k_norm.eps}: the fused kernel takes one eps")
        tokens = qkv.shape[0]
        fused = getattr(ctx.backend, "forward_qkv", None)
        if fused is not None:
            assert ctx.attn is not None, "decoder attention needs attention metadata"
            prologue = QKVPrologue(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                cos_sin_cache=rotary.cos_sin_cache,
                q_norm_weight=q_norm.weight if q_norm is not None else None,
                k_norm_weight=k_norm.weight if k_norm is not None else None,
                norm_eps=q_norm.eps if q_norm is not None else 0.0,
            )
            out = fused(qkv, positions, prologue, ctx.kv_caches[self.layer_idx], ctx.attn, self.scale)
            return out.reshape(tokens, self.num_heads * self.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        step_cache = ctx.attn.backend_cache if ctx.attn is not None else None
        if q_norm is not None and k_norm is not None:
            q = q_norm(q.reshape(tokens, self.num_heads, self.head_dim)).reshape(tokens, q_size)
            k = k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim)).reshape(tokens, kv_size)
        elif not qkv.is_cuda:
            # q and k lie side by side in qkv: rotated as one tensor, half the small ops (the CPU's cost).
            qk = rotary.rotate(positions, qkv[:, : q_size + kv_size], step_cache)
            return self.forward(qk[:, :q_size], qk[:, q_size:], v, ctx)
        q, k = rotary(positions, q.contiguous(), k.contiguous(), step_cache)
        return self.forward(q, k, v.contiguous(), ctx)
