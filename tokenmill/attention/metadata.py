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


@dataclass
class ForwardContext:
    """Everything a model's forward needs besides token ids and positions."""

    attn: AttentionMetadata | None  # None for encoder-only models without a KV cache
    kv_caches: list["torch.Tensor"]  # one per attention layer, indexed by layer_idx
    backend: AttentionBackend
