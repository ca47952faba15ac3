"""The per-row pieces every sampling kernel shares (``kernels/triton/sampling.py`` describes the
algorithm): a row's state and filters, its scores (logits with bias and penalties, tempered), one
chunk of the Gumbel-max draw, float keys that sort like the floats, block-wide sums, the bisection
that finds the largest value whose weight at or above it reaches a target, and a row's summary
from its chunk statistics."""

from __future__ import annotations

import triton
import triton.language as tl

_LN2 = tl.constexpr(0.6931471805599453)
_SERIES_BELOW = tl.constexpr(0.0078125)  # 2^-7: under it -ln(1 - w) is its series to w^4 (error < w^3 / 5)


def fast_log() -> bool:
    """Whether kernels take the noise's logs by one PTX instruction (``_ln``): compiled ones only."""
    return not triton.knobs.runtime.interpret


@triton.jit
def _ln(x, FAST_LOG: tl.constexpr):
    """Natural log. FAST_LOG (compiled for the GPU; the interpreter runs no PTX): one MUFU
    ``lg2.approx`` (absolute error < 2^-22 in log2) instead of libdevice's ~25-instruction logf."""
    if FAST_LOG:
        # .ftz: the noise never takes the log of a subnormal (its arguments are >= 2^-32).
        log2 = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
        return log2 * _LN2
    return tl.log(x)


@triton.jit
def _gumbel_noise(bits, FAST_LOG: tl.constexpr):
    """Gumbel(0, 1) noise from 32 random bits: g = -ln(E), E = -ln(1 - w) ~ Exp(1), w uniform on the
    midpoints (k + 1/2) 2^-31 of the bits' magnitude k < 2^31 (``tl.uint_to_uniform_float``'s k),
    held below 1. A token wins the race with a small E, so E is taken from w's side, where floats
    are fine (a series for w < 2^-7, not 1 - w rounded to 2^-24 steps): relative to exact, E is
    within ~1e-7 there and 1.4e-5 elsewhere with FAST_LOG (g within 3e-5), and never 0 (g <= 22.2),
    so no token gets infinite noise."""
    signed = bits.to(tl.int32, bitcast=True)
    k = tl.where(signed < 0, -signed - 1, signed)
    w = tl.minimum((k.to(tl.float32) + 0.5) * 4.656612873077393e-10, 0.99999994)
    series = w * tl.fma(w, tl.fma(w, tl.fma(w, 0.25, 0.3333333333333333), 0.5), 1.0)
    e = tl.where(w < _SERIES_BELOW, series, -_ln(1.0 - w, FAST_LOG))
    return -_ln(e, FAST_LOG)


@triton.jit
def _row_state(row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr,
               HAS_STATE: tl.constexpr):
    if HAS_STATE:
        bias_slot = tl.load(bias_slot_ptr + row)
        penalty_slot = tl.load(penalty_slot_ptr + row)
        penalised = penalty_slot >= 0  # the factors are the slot's; a row without one has none
        repetition = tl.load(repetition_ptr + penalty_slot, mask=penalised, other=1.0)
        frequency = tl.load(frequency_ptr + penalty_slot, mask=penalised, other=0.0)
        presence = tl.load(presence_ptr + penalty_slot, mask=penalised, other=0.0)
    else:
        bias_slot = -1
        penalty_slot = -1
        repetition = 1.0
        frequency = 0.0
        presence = 0.0
    return bias_slot, penalty_slot, repetition, frequency, presence


