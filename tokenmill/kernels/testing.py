"""Random paged batches for the kernel tests (CPU interpreter and GPU) and the kernel benchmark.

Plain torch, no triton. A batch is what the runner would hand the attention backend for one
step: new tokens of several sequences flattened into T rows, each sequence's context scattered
over randomly chosen (non-contiguous) cache blocks, the cache filled with random history, and
optional CUDA-graph padding (extra tokens with slot -1 past ``query_start_loc[B]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.attention.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, num_heads, head_dim]
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            block_size=self.block_size,
            query_lens_host=list(self.query_lens_host),
            seq_lens_host=list(self.seq_lens_host),
            max_query_len=max(self.query_lens_host, default=0),
            max_seq_len=max(self.seq_lens_host, default=0),
        )


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    cache_dtype: torch.dtype | None = None,
    num_pad_tokens: int = 0,
    spare_blocks: int = 3,
    high_block_ids: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """Sequence i has ``query_lens[i]`` new tokens at the end of a ``seq_lens[i]``-token context.

    ``query_lens[i] == seq_lens[i]`` is a fresh prefill, ``1`` a decode, anything between a prefix
    hit or a later prefill chunk; ``0`` a sequence with nothing scheduled. ``high_block_ids`` puts
    the used blocks at the top of a cache of more than 2**31 elements' worth of offsets (only
    sensible on a GPU with memory to spare), to catch 32-bit offset overflow.
    """
    if len(query_lens) != len(seq_lens) or any(q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError(f"need query_lens[i] <= seq_lens[i], got {query_lens} and {seq_lens}")
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    used = sum(blocks_per_seq)
    num_blocks = used + spare_blocks
    if high_block_ids:
        per_block = block_size * num_kv_heads * head_dim
        num_blocks = max(num_blocks, (2**31) // per_block + used + spare_blocks)
    # Random history everywhere: blocks not yet written must not look like zeros to the kernels.
    # Filled on the target device with its own seeded generator: GPU tests build gigabyte caches.
    kv_cache = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=cache_dtype, device=device)
    device_gen = torch.Generator(device=kv_cache.device).manual_seed(seed + 1)
    if cache_dtype.is_floating_point and torch.finfo(cache_dtype).bits >= 16:
        kv_cache.normal_(generator=device_gen)
    else:  # e.g. fp8: normal_ is not implemented, draw in fp16 and cast
        kv_cache.copy_(torch.randn(kv_cache.shape, generator=device_gen, device=kv_cache.device, dtype=torch.float16))
    if high_block_ids:
        first = num_blocks - used - spare_blocks
        block_ids = first + torch.randperm(used + spare_blocks, generator=gen)[:used]
    else:
        block_ids = torch.randperm(num_blocks, generator=gen)[:used]
    max_blocks = max(blocks_per_seq, default=0) + 1  # one column of 0-padding, like the runner
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    pieces: list[torch.Tensor] = []
    cursor = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        mine = block_ids[cursor : cursor + blocks_per_seq[i]].to(torch.int64)
        cursor += blocks_per_seq[i]
        tables[i, : len(mine)] = mine.to(torch.int32)
        pos = torch.arange(seq_len - query_len, seq_len, dtype=torch.int64)
        pieces.append(mine[pos // block_size] * block_size + pos % block_size)
    pieces.append(torch.full((num_pad_tokens,), -1, dtype=torch.int64))
    slots = torch.cat(pieces)
    num_tokens = slots.shape[0]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    return PagedBatch(
        q=rand(num_tokens, num_heads, head_dim),
        k=rand(num_tokens, num_kv_heads, head_dim),
        v=rand(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache,
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The fp32 ``[max_position, rotary_dim]`` cache (cos half, then sin half) of standard rope."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32).to(device)


def patch_triton_interpreter_for_numpy() -> None:
    """numpy >= 2.4 refuses int() of a 1-element array, which triton 3.6's interpreter does for
    ``range(lo, hi)`` with run-time bounds (triton-lang/triton#9171, fixed upstream by #9172).
    Wrap its tensor patching so ``__index__`` takes the element explicitly (harmless where triton
    is fixed; skipped with an older numpy). Only for tests under TRITON_INTERPRET=1."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor
    if getattr(original, "_tokenmill_patched", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tokenmill_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
