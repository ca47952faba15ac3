"""Plain-torch attention over the paged KV cache: the reference backend and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's key and value into its slot of the paged cache (cast to its dtype)."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    if kv_cache.dtype.itemsize == 1:
        # float8 saturates at its largest finite value, as the Triton store does (torch's own cast
        # gives NaN past it on some versions); and CPU index_copy_ has no float8 kernel: copy bytes.
        limit = torch.finfo(kv_cache.dtype).max
        k = k.float().clamp(-limit, limit).to(kv_cache.dtype).view(torch.uint8)
        v = v.float().clamp(-limit, limit).to(kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    else:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    """Gathers each sequence's context from its blocks and runs scaled_dot_product_attention.

    Pure-decode steps (one new token per sequence) run as one padded batch per layer; steps
    with prefill chunks run one sequence at a time with a causal mask offset by the cached length.

    ``deterministic``: one call per new token over exactly its keys ``0..position``, so the call's
    shapes, hence its bits, depend only on the token's position and its sequence's keys. (A batched
    call is not batch-invariant on the CPU: its padding to the longest context and its number of
    query rows change how the kernel blocks the reduction.) Slower, most of all for long prompts.
    """

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        if self.deterministic:
            return self._each_token(q, kv_cache, meta, scale)
        if meta.is_pure_decode:
            return self._decode(q, kv_cache, meta, scale)
        return self._mixed(q, kv_cache, meta, scale)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        blocks, valid = _decode_gather_index(meta)
        batch = blocks.shape[0]
        num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        # Whole blocks are gathered (contiguous block_size * heads * head_dim runs), which is several
        # times faster than gathering token slots one by one; index_select copies each block as one
        # run, where indexing with a tensor (cache[blocks]) walks it element by element: 4-6x faster
        # at C1's shapes (docs/perf.md 98).
        keys = kv_cache[0].index_select(0, blocks.reshape(-1)).view(batch, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]
        values = kv_cache[1].index_select(0, blocks.reshape(-1)).view(batch, -1, num_kv_heads, head_dim)
        num_heads = q.shape[1]
        # The query heads that share a kv head are rows of one query: [B, Hkv, H / Hkv, D], head h on
        # kv head h // (H / Hkv) as under enable_gqa. The CPU kernel then runs a third (SmolLM2) to a
        # quarter (Llama-3) of the (sequence, head) problems, each with several rows instead of one:
        # bf16 decode attention 3.5-7x faster than one-row queries with enable_gqa on an AVX512-BF16 CPU
        # without AMX, fp16 2-3.5x, fp32 the same or faster (docs/perf.md 98).
        out = F.scaled_dot_product_attention(
            q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=valid[:, None, None, :],
            scale=scale,
        )
        return out.reshape(batch, num_heads, head_dim)

    def _mixed(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, query_len, seq_len, keys, values in _sequence_contexts(q, kv_cache, meta):
            query = q[start : start + query_len].transpose(0, 1)  # [H, Lq, D]
            mask = None
            if query_len > 1:
                # Query j sits at absolute position seq_len - query_len + j and sees keys up to it.
                key_pos = torch.arange(seq_len, device=q.device)
                query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
            out[start : start + query_len] = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            ).transpose(0, 1)
        return out

    def _each_token(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, query_len, seq_len, keys, values in _sequence_contexts(q, kv_cache, meta):
            for token, position in enumerate(range(seq_len - query_len, seq_len), start):
                out[token] = F.scaled_dot_product_attention(
                    q[token].unsqueeze(1), keys[:, : position + 1], values[:, : position + 1], scale=scale, enable_gqa=True
                ).squeeze(1)
        return out


def _sequence_contexts(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
    """Per sequence: its first token's row, query and context lengths, and its keys and values
    [Hkv, L, D] in q's dtype (strides independent of L: slicing them is what _each_token relies on)."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        slots = _context_slots(meta, i, seq_len)
        keys, values = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
        yield start, query_len, seq_len, keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype)
        start += query_len


def _context_slots(meta: AttentionMetadata, seq_idx: int, seq_len: int) -> torch.Tensor:
    num_blocks = -(-seq_len // meta.block_size)
    blocks = meta.block_tables[seq_idx, :num_blocks].to(torch.int64)
    offsets = torch.arange(meta.block_size, device=blocks.device)
    return (blocks[:, None] * meta.block_size + offsets[None, :]).reshape(-1)[:seq_len]


def _decode_gather_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids [B, max_blocks] of every sequence and the validity mask [B, max_blocks * block_size].

    Slots past a sequence's length (the tail of its last block, padding blocks pointing at the
    null block) are masked out. They must still hold finite numbers, since a NaN key or value
    would survive the mask: the null block is zeroed and the CPU cache starts zero-filled.
    Computed once per step and shared by all layers through ``meta.backend_cache``.
    """
    cached = meta.backend_cache.get("decode_gather")
    if cached is None:
        num_blocks = -(-meta.max_seq_len // meta.block_size)
        blocks = meta.block_tables[:, :num_blocks].to(torch.int64)
        positions = torch.arange(num_blocks * meta.block_size, device=blocks.device)
        valid = positions[None, :] < meta.seq_lens.to(blocks.device)[:, None]
        cached = (blocks, valid)
        meta.backend_cache["decode_gather"] = cached
    return cached
