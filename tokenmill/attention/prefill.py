"""Attention over whole prompts with no KV cache: pooling models compute each prompt in one step.

The batch is flat (sequence i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``) and every
sequence attends only to itself: all of itself for an encoder (BERT), or causally for a decoder
used as an embedder or classifier. Nothing is stored, since a pooling request finishes in the
step that computes its prompt.

``scaled_dot_product_attention`` wants equal-length rows, so sequences are gathered into padded
groups of similar length (longest first; a group closes when padding would exceed a quarter of
its tokens) and each group is one call. Padded key slots are masked for bidirectional attention;
causal attention needs no mask, since a real query never sees a later (padded) key. Padded query
rows are computed from copies of real tokens, so they stay finite, and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata

# A group closes when its padded size would exceed this share of its real tokens (plus a little slack,
# so many very short sequences still share one call).
_MAX_PADDING_RATIO = 1.25
_PADDING_SLACK_TOKENS = 64
# Bounds the memory of one call (its attention scores grow with rows x length^2).
_MAX_GROUP_TOKENS = 16384


@dataclass
class _Group:
    index: torch.Tensor  # [G, L] int64 token index of each (row, position); padding repeats a real token
    valid: torch.Tensor | None  # [G, L] bool, None when the group has no padding
    out_index: torch.Tensor | None  # token index of every valid (row, position), None without padding


def whole_prompt_metadata(query_lens: list[int], device: torch.device) -> AttentionMetadata:
    """Metadata for a step of whole prompts: each sequence's context is exactly its new tokens."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return AttentionMetadata(
        slot_mapping=empty,  # no cache to write
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        block_tables=torch.empty(len(query_lens), 0, dtype=torch.int32, device=device),
        block_size=0,
        query_lens_host=list(query_lens),
        seq_lens_host=list(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float, causal: bool
) -> torch.Tensor:
    """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]; each sequence attends within itself."""
    groups = meta.backend_cache.get("prefill_groups")
    if groups is None:
        groups = _length_groups(meta.query_lens_host, q.device)
        meta.backend_cache["prefill_groups"] = groups  # computed once per step, shared by all layers
    out = torch.empty_like(q)
    for group in groups:
        # [G, L, H, D] -> [G, H, L, D]
        query, key, value = (x[group.index].transpose(1, 2) for x in (q, k, v))
        mask = None if causal or group.valid is None else group.valid[:, None, None, :]
        result = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        ).transpose(1, 2)  # [G, L, H, D]
        if group.valid is None:
            out[group.index.reshape(-1)] = result.reshape(-1, *result.shape[2:])
        else:
            out[group.out_index] = result[group.valid]
    return out


def _length_groups(lens: list[int], device: torch.device) -> list[_Group]:
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    members: list[list[int]] = []
    for i in order:
        current = members[-1] if members else None
        if current:
            longest = lens[current[0]]  # sorted: the first member is the longest
            padded = (len(current) + 1) * longest
            real = sum(lens[j] for j in current) + lens[i]
            if padded <= min(_MAX_PADDING_RATIO * real + _PADDING_SLACK_TOKENS, _MAX_GROUP_TOKENS):
                current.append(i)
                continue
        members.append([i])
    return [_group([starts[i] for i in m], [lens[i] for i in m], device) for m in members]


def _group(starts: list[int], lens: list[int], device: torch.device) -> _Group:
    width = max(lens)
    start = torch.tensor(starts, dtype=torch.int64)[:, None]
    length = torch.tensor(lens, dtype=torch.int64)[:, None]
    offsets = torch.arange(width, dtype=torch.int64)[None, :]
    valid = offsets < length
    # Padding positions repeat the sequence's first token: a real, finite row.
    index = start + torch.where(valid, offsets, 0)
    if bool(valid.all()):
        return _Group(index.to(device), None, None)
    return _Group(index.to(device), valid.to(device), index[valid].to(device))


class PrefillAttentionBackend:
    """The attention backend of pooling models on the CPU: whole prompts, no cache (torch; the
    GPU twin is `VarlenAttentionBackend` in ``varlen_backend.py``).

    Encoders call ``attend`` (bidirectional). ``forward`` has the shape of the paged backends
    (`AttentionBackend`) so decoder layers run unchanged: causal, and the ``kv_cache`` they hand
    over is ignored (the runner passes none).
    """

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float, causal: bool
    ) -> torch.Tensor:
        return prefill_attention(q, k, v, meta, scale, causal)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return prefill_attention(q, k, v, meta, scale, causal=True)
