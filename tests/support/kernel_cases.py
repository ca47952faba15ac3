"""Random kernel inputs for the kernel tests (CPU interpreter and GPU) and bench/kernels_bench.py.

Plain torch, no triton: random paged batches, fused-qkv-prologue cases with their check, a tiny
attention layer and the standard rope cache (sampling rows: ``sampling_cases.py``). A paged batch is what the runner would hand the
attention backend for one step: new tokens of several sequences flattened into T rows, each
sequence's context scattered over randomly chosen (non-contiguous) cache blocks, the cache filled
with random history, and optional CUDA-graph padding (extra tokens with slot -1 past
``query_start_loc[B]``).
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

    def positions(self) -> torch.Tensor:
        """[T] int64 position of every token: its place in its sequence's context; 0 for padding."""
        pos = [torch.arange(s - q, s) for q, s in zip(self.query_lens_host, self.seq_lens_host)]
        pad = torch.zeros(self.slot_mapping.shape[0] - self.num_real_tokens, dtype=torch.int64)
        return torch.cat([*pos, pad]).to(self.slot_mapping.device)

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


@dataclass
class VarlenBatch:
    """A pooling step's packed prompts: q, k, v strided views of one random qkv projection output."""

    qkv: torch.Tensor  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
    q: torch.Tensor  # [T, num_heads, head_dim]
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor  # [T, num_kv_heads, head_dim]
    cu_seqlens: torch.Tensor  # [B + 1] int32


def make_varlen_batch(
    lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    num_pad_tokens: int = 0,
    seed: int = 0,
) -> VarlenBatch:
    """Sequences of ``lens`` tokens packed back to back (a 0 is an empty sequence), then
    ``num_pad_tokens`` rows that belong to no sequence."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens) + num_pad_tokens
    qkv = torch.randn((tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return VarlenBatch(
        qkv=qkv,
        q=q.view(tokens, num_heads, head_dim),
        k=k.view(tokens, num_kv_heads, head_dim),
        v=v.view(tokens, num_kv_heads, head_dim),
        cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
    )


@dataclass
class QKVPrologueCase:
    """Inputs of ``qkv_prologue`` (one layer's qkv output, rope cache, paged cache, slots, norm
    weights) and the check of a kernel's results against the twin ``reference.qkv_prologue_ref``."""

    qkv: torch.Tensor  # [T, (num_heads + 2 * num_kv_heads) * head_dim], possibly a strided window
    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] fp32
    kv_cache: torch.Tensor  # the cache before the kernel: random history, every other block NaN
    slot_mapping: torch.Tensor  # [T], some -1
    num_heads: int
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float = 1e-6

    def args(self, kv_cache: torch.Tensor) -> tuple[Any, ...]:
        """Positional arguments of ``qkv_prologue`` / ``qkv_prologue_ref``, storing into ``kv_cache``."""
        return (self.qkv, self.positions, self.cos_sin_cache, kv_cache, self.slot_mapping, self.num_heads,
                self.q_norm_weight, self.k_norm_weight, self.eps)

    def check(self, got_q: torch.Tensor, got_cache: torch.Tensor, qkv_before: torch.Tensor, **tol: float) -> None:
        """q and the written k rows within ``tol`` of the twin; v rows exact; every other cache row
        bit for bit what it was (NaN poison included); qkv untouched."""
        from tokenmill.kernels.reference import qkv_prologue_ref

        expected_cache = self.kv_cache.clone()
        expected_q = qkv_prologue_ref(*self.args(expected_cache))
        assert torch.equal(self.qkv, qkv_before), "qkv was modified"
        assert_close_per_head(got_q, expected_q, "q", **tol)  # padding tokens' rows included
        num_slots, head_dim = self.kv_cache.shape[1] * self.kv_cache.shape[2], self.kv_cache.shape[-1]
        written = torch.zeros(num_slots, dtype=torch.bool, device=got_cache.device)
        written[self.slot_mapping[self.slot_mapping >= 0]] = True
        got_rows, old_rows = got_cache.view(2, num_slots, -1), self.kv_cache.view(2, num_slots, -1)
        assert torch.equal(_bits(got_rows[:, ~written]), _bits(old_rows[:, ~written])), "rows of other slots changed"
        assert torch.equal(_bits(got_cache[1]), _bits(expected_cache[1])), "v is a plain copy: must be exact"
        expected_k = expected_cache.view(2, num_slots, -1)[0, written]
        assert_close_per_head(got_cache[0].view(num_slots, -1, head_dim)[written], expected_k.view(expected_k.shape[0], -1, head_dim), "k", **tol)


