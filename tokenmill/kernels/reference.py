"""Plain-torch twins of every Triton kernel in ``tokenmill.kernels.triton``.

Each function here states, in the simplest torch we can write, what its Triton twin must compute;
the kernel tests compare the two on random inputs. They favour clarity over speed: loops over
sequences, ``.tolist()`` on metadata (host syncs are fine here), fp32 arithmetic throughout.

Rounding contract shared with the kernels: inputs are read in their own dtype, all arithmetic is
done in fp32, and a result is rounded to the output dtype once, except where a step of the
Hugging Face model we mirror rounds in between (RMSNorm rounds the normalised row to the input
dtype before multiplying by the weight, exactly like HF's ``LlamaRMSNorm``/``Qwen3RMSNorm``).
"""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int, slot = block * block_size + offset; -1 = skip
) -> None:
    """Write token t's key and value to cache slot ``slot_mapping[t]``; tokens with slot -1 are padding."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(kv_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype; rows of tokens past query_start_loc[B] are 0
    """Causal attention of each sequence's new tokens over its whole paged context.

    Same semantics as ``TorchAttentionBackend`` (after its store): sequence i's query j sits at
    absolute position ``seq_lens[i] - query_len_i + j`` and sees keys at positions ``<=`` it;
    query head h reads kv head ``h // (num_heads // num_kv_heads)`` (GQA as in HF ``repeat_kv``).
    Decode, prefill with prefix-cache hits and chunked prefill are all this one rule.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    flat_k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    flat_v = kv_cache[1].reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[i], starts[i + 1]
        query_len = q_hi - q_lo
        if query_len == 0:
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[i].to(torch.int64)[positions // block_size]
        slots = blocks * block_size + positions % block_size
        keys = flat_k[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        values = flat_v[slots].float().repeat_interleave(group, dim=1)
        query = q[q_lo:q_hi].float()  # [Lq, H, D]
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        visible = positions[None, :] <= query_pos[:, None]  # [Lq, L]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim: fp32 statistics, row rounded to x.dtype, then times weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is rounded to x.dtype first, as HF's
    decoder layer does (``hidden = residual + hidden`` in the model dtype, then the next norm)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(summed, weight, eps), summed


def rotary_embedding_ref_(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], modified in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], modified in place
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos in [:rotary_dim/2], sin after
) -> None:
    """GPT-NeoX-style rotary embedding (HF ``rotate_half``) on the first ``rotary_dim`` dims.

    With half = rotary_dim / 2, x1 = x[..., :half], x2 = x[..., half:rotary_dim]:
    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. Dims past rotary_dim are left alone.
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.to(torch.int64)].float()  # [T, rotary_dim]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x of last dim 2d (the gated MLP's gate_up output)."""
    d = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def qkv_prologue_ref(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], k and v stored here
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding (not stored)
    num_heads: int,
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]; both or neither
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:  # q: [T, num_heads, head_dim], qkv.dtype
    """What a decoder layer does between its qkv projection and attention, as the unfused twins do it:
    per-head ``rms_norm_ref`` of q and k (when weights are given), ``rotary_embedding_ref_`` on q and
    k, ``store_kv_ref`` of k and v. Returns the rotated q; k and v go only to the cache."""
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    v = v.reshape(tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    q, k = q.clone(), k.clone()  # rotated in place: never write into the caller's qkv
    rotary_embedding_ref_(positions, q, k, cos_sin_cache)
    store_kv_ref(k, v, kv_cache, slot_mapping)
    return q
