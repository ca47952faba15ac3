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
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = _to_cache_dtype(k[keep], kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = _to_cache_dtype(v[keep], kv_cache.dtype)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; float8 saturates at its largest finite value (torch's own cast gives
    NaN past it on some versions and devices: 2.11 on CUDA does, 2.13 on the CPU saturates)."""
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


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


def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (nn.Linear's layout: weight [N, K]) in fp32, rounded once to x.dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def varlen_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cu_seqlens: torch.Tensor,  # [B + 1]
    scale: float,
    causal: bool,
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype; rows of tokens past cu_seqlens[B] are 0
    """Attention of each packed sequence over itself alone (no cache): sequence i is the tokens
    ``cu_seqlens[i]:cu_seqlens[i+1]``; token j sees every token of its sequence (bidirectional,
    BERT) or those at positions ``<= j`` (causal, a decoder). GQA as in HF ``repeat_kv``."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    starts = cu_seqlens.tolist()
    for lo, hi in zip(starts[:-1], starts[1:]):
        if hi == lo:
            continue
        query = q[lo:hi].float()
        keys = k[lo:hi].float().repeat_interleave(group, dim=1)
        values = v[lo:hi].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if causal:
            pos = torch.arange(hi - lo, device=q.device)
            scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values).to(q.dtype)
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