def assert_close_per_head(got: torch.Tensor, expected: torch.Tensor, what: str, *, atol: float, rtol: float) -> None:
    """``|got - expected| <= atol + rtol * |expected| + 2 eps * max|expected over the head|`` elementwise.

    The last term is for norm-then-rotary outputs: the kernel and the twin sum the RMS statistics
    in different orders, so now and then a normalised value rounds to the neighbouring number of
    the model dtype; rotary then mixes that one-ulp step (of a value as large as the head's
    largest) into outputs that may be near zero, where rtol alone would not cover it.
    """
    g, e = got.float(), expected.float()
    bound = atol + rtol * e.abs() + 2 * torch.finfo(got.dtype).eps * e.abs().amax(dim=-1, keepdim=True)
    over = ~((g - e).abs() <= bound)  # NaN counts as over
    if over.any():
        worst = ((g - e).abs() - bound).nan_to_num(float("inf")).argmax()
        raise AssertionError(
            f"{what}: {int(over.sum())} of {over.numel()} elements off; worst got {g.flatten()[worst].item()} "
            f"expected {e.flatten()[worst].item()} at flat index {int(worst)}"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN poison compares equal to itself."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def make_qkv_prologue_case(
    tokens: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    qk_norm: bool,
    strided: bool = False,
    cache_dtype: torch.dtype | None = None,
    max_position: int = 4096,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> QKVPrologueCase:
    """Random inputs: every third token is padding (slot -1), ``strided`` puts qkv in a window of a
    wider buffer (token stride != width, data not at offset 0), and the cache holds random history
    with NaN in every other block, so stray writes and stray reads both show."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    extra = 3 * head_dim if strided else 0
    qkv = (torch.randn((tokens, width + extra), generator=gen) * 3).to(dtype).to(device)[:, extra // 3 : extra // 3 + width]
    num_blocks = -(-tokens // block_size) + 3
    cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen).to(cache_dtype or dtype)
    cache[:, ::2] = float("nan")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[1::3] = -1
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2)] if qk_norm else [None, None]
    return QKVPrologueCase(
        qkv=qkv,
        positions=torch.randint(0, max_position, (tokens,), generator=gen).to(device),
        cos_sin_cache=rope_cos_sin_cache(max_position, head_dim, base=1e6, device=device),
        kv_cache=cache.to(device),
        slot_mapping=slots.to(device),
        num_heads=num_heads,
        q_norm_weight=weights[0],
        k_norm_weight=weights[1],
    )


def tiny_attention_layer(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: bool,
    qkv_bias: bool,
    dtype: torch.dtype,
    hidden_size: int = 96,
    max_position: int = 4096,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Any:
    """A decoder attention layer (``LlamaAttention``: Qwen3-style with ``qk_norm``, Qwen2-style with
    ``qkv_bias``) with random weights, built like the loader builds models: parameters in ``dtype``,
    the rope cache fp32. Norm weights are drawn around 1, projections scaled to keep activations O(1)."""
    import types

    from tokenmill.models.llama import LlamaAttention, TensorParallel

    config = types.SimpleNamespace(
        hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, max_position_embeddings=max_position, rope_theta=1e6, attention_bias=qkv_bias,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            layer = LlamaAttention(config, 0, TensorParallel(0, 1, None), qkv_bias=qkv_bias, qk_norm=qk_norm)  # type: ignore[arg-type]
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            is_norm = name.endswith("norm.weight")
            values = (1.0 if is_norm else 0.0) + (0.3 if is_norm else hidden_size**-0.5) * torch.randn(param.shape, generator=gen)
            param.copy_(values)
    return layer


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The fp32 ``[max_position, rotary_dim]`` cache (cos half, then sin half) of standard rope."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32).to(device)
