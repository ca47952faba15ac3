"""The sampling kernels for wide rows (``kernels/triton/sampling.py``, launches 3 and 4): rows whose
threshold the threshold kernel could not settle from the tokens it gathers. Wide top-p rows (top-p
without top-k keeping a large part of a broad vocabulary) take a count histogram and a compaction
over a (row, split) grid, then an exact search among the bracket's tokens; a large top-k, masses
of ties or an overfull bracket take sweeps over the row that narrow a bracket around the threshold."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.sampling_rows import (
    _from_sortable,
    _largest_reaching,
    _row_filters,
    _row_state,
    _row_summary,
    _scores,
    _sortable,
    _total,
)

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
