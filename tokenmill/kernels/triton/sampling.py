"""The sampler's draw on the GPU: penalties, temperature, top-k / top-p / min-p and a random draw,
without sorting the vocabulary and without a host sync (twin: ``reference.sample_ref``).

**The draw.** Sampling token i with probability softmax(s)_i, s = logits / T, is the same as taking
``argmax_i(s_i + g_i)`` with g_i independent Gumbel(0, 1) noise (the Gumbel-max trick; the
softmax's normaliser does not move an argmax). Written that way a draw needs no softmax, no [N, V]
probability tensor and no separate noise tensor: one read of the logits in their own dtype (bf16 on
the GPU). The noise is counter-based: g for row r and token i comes from Philox-4x32-10 keyed by the
row's 64-bit ``key``, with the counter (i // 4, counter_lo, counter_hi, 0); its four outputs serve
the tokens 4 (i // 4) .. 4 (i // 4) + 3. The runner gives a seeded request's rows key = its seed
and counter = the output position being sampled, so its samples depend on nothing else in the batch
and nothing in the engine's history; other rows get a fresh key per step. Rows with T == 0 take the
plain argmax and draw nothing.

**Logit bias and penalties** (repetition, frequency, presence; vLLM's formulas and order) are
applied where a row's logits are read, from per-sequence state on the device (``RowState`` in
``kernels/sampling_args.py``, filled by ``worker/sampling_state.py``): a float32 bias row, output
counts [slots, V] int32 and the prompt's tokens as a bitmap [slots, ceil(V / 32)] int32; a row's
slot of -1 means none. Every kernel here is launched without FMA contraction, so the results round
exactly as torch's separate ops do.

**Filters.** A row's top-k, top-p and min-p (vLLM's order, on the tempered distribution) keep
exactly the tokens with s >= t for one threshold t per row:
  t_k = the k-th largest s (ties with it kept); Z_k = the weight, sum of exp(s - max), at or above t_k;
  t_p = the largest value v >= t_k with weight(s >= v) >= top_p * Z_k: a token stays iff the tokens
        strictly above it hold less than top_p of the mass (its ties stay with it), the most
        probable token always;
  t_min = max + log(min_p);   t = max(t_k, t_p, t_min).
Ties are equal tempered logits. The draw then takes the Gumbel argmax over s >= t: the same noise,
so a filter only removes tokens from the race.

The threshold is found without sorting, in four to six launches:
1. ``_row_stats_kernel``, one program per (row, 2,048-token chunk), so thin batches fill the GPU:
   each chunk's max, sum of exp(s - max) and smallest finite s, and the max of every group of
   GROUP (32) consecutive tokens.
2. ``_threshold_kernel``, one program per row. From the group maxima alone (a bisection on their
   float bits) it finds a value ``lo`` that t cannot be below: the k-th largest group max (k groups
   each hold a token >= it, so t_k >= it), the largest group max v whose groups' maxima alone weigh
   top_p * Z at or above v (a lower bound of the mass there), and t_min. If at most SELECT (256)
   groups have a max >= lo, every token >= lo lies in them: the program gathers those 8,192
   tokens, compacts the ones >= lo (usually about k; at most CANDIDATES, 1,024), finds t_k, Z_k
   and t_p exactly among them (bisections that weigh 7 cut points per block-wide reduction), and
   draws the row's token right there (noise for those tokens only). This is the usual case: top-k
   up to a few hundred, top-p on peaked logits, min-p.
3. Wide top-p rows (top-p without top-k keeping a large part of a broad vocabulary), in two
   passes over a (row, split) grid, each split a run of whole tiles (enough programs to fill the
   GPU at any batch size); launched only when the caller says a row may have top-p alone:
   ``_wide_histogram_kernel`` counts the tokens in BINS (512) equal bins over [lo, max] (lo: the
   larger of the threshold kernel's bound and max + log((1 - top_p) Z / V), below which all tokens
   together weigh too little to matter) and sums their weight exactly; ``_wide_compact_kernel``
   bounds each bin's weight by its count times exp(its edges - max), which, taken from above and
   from below (the exact sum less the bins under the cut: tight as top_p nears 1), pins t_p to a
   few bins, then writes those bins' tokens (~300-1,500 of a flat 151,936-token row) in token
   order to a bracket and sums the weight above them. No atomics and every sum in a fixed order,
   so a call gives the same bits every time.
4. ``_wide_threshold_kernel``, one program per row: t_p exactly among a wide top-p row's bracket
   tokens (plus the weight above it); for the other rows the threshold kernel could not settle (a
   large top-k, masses of ties, a bracket past BRACKET tokens) it narrows a bracket [lo, hi) around
   t with sweeps over the row that count and weigh the tokens above PROBES (8) values at once,
   until the bracket holds at most BRACKET (8,192) tokens; those are compacted and t found among
   them, again exactly.
5. ``_gumbel_argmax_kernel``, one program per (row, chunk): the draw over s >= t for the rows the
   threshold kernel did not draw; each program writes its chunk's best score and token, and the
   wrapper picks the best chunk per row (ties go to the lowest token id, as ``torch.argmax``); a
   row the threshold kernel drew passes its token on as chunk 0's, with score +inf.
Without filters only the draw kernel runs. A call is host-bound up to a few hundred rows (each
Triton launch costs tens of µs of Python), so the wrapper launches nothing it can do without: two
torch ops after the kernels, and no placeholder tensors for absent state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.sampling_args import Filters, RowState
from tokenmill.kernels.triton.precompile import launcher

_CHUNK = 2048  # tokens per program of the chunked kernels: 75 chunks over Qwen's 151,936-token vocabulary
_GROUP = 32  # tokens per group maximum (the threshold kernel's first, coarse view of a row)
_GATHERED = 8192  # tokens the threshold kernel gathers into registers: SELECT groups of GROUP
_CANDIDATES = 1024  # of those, the ones at or above the bound, compacted to find the threshold among
_BRACKET = 8192  # tokens of a wide row's final bracket, compacted and searched in registers
_PROBES = 8  # values a wide sweep counts and weighs the tokens above at once
_SWEEP_TILE = 1024  # tokens per iteration of a wide sweep
_BINS = 512  # bins of a wide top-p row's count histogram over [lo, max]
_WIDE_PROGRAMS = 2048  # programs the chunk-parallel wide passes aim to launch (at most 16 per row)
_NUM_WARPS_ROW = 16  # the per-row kernels' warps: a program holds a row's group maxima in registers


# ---- shared pieces ------------------------------------------------------------------------------

@triton.jit
def _row_state(row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr,
               HAS_STATE: tl.constexpr):
    if HAS_STATE:
        bias_slot = tl.load(bias_slot_ptr + row)
        penalty_slot = tl.load(penalty_slot_ptr + row)
        repetition = tl.load(repetition_ptr + row)
        frequency = tl.load(frequency_ptr + row)
        presence = tl.load(presence_ptr + row)
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
            count = tl.load(counts_ptr + base * vocab_size + tokens, mask=valid, other=0)
            word = tl.load(prompt_bits_ptr + base * words_per_row + tokens // 32, mask=valid, other=0)
            seen = (((word >> (tokens % 32)) & 1) != 0) | (count > 0)
            x = tl.where(seen, tl.where(x > 0.0, tl.math.div_rn(x, repetition), x * repetition), x)
            x = x - frequency * count.to(tl.float32)
            x = x - tl.where(count > 0, presence, 0.0)
    if temperature > 0.0:
        x = tl.math.div_rn(x, temperature)
    return x


@triton.jit
def _gumbel(key, counter, tokens):
    """Gumbel(0, 1) noise of ``tokens`` (int32) for one row's (key, counter): output tokens % 4 of
    Philox(key, (tokens // 4, counter_lo, counter_hi, 0)), the draw kernel's noise token by token."""
    quads = tokens // 4
    zero = quads * 0
    c1 = zero + (counter & 0xFFFFFFFF).to(tl.int32)
    c2 = zero + (counter >> 32).to(tl.int32)
    r0, r1, r2, r3 = tl.philox(key, quads, c1, c2, zero)
    lane = tokens % 4
    bits = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return -tl.log(-tl.log(tl.uint_to_uniform_float(bits)))  # uniform in [0, 1); 0 gives -inf noise


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


# ---- 1. chunk statistics ------------------------------------------------------------------------

@triton.jit
def _row_stats_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    chunk_stats_ptr,  # [rows, 3, num_chunks] float32: max, sum of exp(s - max), smallest finite s
    group_max_ptr,  # [rows, num_chunks * CHUNK // GROUP] float32
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    _, _, _, filtered = _row_filters(row, temperature, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    if filtered:
        bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
            row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
        groups = chunk * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
        tokens = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        s = _scores(logits_ptr, stride_row, row, tokens, tokens < vocab_size, temperature, bias_slot, bias_ptr,
                    penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency,
                    presence, HAS_STATE)
        group_max = tl.max(s, axis=1)
        tl.store(group_max_ptr + row.to(tl.int64) * (num_chunks * (CHUNK // GROUP)) + groups, group_max)
        top = tl.max(group_max, axis=0)
        mass = _total(tl.exp(s - tl.where(top > float("-inf"), top, 0.0)))
        smallest = tl.min(tl.min(tl.where(s > float("-inf"), s, float("inf")), axis=1), axis=0)
        stats = chunk_stats_ptr + row.to(tl.int64) * (3 * num_chunks) + chunk
        tl.store(stats, top)
        tl.store(stats + num_chunks, mass)
        tl.store(stats + 2 * num_chunks, smallest)


# ---- 2. the threshold, and the draw of rows whose kept tokens it gathered -----------------------

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


@triton.jit
def _threshold_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, key_ptr, counter_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    chunk_stats_ptr, group_max_ptr,
    selected_ptr,  # [rows, SELECT] int32 scratch: the gathered groups
    candidate_ptr,  # [rows, CANDIDATES] float32 scratch: the gathered scores >= lo
    candidate_token_ptr,  # [rows, CANDIDATES] int32 scratch: their tokens
    threshold_ptr,  # [rows] float32 out: keep s >= threshold (-inf: no filter)
    chosen_ptr,  # [rows] int32 out: the drawn token; -1: the draw kernel draws; -2: the wide kernel
    # first; -3: the histogram passes, then the wide kernel
    wide_ptr,  # [rows, 4] float32 out (rows marked -3): lo, top, top_p * Z (and the first bracket bin, later)
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNKS_P2: tl.constexpr,  # >= num_chunks, a power of two
    GROUPS_P2: tl.constexpr,  # >= num_chunks * CHUNK // GROUP, a power of two: the group maxima held at once
    SELECT: tl.constexpr,  # groups gathered: SELECT * GROUP tokens
    CANDIDATES: tl.constexpr,  # tokens >= lo compacted to find the thresholds among
    HAS_STATE: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    top_k, top_p, min_p, filtered = _row_filters(row, temperature, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    threshold = float("-inf")
    chosen = -1
    if filtered:
        chosen = -2  # unless the gathered tokens settle the row below
        use_k = top_k > 0
        use_p = top_p < 1.0
        top, mass, smallest = _row_summary(row, chunk_stats_ptr, num_chunks, CHUNKS_P2)
        t_min = tl.where(min_p > 0.0, top + tl.log(min_p), float("-inf"))
        # A value lo that t cannot be below, from the group maxima. top-k: the k-th largest of
        # them (k groups hold a token >= it, so t_k >= it). top-p without top-k: the largest v
        # whose groups' maxima alone weigh top_p * Z at or above it (a lower bound of the mass
        # there). With both, lo must stay <= t_k (Z_k needs every token at or above t_k), so only
        # top-k's bound counts.
        num_groups = num_chunks * (CHUNK // GROUP)
        groups = tl.arange(0, GROUPS_P2)
        real_group = (groups < num_groups) & (groups * GROUP < vocab_size)
        group_max = tl.load(group_max_ptr + row.to(tl.int64) * num_groups + groups, mask=real_group,
                            other=float("-inf"))
        lo = float("-inf")
        if (use_k & (top_k <= SELECT)) | ((top_k == 0) & use_p):
            weights = tl.where(real_group, tl.where(use_k, 1.0, tl.exp(group_max - top)), 0.0)
            lo = _largest_reaching(group_max, weights, tl.where(use_k, top_k.to(tl.float32), top_p * mass), 1)
        if (top_k == 0) | (top_p >= 1.0):
            lo = tl.maximum(lo, t_min)
        picked = real_group & (group_max >= lo)
        num_picked = tl.sum(picked.to(tl.int32), axis=0)
        if (lo > float("-inf")) & (num_picked <= SELECT):
            # Gather the picked groups: every token >= lo is among them.
            bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
                row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
            place = tl.cumsum(picked.to(tl.int32), axis=0) - 1
            tl.store(selected_ptr + row.to(tl.int64) * SELECT + place, groups, mask=picked)
            tl.debug_barrier()
            picks = tl.arange(0, SELECT)
            group = tl.load(selected_ptr + row.to(tl.int64) * SELECT + picks, mask=picks < num_picked, other=0)
            tokens = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            valid = (picks < num_picked)[:, None] & (tokens < vocab_size)
            s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr, penalty_slot,
                        counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence,
                        HAS_STATE)
            # Compact the tokens >= lo (usually about k of them), then find the thresholds there.
            kept = valid & (s >= lo)
            count = tl.sum(tl.sum(kept.to(tl.int32), axis=1), axis=0)
            if count <= CANDIDATES:
                per_group = tl.sum(kept.to(tl.int32), axis=1)
                position = (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(kept.to(tl.int32), axis=1) - 1
                base = row.to(tl.int64) * CANDIDATES
                tl.store(candidate_ptr + base + position, s, mask=kept)
                tl.store(candidate_token_ptr + base + position, tokens, mask=kept)
                tl.debug_barrier()
                slot = tl.arange(0, CANDIDATES)
                values = tl.load(candidate_ptr + base + slot, mask=slot < count, other=float("-inf"))
                ids = tl.load(candidate_token_ptr + base + slot, mask=slot < count, other=0)
                # t_k: below lo (fewer than k tokens gathered) it is not known: fine without top-p
                # (min-p's cut is then above it), else the row goes wide.
                ok = True
                t_k = float("-inf")
                if use_k:
                    t_k = tl.where(count >= top_k,
                                   _largest_reaching(values, (slot < count).to(tl.float32), top_k.to(tl.float32), 7),
                                   float("-inf"))
                    ok = (count >= top_k) | (top_p >= 1.0)
                # t_p: if the gathered tokens do not reach top_p * Z it is below lo: fine when lo
                # is min-p's cut, else the row goes wide.
                t_p = float("-inf")
                if use_p & ok:
                    weights = tl.where(values >= t_k, tl.exp(values - top), 0.0)
                    budget = top_p * tl.where(use_k, tl.sum(weights, axis=0), mass)
                    t_p = _largest_reaching(values, weights, budget, 7)
                    ok = (t_p > float("-inf")) | (t_min >= lo)
                threshold = tl.maximum(tl.maximum(t_k, t_p), t_min)
                if ok & (threshold >= lo):
                    key = tl.load(key_ptr + row)
                    counter = tl.load(counter_ptr + row)
                    score = tl.where((slot < count) & (values >= threshold), values + _gumbel(key, counter, ids),
                                     float("-inf"))
                    best = tl.max(score, axis=0)
                    chosen = tl.min(tl.where(score == best, ids, vocab_size), axis=0)
                    chosen = tl.where(chosen < vocab_size, chosen, -1)  # a NaN score: leave it to the draw kernel
        if (chosen == -2) & (top_k == 0) & use_p & (mass > 0.0) & (top < float("inf")) & (mass < float("inf")):
            # A wide top-p row: the histogram passes bracket t_p within [lo, top]. Every token below
            # a value v weighs less than exp(v - top), so t_p >= v where vocab_size * exp(v - top)
            # <= (1 - top_p) * Z: a bound that keeps the histogram's range to where the mass is.
            lo = tl.maximum(tl.maximum(lo, smallest), top + tl.log((1.0 - top_p) * mass / vocab_size) - 1e-3)
            lo = tl.minimum(lo, top)
            wide = wide_ptr + row.to(tl.int64) * 4
            tl.store(wide, lo)
            tl.store(wide + 1, top)
            tl.store(wide + 2, top_p * mass)
            chosen = -3
    tl.store(threshold_ptr + row, threshold)
    tl.store(chosen_ptr + row, chosen)


# ---- 3. wide top-p rows: a count histogram, then the bracket's tokens -----------------------------

@triton.jit
def _bin_of(s, lo, top, BINS: tl.constexpr):
    """The bin of scores ``s`` >= lo among BINS equal bins over [lo, top] (top in the last one);
    monotone in s, and computed the same way by every kernel that bins."""
    scale = tl.where(top > lo, BINS / (top - lo), 0.0)
    return tl.minimum(tl.floor(tl.where(s >= lo, (s - lo) * scale, 0.0)), BINS - 1).to(tl.int32)


@triton.jit(do_not_specialize=["splits"])
def _wide_histogram_kernel(
    logits_ptr, stride_row, temperature_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    chosen_ptr, wide_ptr,
    hist_ptr,  # [rows, splits, BINS] int32 out: per split, the count of tokens >= lo in each bin
    mass_ptr,  # [rows, 2, splits] float32 out: [:, 0] per split, the weight exp(s - top) of the tokens >= lo
    vocab_size, splits, tokens_per_split,
    TILE: tl.constexpr,
    BINS: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(chosen_ptr + row) == -3:
        temperature = tl.load(temperature_ptr + row)
        bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
            row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
        lo = tl.load(wide_ptr + row.to(tl.int64) * 4)
        top = tl.load(wide_ptr + row.to(tl.int64) * 4 + 1)
        first = split * tokens_per_split  # a whole number of tiles
        counts = tl.zeros([BINS], dtype=tl.int32)
        mass = tl.zeros([TILE], dtype=tl.float32)
        for start in range(0, tokens_per_split, TILE):
            tokens = first + start + tl.arange(0, TILE)
            valid = tokens < vocab_size
            s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr, penalty_slot,
                        counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence,
                        HAS_STATE)
            counted = valid & (s >= lo)
            counts += tl.histogram(_bin_of(s, lo, top, BINS), BINS, mask=counted)
            mass += tl.where(counted, tl.exp(s - top), 0.0)
        tl.store(hist_ptr + (row.to(tl.int64) * splits + split) * BINS + tl.arange(0, BINS), counts)
        tl.store(mass_ptr + row.to(tl.int64) * 2 * splits + split, _total(mass))


@triton.jit
def _mass_bracket(hist_ptr, mass_ptr, row, splits, split, lo, top, target, BINS: tl.constexpr):
    """The bins [b1, b2) that hold t_p, from the counts and the exact weight Z_lo of the tokens >= lo:
    a bin weighs between its count times exp(its lower edge - top) and times exp(its upper edge -
    top), so the weight of the bins >= b is bounded from above (the bins >= b) and from below (Z_lo
    less the bins < b; the tighter where the cut leaves little mass below, as top_p near 1 does).
    The bins >= b1 surely weigh >= target and the bins >= b2 surely less (bounds widened for
    rounding). Also the tokens in [b1, b2), and how many of them earlier splits hold (where this
    split's tokens go in the compacted bracket)."""
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], dtype=tl.int32)
    before = tl.zeros([BINS], dtype=tl.int32)
    z_lo = 0.0
    for i in range(0, splits):  # in a fixed order: the same bits every run
        counts = tl.load(hist_ptr + (row.to(tl.int64) * splits + i) * BINS + bins)
        total += counts
        before += tl.where(i < split, counts, 0)
        z_lo += tl.load(mass_ptr + row.to(tl.int64) * 2 * splits + i)
    width = (top - lo) / BINS
    slack = 1e-6 * (tl.abs(top) + tl.abs(lo)) + 1e-3 * width  # binning rounds (s - lo) * scale
    light = total.to(tl.float32) * tl.exp(lo + bins.to(tl.float32) * width - slack - top)
    heavy = total.to(tl.float32) * tl.exp(tl.minimum(lo + (bins + 1).to(tl.float32) * width + slack, top) - top)
    light_below = tl.cumsum(light, axis=0) - light
    heavy_below = tl.cumsum(heavy, axis=0) - heavy
    least = tl.maximum(tl.cumsum(light, axis=0, reverse=True), z_lo - heavy_below)  # both fall as b grows
    most = tl.minimum(tl.cumsum(heavy, axis=0, reverse=True), z_lo - light_below)
    margin = 1e-5 * z_lo
    b1 = tl.maximum(tl.sum((least - margin >= target).to(tl.int32), axis=0) - 1, 0)
    b2 = tl.sum((most + margin >= target).to(tl.int32), axis=0)
    in_bracket = (bins >= b1) & (bins < b2)
    return b1, b2, tl.sum(tl.where(in_bracket, total, 0), axis=0), tl.sum(tl.where(in_bracket, before, 0), axis=0)


@triton.jit(do_not_specialize=["splits"])
def _wide_compact_kernel(
    logits_ptr, stride_row, temperature_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    chosen_ptr, wide_ptr, hist_ptr,
    mass_ptr,  # [rows, 2, splits] float32: [:, 1] out: per split, the weight of the tokens above the bracket
    bracket_ptr,  # [rows, BRACKET] float32 out: the bracket's scores, in token order
    bracket_count_ptr,  # [rows] int32 out: the bracket's tokens; -1: more than BRACKET
    vocab_size, splits, tokens_per_split,
    TILE: tl.constexpr,
    BINS: tl.constexpr,
    BRACKET: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(chosen_ptr + row) == -3:
        wide = wide_ptr + row.to(tl.int64) * 4
        lo = tl.load(wide)
        top = tl.load(wide + 1)
        b1, b2, count, written = _mass_bracket(hist_ptr, mass_ptr, row, splits, split, lo, top, tl.load(wide + 2),
                                               BINS)
        if split == 0:
            tl.store(bracket_count_ptr + row, tl.where(count <= BRACKET, count, -1))
            tl.store(wide + 3, b1.to(tl.float32))
        if count <= BRACKET:
            temperature = tl.load(temperature_ptr + row)
            bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
                row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
            first = split * tokens_per_split  # a whole number of tiles
            # Tiles as [TILE // 32, 32]: the placement scans 32 tokens a line, then the line totals
            # (a 1-D scan over the whole tile costs ~70 registers more).
            above = tl.zeros([TILE // 32, 32], dtype=tl.float32)
            for start in range(0, tokens_per_split, TILE):
                tokens = first + start + tl.arange(0, TILE // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
                valid = tokens < vocab_size
                s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr,
                            penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition,
                            frequency, presence, HAS_STATE)
                b = _bin_of(s, lo, top, BINS)
                counted = valid & (s >= lo)
                kept = (counted & (b >= b1) & (b < b2)).to(tl.int32)
                per_line = tl.sum(kept, axis=1)
                place = written + (tl.cumsum(per_line, axis=0) - per_line)[:, None] + tl.cumsum(kept, axis=1) - 1
                tl.store(bracket_ptr + row.to(tl.int64) * BRACKET + place, s, mask=(kept != 0) & (place < BRACKET))
                written += tl.sum(per_line, axis=0)
                above += tl.where(counted & (b >= b2), tl.exp(s - top), 0.0)
            tl.store(mass_ptr + (row.to(tl.int64) * 2 + 1) * splits + split, _total(above))


# ---- 4. wide rows: the exact threshold, by the bracket or by sweeps over the row -----------------------------------------

@triton.jit
def _probe_sweep(
    logits_ptr, stride_row, row, temperature,
    bias_slot, bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition,
    frequency, presence,
    lo, hi, probes, top, by_mass, TILE: tl.constexpr, PROBES: tl.constexpr, HAS_STATE: tl.constexpr,
):
    """One pass over the row: for the tokens with lo <= s < hi, their number, weight, smallest,
    smallest finite and largest s, and the number and weight of those >= each of ``probes``
    (weight: exp(s - top) by mass, 1 by count). Sums build up per lane and are reduced once, after
    the pass. (Tiles are [TILE, 1] columns, broadcast against [1, PROBES]: one layout throughout.)"""
    probes = probes[None, :]
    above_count = tl.zeros([TILE, PROBES], dtype=tl.int32)
    above_weight = tl.zeros([TILE, PROBES], dtype=tl.float32)
    count = tl.zeros([TILE, 1], dtype=tl.int32)
    weight = tl.zeros([TILE, 1], dtype=tl.float32)
    smallest = tl.full([TILE, 1], float("inf"), tl.float32)
    smallest_finite = tl.full([TILE, 1], float("inf"), tl.float32)
    largest = tl.full([TILE, 1], float("-inf"), tl.float32)
    for start in range(0, vocab_size, TILE):
        tokens = start + tl.arange(0, TILE)[:, None]
        valid = tokens < vocab_size
        s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr, penalty_slot,
                    counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence,
                    HAS_STATE)
        inside = valid & (s >= lo) & (s < hi)
        w = tl.where(inside, tl.where(by_mass, tl.exp(s - top), 1.0), 0.0)
        ge = inside & (s >= probes)
        above_count += ge.to(tl.int32)
        above_weight += tl.where(ge, w, 0.0)
        count += inside.to(tl.int32)
        weight += w
        smallest = tl.minimum(smallest, tl.where(inside, s, float("inf")))
        smallest_finite = tl.minimum(smallest_finite, tl.where(inside & (s > float("-inf")), s, float("inf")))
        largest = tl.maximum(largest, tl.where(inside, s, float("-inf")))
    return (tl.sum(above_count, axis=0), tl.sum(above_weight, axis=0), _total(count), _total(weight),
            tl.min(tl.min(smallest, axis=1), axis=0), tl.min(tl.min(smallest_finite, axis=1), axis=0),
            tl.max(tl.max(largest, axis=1), axis=0))


@triton.jit
def _probe_values(lo, hi, PROBES: tl.constexpr):
    """PROBES values strictly inside (lo, hi], evenly spaced in value where the floats allow,
    otherwise on consecutive float keys, always strictly increasing (so every sweep shrinks the bracket)."""
    key_lo = _sortable(lo)
    key_hi = _sortable(hi)
    b = tl.arange(0, PROBES)
    values = lo + (hi - lo) * ((b + 1).to(tl.float32) / (PROBES + 1))
    keys = tl.minimum(tl.maximum(_sortable(values), key_lo + 1 + b), key_hi - (PROBES - 1) + b)
    # Strictly increasing: k'_b = max_{j <= b}(k_j - j) + b.
    keys = tl.associative_scan(keys - b, 0, _maximum) + b
    return _from_sortable(tl.minimum(keys, key_hi))


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _threshold_by_sweeps(
    logits_ptr, stride_row, row, temperature,
    bias_slot, bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition,
    frequency, presence,
    bracket_ptr, floor, smallest, top, target, top_p, by_mass,
    TILE: tl.constexpr, PROBES: tl.constexpr, BRACKET: tl.constexpr, HAS_STATE: tl.constexpr,
):
    """The largest s v >= floor of the row with weight(s >= v, s >= floor) >= target, by sweeps
    over the row (weights: exp(s - top) ``by_mass``, else 1; ``smallest``: no finite s >= floor is
    below it). By mass the target is top_p times the weight at or above ``floor``, taken from the
    first sweep.

    A bracket [lo, hi) with weight(>= lo) >= target > weight(>= hi) shrinks by sweeps that weigh the
    tokens above PROBES values in it, until it holds at most BRACKET tokens (or a single value);
    those are compacted into ``bracket_ptr`` and searched in registers."""
    lo = floor
    hi = float("inf")
    above_hi = 0.0  # weight at or above hi
    in_bracket = vocab_size + 1  # tokens in [lo, hi): unknown before the first sweep
    span_lo = tl.maximum(floor, smallest)
    span_hi = top
    first = True
    result = float("-inf")
    done = False
    while not done:
        if in_bracket <= BRACKET:
            # Compact the bracket's tokens, then search them exactly.
            written = 0
            for start in range(0, vocab_size, TILE):
                tokens = start + tl.arange(0, TILE)
                s = _scores(logits_ptr, stride_row, row, tokens, tokens < vocab_size, temperature, bias_slot,
                            bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row,
                            repetition, frequency, presence, HAS_STATE)
                inside = (tokens < vocab_size) & (s >= lo) & (s < hi)
                place = written + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(bracket_ptr + place, s, mask=inside & (place < BRACKET))
                written += tl.sum(inside.to(tl.int32), axis=0)
            tl.debug_barrier()
            slots = tl.arange(0, BRACKET)
            values = tl.load(bracket_ptr + slots, mask=slots < written, other=float("-inf"))
            weights = tl.where(slots < written, tl.where(by_mass, tl.exp(values - top), 1.0), 0.0)
            if first & by_mass:
                target = top_p * tl.sum(weights, axis=0)  # a short row is compacted whole: this is all the weight
            result = _largest_reaching(values, weights, target - above_hi, 1)
            done = True
        else:
            probes = _probe_values(span_lo, span_hi, PROBES)
            above_count, above_weight, count, weight, smallest_in, finite_in, largest_in = _probe_sweep(
                logits_ptr, stride_row, row, temperature, bias_slot, bias_ptr, penalty_slot, counts_ptr,
                prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence, lo, hi, probes, top,
                by_mass, TILE, PROBES, HAS_STATE,
            )
            if first & by_mass:
                target = top_p * weight  # the first sweep weighs everything at or above floor
            first = False
            if above_hi + weight < target:
                done = True  # not even the whole bracket reaches the target
            elif smallest_in == largest_in:
                result = smallest_in  # one value left (-inf too): it is the threshold
                done = True
            else:
                # The largest probe whose weight at or above it reaches the target becomes lo.
                index = tl.arange(0, PROBES)
                reaching = (above_hi + above_weight) >= target
                best = tl.max(tl.where(reaching, index, -1), axis=0)
                nxt = best + 1
                if best >= 0:
                    lo = tl.sum(tl.where(index == best, probes, 0.0), axis=0)
                    new_count = tl.sum(tl.where(index == best, above_count, 0), axis=0)
                else:
                    new_count = count
                if nxt < PROBES:
                    hi = tl.sum(tl.where(index == nxt, probes, 0.0), axis=0)
                    above_hi = above_hi + tl.sum(tl.where(index == nxt, above_weight, 0.0), axis=0)
                    new_count -= tl.sum(tl.where(index == nxt, above_count, 0), axis=0)
                in_bracket = new_count
                span_lo = tl.maximum(lo, finite_in)
                span_hi = tl.minimum(hi, largest_in)
    return result


@triton.jit
def _bracket_threshold(bracket_ptr, count, top, target, SLOTS: tl.constexpr, PROBES: tl.constexpr):
    """The largest of the ``count`` scores at ``bracket_ptr`` whose weight exp(s - top) at or above
    it reaches ``target``; -inf if all of it falls short."""
    slots = tl.arange(0, SLOTS)
    values = tl.load(bracket_ptr + slots, mask=slots < count, other=float("-inf"))
    return _largest_reaching(values, tl.where(slots < count, tl.exp(values - top), 0.0), target, PROBES)


@triton.jit(do_not_specialize=["splits"])
def _wide_threshold_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    chunk_stats_ptr,
    bracket_ptr,  # [rows, BRACKET] float32: the histogram passes' bracket (HISTOGRAM), then sweeps' scratch
    threshold_ptr,  # [rows] float32 out
    chosen_ptr,  # [rows] int32: -2 and -3 mark the rows to do here; set to -1, or -4 where the bracket
    # settled the row (the draw kernel draws both)
    wide_ptr, mass_ptr, bracket_count_ptr,  # the histogram passes' results (HISTOGRAM)
    vocab_size,
    num_chunks,
    splits,
    CHUNKS_P2: tl.constexpr,
    BRACKET: tl.constexpr,
    SMALL_BRACKET: tl.constexpr,  # a bracket of at most this many tokens is searched with 3 cut points a step
    PROBES: tl.constexpr,
    TILE: tl.constexpr,
    HISTOGRAM: tl.constexpr,  # whether the histogram passes ran
    HAS_STATE: tl.constexpr,
):
    """The threshold of the rows whose kept tokens the threshold kernel could not gather: for top-p
    rows the histogram passes bracketed, t_p among the bracket's tokens; for the others (and any
    such row whose bracket held too many tokens), sweeps over the row find t_k, then t_p at or above it."""
    row = tl.program_id(0)
    todo = tl.load(chosen_ptr + row)
    if todo == -3:
        todo = -2  # unless the bracket settles it (without the histogram passes, sweeps do it)
        if HISTOGRAM:
            count = tl.load(bracket_count_ptr + row)
            if count >= 0:
                wide = wide_ptr + row.to(tl.int64) * 4
                lo = tl.load(wide)
                top = tl.load(wide + 1)
                target = tl.load(wide + 2)
                above = 0.0
                for i in range(0, splits):  # in a fixed order: the same bits every run
                    above += tl.load(mass_ptr + (row.to(tl.int64) * 2 + 1) * splits + i)
                t_p = float("-inf")
                if above < target:
                    # The usual bracket fits the small search (3 cut points a step: ~10 steps, not ~20).
                    if count <= SMALL_BRACKET:
                        t_p = _bracket_threshold(bracket_ptr + row.to(tl.int64) * BRACKET, count, top, target - above,
                                                 SMALL_BRACKET, 3)
                    else:
                        t_p = _bracket_threshold(bracket_ptr + row.to(tl.int64) * BRACKET, count, top, target - above,
                                                 BRACKET, 1)
                min_p = tl.load(min_p_ptr + row)
                t_min = tl.where(min_p > 0.0, top + tl.log(min_p), float("-inf"))
                # Not reached: t_p is below lo (if the bracket starts at lo), which is fine only
                # where lo is min-p's cut.
                below_lo = (above < target) & (tl.load(wide + 3) == 0.0)
                if (t_p > float("-inf")) | (below_lo & (t_min >= lo)):
                    tl.store(threshold_ptr + row, tl.maximum(t_p, t_min))
                    tl.store(chosen_ptr + row, -4)  # the draw kernel draws it; -4 tells tests which path ran
                    todo = -4
    if todo == -2:
        temperature = tl.load(temperature_ptr + row)
        top_k, top_p, min_p, _ = _row_filters(row, temperature, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
        bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
            row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
        top, _, smallest = _row_summary(row, chunk_stats_ptr, num_chunks, CHUNKS_P2)
        thresholds = tl.full([], float("-inf"), tl.float32)  # t_k after the first phase, t_p after the second
        floor = thresholds
        for phase in range(2):
            by_mass = phase == 1
            if (by_mass & (top_p < 1.0)) | ((phase == 0) & (top_k > 0)):
                floor = thresholds
                found = _threshold_by_sweeps(
                    logits_ptr, stride_row, row, temperature, bias_slot, bias_ptr, penalty_slot, counts_ptr,
                    prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence,
                    bracket_ptr + row.to(tl.int64) * BRACKET, floor, smallest, top, top_k.to(tl.float32), top_p,
                    by_mass, TILE, PROBES, BRACKET, HAS_STATE,
                )
                thresholds = tl.maximum(thresholds, found)
        t_min = tl.where(min_p > 0.0, top + tl.log(min_p), float("-inf"))
        tl.store(threshold_ptr + row, tl.maximum(thresholds, t_min))
        tl.store(chosen_ptr + row, -1)


# ---- 5. the draw --------------------------------------------------------------------------------

@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    key_ptr,
    counter_ptr,
    best_score_ptr,
    best_token_ptr,
    threshold_ptr,  # [rows] (HAS_FILTERS): keep s >= threshold
    chosen_ptr,  # [rows] (HAS_FILTERS): >= 0 where the threshold kernel already drew the row
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    vocab_size,
    num_chunks,
    stride_row,
    CHUNK: tl.constexpr,
    HAS_FILTERS: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    out = row * num_chunks + chunk
    first = chunk * CHUNK
    threshold = float("-inf")
    drawn = False
    if HAS_FILTERS:
        threshold = tl.load(threshold_ptr + row)
        drawn = tl.load(chosen_ptr + row) >= 0
    if drawn:
        # The threshold kernel's token wins the row through chunk 0 (+inf against -inf everywhere
        # else), so the wrapper's argmax over chunks returns it: no separate merge of the two.
        tl.store(best_score_ptr + out, tl.where(chunk == 0, float("inf"), float("-inf")))
        tl.store(best_token_ptr + out, tl.where(chunk == 0, tl.load(chosen_ptr + row), first))
    else:
        bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
            row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
        # Token i = 4 * quad + lane: one Philox call (four 32-bit outputs) serves a quad of tokens.
        quads = chunk * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
        lanes = tl.arange(0, 4)
        tokens = quads[:, None] * 4 + lanes[None, :]  # [CHUNK // 4, 4], row-major = token order
        valid = tokens < vocab_size
        temperature = tl.load(temperature_ptr + row)
        s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr, penalty_slot,
                    counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence,
                    HAS_STATE)
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
            uniform = tl.uint_to_uniform_float(bits)  # [0, 1); 0 gives -inf noise, never chosen
            score = tl.where(s >= threshold, s - tl.log(-tl.log(uniform)), float("-inf"))
        else:
            score = s
        score = tl.where(valid, score, float("-inf"))
        # The best score of the chunk and the lowest token holding it, reduced over both tile axes (a
        # reshape to 1-D may reorder elements on the GPU, so no index is taken from a flattened tile).
        best = tl.max(tl.max(score, axis=1), axis=0)
        token = tl.min(tl.min(tl.where(score == best, tokens, first + CHUNK), axis=1), axis=0)
        # A NaN score matches nothing: fall back to the chunk's first token, always a real one.
        token = tl.where(token < vocab_size, token, first)
        tl.store(best_score_ptr + out, best)
        tl.store(best_token_ptr + out, token)


# ---- wrappers -----------------------------------------------------------------------------------

def _check_rows(rows: int, **tensors: tuple[torch.Tensor, tuple[torch.dtype, ...]]) -> None:
    for name, (t, dtypes) in tensors.items():
        if t.shape != (rows,) or t.dtype not in dtypes or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{rows}] tensor of {dtypes}, got {tuple(t.shape)} {t.dtype}")


def _state_args(state: RowState, logits: torch.Tensor) -> tuple:
    """The kernels' state arguments, checked."""
    rows, vocab = logits.shape
    _check_rows(rows, bias_slots=(state.bias_slots, (torch.int32,)), penalty_slots=(state.penalty_slots, (torch.int32,)),
                repetition=(state.repetition, (torch.float32,)), frequency=(state.frequency, (torch.float32,)),
                presence=(state.presence, (torch.float32,)))
    words = triton.cdiv(vocab, 32)
    for name, t, width, dtype in (("bias", state.bias, vocab, torch.float32), ("counts", state.counts, vocab, torch.int32),
                                  ("prompt_bits", state.prompt_bits, words, torch.int32)):
        if t.dim() != 2 or t.shape[1] != width or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [S, {width}] {dtype} tensor, got {tuple(t.shape)} {t.dtype}")
    return (state.bias_slots, state.bias, state.penalty_slots, state.counts, state.prompt_bits, state.repetition,
            state.frequency, state.presence, words)


def sample_tokens(
    logits: torch.Tensor,  # [N, V], any float dtype, last dim contiguous
    temperature: torch.Tensor,  # [N] float32; 0 = greedy
    keys: torch.Tensor,  # [N] int64 Philox keys
    counters: torch.Tensor,  # [N] int64 Philox counters (the draw's position)
    filters: Filters | None = None,
    state: RowState | None = None,
    *,
    top_p_alone: bool = True,
    compile_only: bool = False,
) -> torch.Tensor:  # [N] int64 token ids
    """Per row: the argmax of the (biased, penalised) logits where temperature == 0, else a sample
    of softmax(logits / temperature) restricted by the row's filters (see the module docstring).

    ``top_p_alone``: whether some row may have top-p without top-k (the caller knows it from the
    requests' settings); False skips the histogram passes, which only such rows take.
    ``compile_only`` compiles the kernels for these inputs and launches nothing (``precompile.py``);
    the result is then meaningless."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be 2-D with a contiguous last dim, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    _check_rows(rows, temperature=(temperature, (torch.float32,)), keys=(keys, (torch.int64,)),
                counters=(counters, (torch.int64,)))
    device = logits.device
    num_chunks = triton.cdiv(vocab, _CHUNK)
    best_score = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    best_token = torch.empty((rows, num_chunks), dtype=torch.int64, device=device)  # int64: the result's dtype
    state_args = _state_args(state, logits) if state is not None else (temperature,) * 8 + (1,)  # unread
    if filters is None:
        threshold = chosen = temperature  # unread without filters
    else:
        _check_rows(rows, top_k=(filters.top_k, (torch.int32, torch.int64)), top_p=(filters.top_p, (torch.float32,)),
                    min_p=(filters.min_p, (torch.float32,)))
        threshold, chosen = _thresholds(logits, temperature, keys, counters, filters, state_args, state is not None,
                                        compile_only, top_p_alone)
    if rows:
        launcher(_gumbel_argmax_kernel, (rows, num_chunks), compile_only)(
            logits, temperature, keys, counters, best_score, best_token, threshold, chosen, *state_args,
            vocab, num_chunks, logits.stride(0), CHUNK=_CHUNK, HAS_FILTERS=filters is not None,
            HAS_STATE=state is not None, num_warps=8, enable_fp_fusion=False,
        )
    winner = best_score.argmax(dim=1, keepdim=True)  # first best chunk: lowest token id on ties
    return best_token.gather(1, winner).squeeze(1)


def _thresholds(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                filters: Filters, state_args: tuple, has_state: bool, compile_only: bool,
                top_p_alone: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the statistics and threshold kernels: per row the threshold and, where the threshold
    kernel drew the row itself, the token (else < 0: -4 where the histogram passes settled it)."""
    rows, vocab = logits.shape
    device = logits.device
    num_chunks = triton.cdiv(vocab, _CHUNK)
    group = _GROUP
    num_groups = num_chunks * (_CHUNK // group)
    chunks_p2 = triton.next_power_of_2(num_chunks)
    while num_groups > 8192:  # vocabularies past 262,144 tokens: coarser groups
        group *= 2
        num_groups = num_chunks * (_CHUNK // group)
    chunk_stats = torch.empty((rows, 3, num_chunks), dtype=torch.float32, device=device)
    group_max = torch.empty((rows, num_groups), dtype=torch.float32, device=device)
    selected = torch.empty((rows, _GATHERED // group), dtype=torch.int32, device=device)
    candidates = torch.empty((rows, _CANDIDATES), dtype=torch.float32, device=device)
    candidate_tokens = torch.empty((rows, _CANDIDATES), dtype=torch.int32, device=device)
    bracket = torch.empty((rows, _BRACKET), dtype=torch.float32, device=device)
    threshold = torch.empty(rows, dtype=torch.float32, device=device)
    chosen = torch.empty(rows, dtype=torch.int32, device=device)
    # The histogram passes split each row into `splits` runs of whole tiles, enough programs to fill the GPU.
    splits = max(1, min(16, triton.cdiv(_WIDE_PROGRAMS, max(rows, 1)), triton.cdiv(vocab, _CHUNK)))
    tokens_per_split = triton.cdiv(triton.cdiv(vocab, splits), _CHUNK) * _CHUNK
    splits = triton.cdiv(vocab, tokens_per_split)
    wide = torch.empty((rows, 4), dtype=torch.float32, device=device)
    hist = masses = bracket_count = wide  # unread without the histogram passes
    if top_p_alone:
        hist = torch.empty((rows, splits, _BINS), dtype=torch.int32, device=device)
        masses = torch.empty((rows, 2, splits), dtype=torch.float32, device=device)
        bracket_count = torch.empty(rows, dtype=torch.int32, device=device)
    if rows:
        common = (logits, logits.stride(0), temperature, filters.top_k, filters.top_p, filters.min_p)
        # A variant without state, as the draw kernel has: no placeholder slots to fill each call.
        options = dict(HAS_STATE=has_state, enable_fp_fusion=False)
        launcher(_row_stats_kernel, (rows, num_chunks), compile_only)(
            *common, *state_args, chunk_stats, group_max, vocab, num_chunks, CHUNK=_CHUNK, GROUP=group,
            num_warps=8, **options,
        )
        launcher(_threshold_kernel, (rows,), compile_only)(
            *common, keys, counters, *state_args, chunk_stats, group_max, selected, candidates, candidate_tokens,
            threshold, chosen, wide, vocab, num_chunks, CHUNK=_CHUNK, GROUP=group, CHUNKS_P2=chunks_p2,
            GROUPS_P2=triton.next_power_of_2(num_groups), SELECT=_GATHERED // group, CANDIDATES=_CANDIDATES,
            num_warps=_NUM_WARPS_ROW, **options,
        )
        if top_p_alone:
            scores = (logits, logits.stride(0), temperature, *state_args)
            launcher(_wide_histogram_kernel, (rows, splits), compile_only)(
                *scores, chosen, wide, hist, masses, vocab, splits, tokens_per_split, TILE=_CHUNK, BINS=_BINS,
                num_warps=8, **options,
            )
            launcher(_wide_compact_kernel, (rows, splits), compile_only)(
                *scores, chosen, wide, hist, masses, bracket, bracket_count, vocab, splits, tokens_per_split,
                TILE=_CHUNK, BINS=_BINS, BRACKET=_BRACKET, num_warps=8, **options,
            )
        launcher(_wide_threshold_kernel, (rows,), compile_only)(
            *common, *state_args, chunk_stats, bracket, threshold, chosen, wide, masses, bracket_count, vocab,
            num_chunks, splits, CHUNKS_P2=chunks_p2, BRACKET=_BRACKET, SMALL_BRACKET=2 * _CANDIDATES, PROBES=_PROBES,
            TILE=_SWEEP_TILE,
            HISTOGRAM=top_p_alone, num_warps=_NUM_WARPS_ROW, **options,
        )
    return threshold, chosen


def gumbel_argmax(
    logits: torch.Tensor,  # [N, V], any float dtype, last dim contiguous
    temperature: torch.Tensor,  # [N] float32; 0 = greedy
    keys: torch.Tensor,  # [N] int64 Philox keys
    counters: torch.Tensor,  # [N] int64 Philox counters (the draw's position)
    *,
    compile_only: bool = False,
) -> torch.Tensor:  # [N] int64 token ids
    """Per row: argmax(logits) where temperature == 0, else a sample of softmax(logits / temperature)."""
    return sample_tokens(logits, temperature, keys, counters, compile_only=compile_only)
