"""The sampler's draw on the GPU: penalties, temperature, top-k / top-p / min-p and a random draw,
without sorting the vocabulary and without a host sync (twin: ``reference.sample_ref``).

**The draw.** Sampling token i with probability softmax(s)_i, s = logits / T, is the same as taking
``argmax_i(s_i + g_i)`` with g_i independent Gumbel(0, 1) noise (the Gumbel-max trick; the
softmax's normaliser does not move an argmax). Written that way a draw needs no softmax, no [N, V]
probability tensor and no separate noise tensor: one read of the logits in their own dtype (bf16 on
the GPU). The noise is counter-based: g for row r and token i comes from Philox-4x32-10 keyed by the
row's 64-bit ``key``, with the counter (i // 4, counter_lo, counter_hi, 0); its four outputs serve
the tokens 4 (i // 4) .. 4 (i // 4) + 3, each 32 bits made into g by ``sampling_rows._gumbel_noise``
(two approximate logs on the GPU, a series where the race is decided). The runner gives a seeded request's rows key = its seed
and counter = the output position being sampled, so its samples depend on nothing else in the batch
and nothing in the engine's history; other rows get a fresh key per step. Rows with T == 0 take the
plain argmax and draw nothing.

**Logit bias and penalties** (repetition, frequency, presence; vLLM's formulas and order) are
applied where a row's logits are read, from per-sequence state on the device (``RowState`` in
``kernels/sampling_args.py``, filled by ``worker/sampling_state.py``): a float32 bias row, output
counts [slots, V rounded up to even] int16 (read as int32 words, two tokens a word) and the prompt's
tokens as a bitmap [slots, ceil(V / 32)] int32; a row's slot of -1 means none. Every kernel here is
launched without FMA contraction, so the results round exactly as torch's separate ops do.

**Filters.** A row's top-k, top-p and min-p (vLLM's order, on the tempered distribution) keep
exactly the tokens with s >= t for one threshold t per row:
  t_k = the k-th largest s (ties with it kept); Z_k = the weight, sum of exp(s - max), at or above t_k;
  t_p = the largest value v >= t_k with weight(s >= v) >= top_p * Z_k: a token stays iff the tokens
        strictly above it hold less than top_p of the mass (its ties stay with it), the most
        probable token always;
  t_min = max + log(min_p);   t = max(t_k, t_p, t_min).
Ties are equal tempered logits. The draw then takes the Gumbel argmax over s >= t: the same noise,
so a filter only removes tokens from the race.

Filtered rows take four launches, none of which sorts (eleven where a row may have top-p alone):
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
3. Wide top-p rows (top-p without top-k keeping a large part of a broad vocabulary) are first
   drawn WITHOUT their threshold, by argmax rounds with the row's own noise (``sampling_rounds.py``
   says why that is exact): round 1 takes the Gumbel argmax over s >= lo and weighs the tokens
   strictly above it; if they hold less than top_p * Z the token is kept, so it is the draw (an
   argmax over a superset that lands in the kept set); if not, every kept token is above it and
   the next round draws over the tokens strictly above it. ``_ROUNDS`` (2) rounds, each a
   ``_round_draw_kernel`` and a ``_round_weigh_kernel`` over (row, chunk), then a (row,) launch
   judging the last; a settled row gets its token as if the threshold kernel had drawn it. Round 1
   settles a row with probability >= top_p; ~0.5% of top_p 0.9 rows go on to the exact path:
4. the rows left, in two passes over a (row, split) grid, each split a run of whole tiles (enough
   programs to fill the GPU at any batch size); launched, like the rounds, only when the caller
   says a row may have top-p alone: ``_wide_histogram_kernel`` counts the tokens in BINS (512)
   equal bins over [lo, max] (lo: the larger of the threshold kernel's bound and max + log((1 -
   top_p) Z / V), below which all tokens together weigh too little to matter) and sums their
   weight exactly; ``_wide_compact_kernel`` bounds each bin's weight by its count times exp(its
   edges - max), which, taken from above and from below (the exact sum less the bins under the
   cut: tight as top_p nears 1), pins t_p to a few bins, then writes those bins' tokens (~300-1,500
   of a flat 151,936-token row) in token order to a bracket and sums the weight above them. No
   atomics and every sum in a fixed order (the rounds' too), so a call gives the same bits every time.
5. ``_wide_threshold_kernel``, one program per row: t_p exactly among a wide top-p row's bracket
   tokens (plus the weight above it); for the other rows the threshold kernel could not settle (a
   large top-k, masses of ties, a bracket past BRACKET tokens) it narrows a bracket [lo, hi) around
   t with sweeps over the row that count and weigh the tokens above PROBES (8) values at once,
   until the bracket holds at most BRACKET (8,192) tokens; those are compacted and t found among
   them, again exactly.
6. ``_gumbel_argmax_kernel``, one program per (row, chunk): the draw over s >= t for the rows not
   drawn yet; each program writes its chunk's best score and token (``_chunk_draw``, which the
   rounds draw with too), and the wrapper picks the best chunk per row (ties go to the lowest token
   id, as ``torch.argmax``); a row the threshold kernel or the rounds drew passes its token on as
   chunk 0's, with score +inf.
Launch 3 lives in ``sampling_rounds.py``, 4 and 5 in ``sampling_wide.py``, the per-row pieces all
kernels share (state, scores, a chunk's draw, float keys, the mass bisection) in
``sampling_rows.py``. Without filters only the draw kernel runs. A call is host-bound up to a few
hundred rows (each Triton launch costs tens of µs of Python), so the wrapper launches nothing it
can do without: two torch ops after the kernels, and no placeholder tensors for absent state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.sampling_args import Filters, RowState, counts_width
from tokenmill.kernels.triton.precompile import launcher
from tokenmill.kernels.triton.sampling_rows import (
    _chunk_draw,
    _gumbel_noise,
    _largest_reaching,
    _row_filters,
    _row_state,
    _row_summary,
    _scores,
    _total,
    fast_log,
)
from tokenmill.kernels.triton.sampling_rounds import draw_rounds
from tokenmill.kernels.triton.sampling_wide import _wide_compact_kernel, _wide_histogram_kernel, _wide_threshold_kernel

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
_ROUNDS = 2  # argmax rounds a wide top-p row gets before the exact path (sampling_rounds.py)


# ---- the noise -----------------------------------------------------------------------------------

@triton.jit
def _gumbel(key, counter, tokens, FAST_LOG: tl.constexpr):
    """Gumbel(0, 1) noise of ``tokens`` (int32) for one row's (key, counter): output tokens % 4 of
    Philox(key, (tokens // 4, counter_lo, counter_hi, 0)), the draw kernel's noise token by token."""
    quads = tokens // 4
    zero = quads * 0
    c1 = zero + (counter & 0xFFFFFFFF).to(tl.int32)
    c2 = zero + (counter >> 32).to(tl.int32)
    r0, r1, r2, r3 = tl.philox(key, quads, c1, c2, zero)
    lane = tokens % 4
    bits = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return _gumbel_noise(bits, FAST_LOG)


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
    FAST_LOG: tl.constexpr,  # the noise's logs by lg2.approx (``sampling_rows._ln``)
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
                    noise = _gumbel(key, counter, ids, FAST_LOG)
                    score = tl.where((slot < count) & (values >= threshold), values + noise, float("-inf"))
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
    chosen_ptr,  # [rows] (HAS_FILTERS): >= 0 where the threshold kernel or the argmax rounds drew the row
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    vocab_size,
    num_chunks,
    stride_row,
    CHUNK: tl.constexpr,
    HAS_FILTERS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    FAST_LOG: tl.constexpr,
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
        # The token drawn earlier wins the row through chunk 0 (+inf against -inf everywhere else),
        # so the wrapper's argmax over chunks returns it: no separate merge of the two.
        tl.store(best_score_ptr + out, tl.where(chunk == 0, float("inf"), float("-inf")))
        tl.store(best_token_ptr + out, tl.where(chunk == 0, tl.load(chosen_ptr + row), first))
    else:
        bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
            row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
        best, token = _chunk_draw(logits_ptr, stride_row, row, chunk, tl.load(temperature_ptr + row), key_ptr,
                                  counter_ptr, threshold, bias_slot, bias_ptr, penalty_slot, counts_ptr,
                                  prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence, CHUNK,
                                  False, HAS_STATE, FAST_LOG)
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
    _check_rows(rows, bias_slots=(state.bias_slots, (torch.int32,)), penalty_slots=(state.penalty_slots, (torch.int32,)))
    _check_rows(state.counts.shape[0], repetition=(state.repetition, (torch.float32,)),
                frequency=(state.frequency, (torch.float32,)), presence=(state.presence, (torch.float32,)))
    words = triton.cdiv(vocab, 32)
    for name, t, width, dtype in (("bias", state.bias, vocab, torch.float32),
                                  ("counts", state.counts, counts_width(vocab), torch.int16),
                                  ("prompt_bits", state.prompt_bits, words, torch.int32)):
        if t.dim() != 2 or t.shape[1] != width or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [S, {width}] {dtype} tensor, got {tuple(t.shape)} {t.dtype}")
    return (state.bias_slots, state.bias, state.penalty_slots, state.counts.view(torch.int32), state.prompt_bits,
            state.repetition, state.frequency, state.presence, words)


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
    requests' settings); False skips the argmax rounds and the histogram passes, which only such rows take.
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
                                        compile_only, top_p_alone, _ROUNDS if top_p_alone else 0)
    if rows:
        launcher(_gumbel_argmax_kernel, (rows, num_chunks), compile_only)(
            logits, temperature, keys, counters, best_score, best_token, threshold, chosen, *state_args,
            vocab, num_chunks, logits.stride(0), CHUNK=_CHUNK, HAS_FILTERS=filters is not None,
            HAS_STATE=state is not None, FAST_LOG=fast_log(), num_warps=8, enable_fp_fusion=False,
        )
    winner = best_score.argmax(dim=1, keepdim=True)  # first best chunk: lowest token id on ties
    return best_token.gather(1, winner).squeeze(1)


def _thresholds(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                filters: Filters, state_args: tuple, has_state: bool, compile_only: bool,
                top_p_alone: bool = True, rounds: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the statistics and threshold kernels: per row the threshold and, where the threshold
    kernel drew the row itself, the token (else < 0: -4 where the histogram passes settled it).
    ``rounds`` (with ``top_p_alone``): argmax rounds first for wide top-p rows; a row they settle
    gets its token and no threshold (-inf). Without them every filtered row's threshold is exact."""
    assert top_p_alone or not rounds, "argmax rounds take only wide top-p rows: without top_p_alone there are none"
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
    # The histogram passes split each row into `splits` runs of whole tiles, enough programs to fill the
    # GPU; after argmax rounds, for the rows they leave, taken as 1 in 8 (about what two rounds leave
    # at top_p 0.5; ~0.5% at 0.9): more rows left only make more programs than the GPU needs.
    busy_rows = triton.cdiv(rows, 8) if rounds else rows
    splits = max(1, min(16, triton.cdiv(_WIDE_PROGRAMS, max(busy_rows, 1)), triton.cdiv(vocab, _CHUNK)))
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
            FAST_LOG=fast_log(), num_warps=_NUM_WARPS_ROW, **options,
        )
        if rounds:
            draw_rounds(logits, temperature, keys, counters, filters.min_p, state_args, chosen, wide, rounds, _CHUNK,
                        has_state, compile_only)
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