def add_layer_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """``layer_norm(x + residual)`` as HF's post-norm BERT block computes it: the sum rounded to
    x.dtype, then fp32 statistics and affine map, rounded once (torch's layer_norm); no add when
    ``residual`` is None."""
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    normed = torch.nn.functional.layer_norm(summed.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return normed.to(x.dtype)


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


# Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011) with the
# constants and round order of triton.language.random, on uint32 values held in int64 tensors.
_M32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a 32-bit constant a and b in [0, 2**32), without int64 overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    low_part, high_part = b * a_lo, b * a_hi  # each < 2**48
    return (high_part + (low_part >> 16)) >> 16, (((high_part & 0xFFFF) << 16) + low_part) & _M32


def philox_ref(key: int, *counter: torch.Tensor | int) -> tuple[torch.Tensor, ...]:
    """The four 32-bit outputs of Philox-4x32-10 (``tl.philox``) for a 64-bit key and a counter of four
    32-bit words (tensors of one shape, or ints broadcast to it)."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    shape = next(torch.as_tensor(w).shape for w in counter if isinstance(w, torch.Tensor))
    c = [torch.as_tensor(w, dtype=torch.int64).expand(shape) & _M32 for w in counter]
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c[2])
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c[0])
        c = [hi_b ^ c[1] ^ k0, lo_b, hi_a ^ c[3] ^ k1, lo_a]
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return tuple(c)


def gumbel_from_bits_ref(bits: torch.Tensor) -> torch.Tensor:
    """fp32 Gumbel(0, 1) noise from 32-bit values: -ln(-ln(1 - w)) in float64, w the midpoint
    (k + 1/2) 2^-31 of the bits' magnitude k (one's complement, as ``tl.uint_to_uniform_float``) in
    float32, held below 1.
    The kernels take the same w and approximate the logs (``sampling_rows._gumbel_noise``)."""
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    magnitude = torch.where(signed < 0, -signed - 1, signed)
    half = torch.tensor(0.5, dtype=torch.float32)
    w = ((magnitude.to(torch.float32) + half) * torch.tensor(2.0**-31, dtype=torch.float32)).clamp(max=0.99999994)
    return (-torch.log(-torch.log1p(-w.double()))).float()


def gumbel_noise_ref(key: int, counter: torch.Tensor | int, vocab_size: int) -> torch.Tensor:
    """[..., vocab_size] fp32 Gumbel(0, 1) noise of rows with one key and the given counters:
    token i uses output i % 4 of Philox(key, (i // 4, counter_lo, counter_hi, 0))."""
    counter = torch.as_tensor(counter, dtype=torch.int64)[..., None]
    quads = torch.arange(-(-vocab_size // 4), dtype=torch.int64)
    quads, counter = torch.broadcast_tensors(quads, counter)
    bits = torch.stack(philox_ref(key, quads, counter & _M32, counter >> 32, 0), dim=-1).flatten(-2)[..., :vocab_size]
    return gumbel_from_bits_ref(bits)


def gumbel_argmax_ref(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]; 0 = greedy
    keys: torch.Tensor,  # [N] int64
    counters: torch.Tensor,  # [N] int64
) -> torch.Tensor:  # [N] int64
    """Per row: argmax(logits) if temperature is 0, else argmax(logits / temperature + Gumbel noise),
    which is a sample of softmax(logits / temperature); ties go to the lowest token id."""
    return sample_ref(logits, temperature, keys, counters)


def penalize_ref(
    logits: torch.Tensor,  # [N, V] float32
    counts: torch.Tensor,  # [N, V] int: occurrences of each token among the row's outputs
    prompt_mask: torch.Tensor,  # [N, V] bool: the token is in the row's prompt
    repetition: torch.Tensor,  # [N]
    frequency: torch.Tensor,  # [N]
    presence: torch.Tensor,  # [N]
) -> torch.Tensor:
    """vLLM's penalties: a token seen in the prompt or the output has its logit divided by the
    repetition penalty if positive, multiplied if not; then frequency * count and presence * (count > 0)
    are subtracted."""
    rep = repetition[:, None]
    seen = prompt_mask | (counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts.float()
    return logits - presence[:, None] * (counts > 0).float()


def prompt_mask_ref(prompt_bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] bool from the [S, ceil(V / 32)] int32 bitmap: token i is bit i % 32 of word i // 32."""
    bits = (prompt_bits.long()[:, :, None] >> torch.arange(32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def filter_threshold_ref(scores: torch.Tensor, top_k: int, top_p: float, min_p: float) -> float:
    """The threshold of one row's top-k, top-p and min-p (vLLM's order) over its tempered logits
    ``scores`` [V]: the kept tokens are exactly those with scores >= it (-inf keeps all).

    t_k is the k-th largest score (ties with it kept). Over the tokens >= t_k, sorted by score, t_p
    is the first score at which the running sum of exp(score - max) (float64) reaches top_p times
    their total: a token stays iff the tokens strictly above it hold less than top_p of the mass
    (ties stay together). t_min = max + log(min_p), in float32. The threshold is the largest of the three."""
    scores = scores.float().cpu()
    vocab = scores.shape[0]
    ordered = scores.sort(descending=True).values
    top = ordered[0]
    t_k = ordered[top_k - 1] if 0 < top_k < vocab else torch.tensor(float("-inf"))
    t_p = torch.tensor(float("-inf"))
    if top_p < 1.0:
        kept = ordered[ordered >= t_k]
        mass = torch.exp((kept - top).double()).cumsum(0)
        t_p = kept[int(torch.searchsorted(mass, top_p * mass[-1]))]  # the first cumulative mass >= the budget
    t_min = top + torch.log(torch.tensor(min_p, dtype=torch.float32)) if min_p > 0.0 else torch.tensor(float("-inf"))
    return float(torch.stack([t_k, t_p, t_min.float()]).max())


def sample_ref(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]; 0 = greedy
    keys: torch.Tensor,  # [N] int64
    counters: torch.Tensor,  # [N] int64
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # top_k, top_p, min_p per row
    state: tuple | None = None,  # sampling.RowState's fields
) -> torch.Tensor:  # [N] int64
    """``sampling.sample_tokens``: per row, the logits (fp32) plus the bias row of its bias slot,
    then penalised from its penalty slot (slots >= 0); greedy rows take the argmax; the others the
    argmax of scores + Gumbel noise over the scores >= the row's filter threshold, scores = logits /
    temperature. Ties go to the lowest token id."""
    x = logits.float().cpu().clone()  # a copy: the bias and penalties below are written into it
    vocab = x.shape[1]
    if state is not None:
        bias_slots, bias, penalty_slots, counts, prompt_bits, repetition, frequency, presence = (t.cpu() for t in state)
        rows = torch.nonzero(bias_slots >= 0).flatten()
        x[rows] = x[rows] + bias[bias_slots[rows].long()]
        rows = torch.nonzero(penalty_slots >= 0).flatten()
        slots = penalty_slots[rows].long()
        x[rows] = penalize_ref(x[rows], counts[slots, :vocab], prompt_mask_ref(prompt_bits[slots], vocab),
                               repetition[slots], frequency[slots], presence[slots])
    out = []
    for row, (t, key, counter) in enumerate(zip(temperature.tolist(), keys.tolist(), counters.tolist())):
        if t == 0:
            out.append(int(x[row].argmax()))
            continue
        s = x[row] / torch.tensor(t, dtype=torch.float32)
        if filters is not None:
            top_k, top_p, min_p = (float(f[row]) for f in filters)
            s = torch.where(s >= filter_threshold_ref(s, int(top_k), top_p, min_p), s, float("-inf"))
        out.append(int((s + gumbel_noise_ref(key, counter, vocab)).argmax()))
    return torch.tensor(out, dtype=torch.int64, device=logits.device)


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


def w4a16_linear_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [ceil(K/8), N] int32, 4-bit codes packed along K
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N] uint8, None: 8
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """Dequantize the 4-bit weight to fp32 (``(u - z) * s``), then one fp32 matmul."""
    from tokenmill.quantization.int4 import Int4Weights

    weight = Int4Weights(qweight, scales, zeros, x.shape[1], group_size).dequantize(torch.float32)
    y = x.float() @ weight.t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def quantize_fp8_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: scale = max(max |x| / 448, 1 / (448 * 512)) (or the static one), codes =
    x / scale saturated to +-448 as float8 e4m3 -> (codes [M, K], fp32 scales [M])."""
    xf = x.float()
    if static_scale is not None:
        scales = static_scale.float().reshape(1).expand(x.shape[0])
    else:
        amax = xf.abs().amax(dim=1)
        # Divided by a tensor, not the number 448: on CUDA torch divides by a Python scalar as a
        # multiplication by its rounded reciprocal, an ulp off the correctly rounded quotient on
        # ~60% of rows; tensor / tensor is IEEE division on every device, as the kernel's div_rn.
        scales = torch.clamp(amax / torch.full_like(amax, 448.0), min=1.0 / (448.0 * 512.0))
    codes = (xf / scales[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scales.contiguous()


def fp8_linear_ref(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq wq^T) * x_scale[:, None] * w_scale[None, :] (+ bias), the fp8 products summed in fp32."""
    y = (xq.float() @ wq.float().t()) * x_scale.float()[:, None] * w_scale.float()[None, :]
    return (y if bias is None else y + bias.float()).to(out_dtype)


def quantize_fp8_groups_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_ref`` applied to each ``group``-wide slice of each row (the last one partial)
    -> (codes [M, K], fp32 scales [M, cdiv(K, group)])."""
    parts = [quantize_fp8_ref(x[:, k0 : k0 + group]) for k0 in range(0, x.shape[1], group)]
    codes = torch.cat([c for c, _ in parts], dim=1) if parts else torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.stack([s for _, s in parts], dim=1) if parts else torch.empty((x.shape[0], 0))
    return codes, scales


def block_fp8_linear_ref(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, block: int = 128,
) -> torch.Tensor:
    """sum over K blocks kb of (xq[:, kb] wq[:, kb]^T) * x_scale[:, kb] * w_scale[n // block, kb] (+ bias):
    each block's fp8 products summed in fp32, then scaled, the blocks summed in fp32 in K order."""
    y = torch.zeros((xq.shape[0], wq.shape[0]), dtype=torch.float32, device=xq.device)
    row_scales = w_scale.float().repeat_interleave(block, dim=0)[: wq.shape[0]]  # [N, K blocks]
    for kb, k0 in enumerate(range(0, xq.shape[1], block)):
        part = xq[:, k0 : k0 + block].float() @ wq[:, k0 : k0 + block].float().t()
        y += part * x_scale[:, kb].float()[:, None] * row_scales[:, kb][None, :]
    return (y if bias is None else y + bias.float()).to(out_dtype)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows :I gate's weight, I: up's
    w2: torch.Tensor,  # [E, H, I]: down's weight
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
    w13_scale: torch.Tensor | None = None,  # [E, 2I]: w13 holds fp8 codes, a scale per output channel
    w2_scale: torch.Tensor | None = None,  # [E, H]: likewise for w2
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_k topk_weights[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, e = topk_ids[t,k]: one
    expert at a time over the pairs routed to it, in fp32. Each linear's output is rounded to x's
    dtype, as the model's experts do (the SiLU-mul reads the rounded gate_up, down reads the rounded
    product); down's output is rounded after the routing weight is applied, and a token's K pairs
    are summed in fp32 and rounded once. fp8 weights are dequantized first (codes times scales, fp32)."""
    if w13_scale is not None:
        w13 = w13.float() * w13_scale.float()[..., None]
    if w2_scale is not None:
        w2 = w2.float() * w2_scale.float()[..., None]
    inter = w2.shape[2]
    pairs = torch.zeros((*topk_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)  # [T, K, H]
    for e in topk_ids.unique().tolist():
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = (x[tokens].float() @ w13[e].float().t()).to(x.dtype).float()
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
        y = (act @ w2[e].float().t()) * topk_weights[tokens, slots].float()[:, None]
        pairs[tokens, slots] = y.to(x.dtype).float()
    return pairs.sum(dim=1).to(x.dtype)


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice in plain torch (Hugging Face's steps): softmax of the float32 logits, the
    top_k in descending order, divided by their sum when ``renormalize``; float32 weights, int64 ids.
    Which of equally probable experts comes first is topk's choice (the kernel takes the lower index)."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def token_logprobs_ref(
    logits: torch.Tensor, token_ids: torch.Tensor, top: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Each row's raw logprob of its token, its rank (1 + the entries with a larger logprob), with
    ``top`` the row's top-1 (id, logprob) as [N, 1], and the row's max and log(sum exp(x - max)):
    ``log_softmax`` over the whole row (the kernel's ``TokenLogprobs``, in its order)."""
    x = logits.float()
    logprobs = torch.log_softmax(x, dim=-1)
    chosen = logprobs.gather(1, token_ids.long()[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    row_max = x.max(dim=-1).values
    log_sum = torch.log(torch.exp(x - row_max[:, None]).sum(dim=-1))
    if not top:
        return chosen, ranks, None, None, row_max, log_sum
    values, ids = logprobs.max(dim=-1, keepdim=True)  # max: the first of equal largest ones
    return chosen, ranks, ids, values, row_max, log_sum