@triton.jit
def _scores(
    logits_ptr, stride_row, row, tokens, valid, temperature,
    bias_slot, bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row,
    repetition, frequency, presence, HAS_STATE: tl.constexpr,
):
    """The row's scores at ``tokens``: logits, plus the row's bias and penalised when it has state,
    divided by the temperature when it is > 0 (greedy rows keep their logits); -inf where not ``valid``."""
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=valid, other=float("-inf")).to(tl.float32)
    if HAS_STATE:
        if bias_slot >= 0:
            x += tl.load(bias_ptr + bias_slot.to(tl.int64) * vocab_size + tokens, mask=valid, other=0.0)
        if penalty_slot >= 0:
            base = penalty_slot.to(tl.int64)
            # counts_ptr: the int16 table as int32 words, (V + 1) // 2 a row (sampling_args.counts_width).
            pair = tl.load(counts_ptr + base * ((vocab_size + 1) // 2) + tokens // 2, mask=valid, other=0)
            count = (pair >> ((tokens % 2) * 16)) & 0xFFFF
            word = tl.load(prompt_bits_ptr + base * words_per_row + tokens // 32, mask=valid, other=0)
            seen = (((word >> (tokens % 32)) & 1) != 0) | (count > 0)
            x = tl.where(seen, tl.where(x > 0.0, tl.math.div_rn(x, repetition), x * repetition), x)
            x = x - frequency * count.to(tl.float32)
            x = x - tl.where(count > 0, presence, 0.0)
    if temperature > 0.0:
        x = tl.math.div_rn(x, temperature)
    return x


@triton.jit
def _chunk_draw(
    logits_ptr, stride_row, row, chunk, temperature, key_ptr, counter_ptr, threshold,
    bias_slot, bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row,
    repetition, frequency, presence, CHUNK: tl.constexpr, STRICT: tl.constexpr, HAS_STATE: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """One chunk of a row's Gumbel-max draw: the best score s + g among the chunk's candidates (s >=
    ``threshold``; s > it when STRICT; a greedy row scores s, every token) and the lowest token
    holding it. Every draw over whole chunks (the final one, the argmax rounds) goes through here:
    the same noise and the same ties whichever kernel draws."""
    # Token i = 4 * quad + lane: one Philox call (four 32-bit outputs) serves a quad of tokens.
    quads = chunk * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
    lanes = tl.arange(0, 4)
    tokens = quads[:, None] * 4 + lanes[None, :]  # [CHUNK // 4, 4], row-major = token order
    valid = tokens < vocab_size
    first = chunk * CHUNK
    s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr, penalty_slot,
                counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence, HAS_STATE)
    if temperature > 0.0:
        key = tl.load(key_ptr + row)
        counter = tl.load(counter_ptr + row)
        zero = quads * 0
        c1 = zero + (counter & 0xFFFFFFFF).to(tl.int32)
        c2 = zero + (counter >> 32).to(tl.int32)
        r0, r1, r2, r3 = tl.philox(key, quads, c1, c2, zero)
        lane = lanes[None, :]
        bits = tl.where(lane == 0, r0[:, None],
                        tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])))
        if STRICT:
            candidate = s > threshold
        else:
            candidate = s >= threshold
        score = tl.where(candidate, s + _gumbel_noise(bits, FAST_LOG), float("-inf"))
    else:
        score = s
    score = tl.where(valid, score, float("-inf"))
    # The best score of the chunk and the lowest token holding it, reduced over both tile axes (a
    # reshape to 1-D may reorder elements on the GPU, so no index is taken from a flattened tile).
    best = tl.max(tl.max(score, axis=1), axis=0)
    token = tl.min(tl.min(tl.where(score == best, tokens, first + CHUNK), axis=1), axis=0)
    # A NaN score matches nothing: fall back to the chunk's first token, always a real one.
    return best, tl.where(token < vocab_size, token, first)


@triton.jit
def _sortable(values):
    """int32 keys that order like the float32 ``values`` (-0.0 and +0.0 share the key 0)."""
    bits = tl.where(values == 0.0, 0.0, values).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_sortable(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _total(x):
    return tl.sum(x, axis=None)


@triton.jit
def _largest_reaching(values, weights, target, PROBES: tl.constexpr):
    """The largest of ``values`` (1-D) whose weight at or above it reaches ``target`` > 0: the v with
    sum(weights[values >= v]) >= target > sum(weights[values > v]); -inf if all the weight falls short.

    A bisection on the int32 keys of the values that weighs PROBES cut points per step (one
    block-wide reduction of PROBES sums: at most 32 steps for PROBES = 1, 11 for 7; more cut points
    pay off where a thread holds few values).
    Weights are non-negative, so every sum only grows as the cut moves down, whatever the rounding."""
    keys = _sortable(values)
    weighted = weights > 0.0
    lo = tl.min(tl.where(weighted, keys, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(weighted, keys, -2147483648), axis=0).to(tl.int64) + 1
    reached = tl.sum(weights, axis=0) >= target
    # weight(keys >= lo) >= target > weight(keys >= hi) (when reached); lo ends on a value's key.
    if PROBES == 1:
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if tl.sum(tl.where(keys >= mid.to(tl.int32), weights, 0.0), axis=0) >= target:
                lo = mid
            else:
                hi = mid
    else:
        j = tl.arange(0, PROBES + 1)  # the last cut point stays at hi: its weight is below the target
        while hi - lo > 1:
            cuts = tl.minimum(lo + tl.maximum((hi - lo) * (j + 1) // (PROBES + 1), 1), hi)
            above = tl.sum(tl.where(keys[:, None] >= cuts[None, :].to(tl.int32), weights[:, None], 0.0), axis=0)
            reaching = above >= target
            lo = tl.max(tl.where(reaching, cuts, lo), axis=0)
            hi = tl.min(tl.where(reaching, hi, cuts), axis=0)
    return tl.where(reached, _from_sortable(lo.to(tl.int32)), float("-inf"))


@triton.jit
def _row_filters(row, temperature, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size):
    """The row's filters, normalised: top-k >= V is off; all off for greedy rows."""
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_k = tl.where(top_k >= vocab_size, 0, top_k)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    filtered = (temperature > 0.0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    return top_k, top_p, min_p, filtered


@triton.jit
def _row_summary(row, chunk_stats_ptr, num_chunks, CHUNKS_P2: tl.constexpr):
    """The row's max s, total weight sum(exp(s - max)) and smallest finite s, from its chunks' statistics."""
    chunks = tl.arange(0, CHUNKS_P2)
    stats = chunk_stats_ptr + row.to(tl.int64) * (3 * num_chunks) + chunks
    chunk_top = tl.load(stats, mask=chunks < num_chunks, other=float("-inf"))
    chunk_mass = tl.load(stats + num_chunks, mask=chunks < num_chunks, other=0.0)
    top = tl.max(chunk_top, axis=0)
    mass = tl.sum(tl.where(chunk_top > float("-inf"), chunk_mass * tl.exp(chunk_top - top), 0.0), axis=0)
    smallest = tl.min(tl.load(stats + 2 * num_chunks, mask=chunks < num_chunks, other=float("inf")), axis=0)
    return top, mass, smallest
