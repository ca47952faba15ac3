"""What one forward pass needs to know about the batch, passed explicitly down the model.

The runner flattens the scheduled tokens of all sequences into one 1-D batch of T tokens
(no padding). Sequence i owns the tokens ``query_start_loc[i]:query_start_loc[i+1]``; its
context (cached tokens plus the new ones) is ``seq_lens[i]`` tokens long, stored in the
blocks listed in ``block_tables[i]``. New keys and values are written to ``slot_mapping``
(slot = block_id * block_size + offset) before attention reads the cache.

The KV cache of one layer is a tensor of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1 values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionMetadata:
    slot_mapping: "torch.Tensor"  # [T] int64, cache slot of each new token
    query_start_loc: "torch.Tensor"  # [B + 1] int32, cumulative new-token counts
    seq_lens: "torch.Tensor"  # [B] int32, context length after this step
    block_tables: "torch.Tensor"  # [B, max_blocks] int32, padded with 0
    block_size: int
    # Host copies, so backends that loop on the CPU never sync with the device.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    # Per-step values a backend derives once and reuses in every layer (masks, gather indices).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_leading_decodes(self) -> int:
        """How many sequences at the front of the step have one query token. The scheduler serves
        running sequences first, oldest first, and prompts are computed by the newest, so a
        mixed step's decodes are its leading sequences (the attention backend and the
        micro-batch cut rely on it only for speed)."""
        count = 0
        for n in self.query_lens_host:
            if n != 1:
                break
            count += 1
        return count


class AttentionBackend(Protocol):
    """Stores the new keys/values in the paged cache, then attends over the whole context."""

    def forward(
        self,
        q: "torch.Tensor",  # [T, num_heads, head_dim]
        k: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        v: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        kv_cache: "torch.Tensor",  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        ...


@dataclass(frozen=True)
class QKVPrologue:
    """What a decoder layer does to its fused qkv projection output before attention.

    Per head of q and k: an optional RMSNorm over head_dim (Qwen3's q_norm/k_norm, both or neither),
    then NeoX-style rotary by position from ``cos_sin_cache``; v is used as is. Counts are this
    rank's (tensor parallelism splits heads). Built per call, so it always sees the layer's
    current parameters and buffers.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos_sin_cache: "torch.Tensor"  # [max_position, head_dim] fp32: cos of the half angles, then sin
    q_norm_weight: "torch.Tensor | None"  # [head_dim]
    k_norm_weight: "torch.Tensor | None"  # [head_dim]
    norm_eps: float


class FusedQKVBackend(AttentionBackend, Protocol):
    """A backend that also takes the raw qkv output and runs the layer's prologue itself.

    ``Attention.forward_qkv`` uses ``forward_qkv`` when the backend has it (the Triton backend:
    one kernel instead of norm, rotary, copy and store launches); otherwise it runs the prologue
    with the layers' own ops and calls ``forward``. Results agree up to the rounding rules of
    ``tokenmill.kernels.reference``.
    """

    def forward_qkv(
        self,
        qkv: "torch.Tensor",  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        positions: "torch.Tensor",  # [T]
        prologue: QKVPrologue,
        kv_cache: "torch.Tensor",  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        ...


@dataclass
class ForwardContext:
    """Everything a model's forward needs besides token ids and positions."""

    attn: AttentionMetadata | None  # None for encoder-only models without a KV cache
    kv_caches: list["torch.Tensor"]  # one per attention layer, indexed by layer_idx
    backend: AttentionBackend
    # With LoRA adapters: each token's adapter slot ([T] int32, -1 for the base model); None when
    # no token of the step has one (tokenmill/lora/).
    lora_slots: "torch.Tensor | None" = None
