"""Attention over whole prompts on the GPU through our Triton kernels: the pooling models' backend
there (same contract as ``PrefillAttentionBackend``, the torch one, which stays the CPU path).

The step's prompts are packed back to back without padding; ``meta.query_start_loc`` gives each
one's rows and ``meta.max_query_len`` bounds their lengths. ``attend`` runs the varlen kernel
(``kernels/triton/varlen_attention.py``) on q, k, v as they come, strided views of the qkv
output included, bidirectionally for BERT or causally for decoders. ``forward_qkv`` (the
``FusedQKVBackend`` method decoder layers use) first runs the fused qkv prologue (q/k norms,
rotary) from the qkv output, storing k and v into a scratch "cache" of one token per block whose
slot t is token t: a packed ``[T, kv_heads, head_dim]`` pair that the varlen kernel reads
directly. So a decoder layer's attention is two launches, whatever the step's lengths.

Nothing here syncs with the device. Triton is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.attention.metadata import AttentionMetadata, QKVPrologue

if TYPE_CHECKING:
    import torch


class VarlenAttentionBackend:
    """Whole-prompt attention for CUDA tensors (or any device under ``TRITON_INTERPRET=1``)."""

    def __init__(self) -> None:
        from tokenmill.kernels.triton.qkv_prologue import qkv_prologue
        from tokenmill.kernels.triton.varlen_attention import varlen_attention

        self._qkv_prologue = qkv_prologue
        self._varlen_attention = varlen_attention

    def attend(
        self,
        q: "torch.Tensor",  # [T, num_heads, head_dim]
        k: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        v: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        causal: bool,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        return self._varlen_attention(q, k, v, meta.query_start_loc, scale, causal=causal, max_seqlen=meta.max_query_len)

    def forward(
        self,
        q: "torch.Tensor",
        k: "torch.Tensor",
        v: "torch.Tensor",
        kv_cache: "torch.Tensor | None",
        meta: AttentionMetadata,
        scale: float,
    ) -> "torch.Tensor":
        """The decoder layers' call (``AttentionBackend``): causal; ``kv_cache`` is ignored (None)."""
        return self.attend(q, k, v, meta, scale, causal=True)

    def forward_qkv(
        self,
        qkv: "torch.Tensor",  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        positions: "torch.Tensor",  # [T]
        prologue: QKVPrologue,
        kv_cache: "torch.Tensor | None",
        meta: AttentionMetadata,
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        """Norms and rotary from the qkv output in one kernel, then causal varlen attention."""
        import torch

        tokens, kv_heads, dim = qkv.shape[0], prologue.num_kv_heads, prologue.head_dim
        slots = meta.backend_cache.get("token_slots")
        if slots is None or slots.shape[0] != tokens:
            slots = torch.arange(tokens, dtype=torch.int64, device=qkv.device)
            meta.backend_cache["token_slots"] = slots  # made once per step, shared by every layer
        scratch = torch.empty((2, tokens, 1, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
        q = self._qkv_prologue(
            qkv, positions, prologue.cos_sin_cache, scratch, slots, prologue.num_heads,
            prologue.q_norm_weight, prologue.k_norm_weight, prologue.norm_eps,
        )
        k, v = scratch[0].view(tokens, kv_heads, dim), scratch[1].view(tokens, kv_heads, dim)
        return self.attend(q, k, v, meta, scale, causal=True)
