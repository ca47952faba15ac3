"""Wide top-p rows drawn without their exact threshold: argmax rounds with the row's own noise
(``kernels/triton/sampling.py``, launch 3; twin: ``reference.sample_ref``, unchanged).

A row's draw is x = argmax over its kept set N = {s >= t} of s + g, g the row's fixed Gumbel
noise. Take any cut c <= t and x1 = argmax over {s >= c} of s + g: if x1 is in N, x1 IS the draw
(an argmax over a superset that lands in the subset is the subset's argmax; the lowest-token tie
rule holds too: no lower token of the superset ties with x1, so none of N does). Membership needs
no threshold: x is kept iff the tokens strictly above it weigh less than top_p * Z (the filters'
own rule, ties kept together; ``sampling.py``), judged in float32 with the exact path's weights
exp(s - max) and its target top_p * Z (``wide[:, 2]``); where the tokens above weigh top_p * Z to
within float32 rounding the judgement may differ from the twin's float64 one, the same
measure-zero tie at the cut the exact path has. If x1 is not kept, every kept token is strictly
above s_x1, so the next round draws over {s > s_x1} with the same noise, and so on. The result is
the exact path's token for token: same noise, same kept set, so seeded draws do not change.

Round 1 draws over {s >= lo}, lo the threshold kernel's bound for the row (``wide[:, 0]``). lo
<= t is checked rather than trusted: round 1's pass also weighs the tokens >= lo, and unless
they reach top_p * Z (t_p >= lo) or lo is min-p's cut, the row gives up and takes the exact
path. The draw lands in N with probability W(N) / W(s >= lo) >= top_p, later rounds more often
(they draw from N and a thinner tail): simulated on flat and peaked 151,936-token rows, round 1
settles ~90% of top_p 0.9 rows and round 2 all but ~0.5%; top_p 0.95: ~95%, all but ~0.1%; top_p
0.5: about half, and ~87% by round 2.

Each round is two (row, chunk) launches: ``_round_draw_kernel`` (each chunk's best s + g and its
token, by the final draw's own ``_chunk_draw``) and ``_round_weigh_kernel`` (the round's token
from the chunks' bests, then each chunk's weight exp(s - max) strictly above its score); the next
round's draw programs each sum the row's partial weights (a fixed order: no atomics, the same bits
every call) and judge the previous token themselves, and a last (row,) launch judges the last
round. A row settled in a round carries its token on as chunk 0's best, score +inf (the final
draw's pass-through mark), so later rounds skip it; the last launch writes it to ``chosen``, where
the wide passes skip it and the final draw passes it through. The rows left keep ``chosen`` == -3
and take the exact path. No host sync: a fixed number of launches, settled rows exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher
from tokenmill.kernels.triton.sampling_rows import _chunk_draw, _row_state, _scores, _total, fast_log


@triton.jit
def _round_token(score_ptr, token_ptr, row, num_chunks, CHUNKS_P2: tl.constexpr):
    """A round's draw from its chunks' bests: the best score and the token of the first chunk
    holding it (the final draw's argmax + gather: ties go to the lowest token)."""
    chunks = tl.arange(0, CHUNKS_P2)
    base = row.to(tl.int64) * num_chunks
    score = tl.load(score_ptr + base + chunks, mask=chunks < num_chunks, other=float("-inf"))
    best = tl.max(score, axis=0)
    first = tl.min(tl.where(score == best, chunks, CHUNKS_P2), axis=0)
    first = tl.where(first < num_chunks, first, 0)  # a NaN best matches nothing (the verdict gives up on it)
    return best, tl.load(token_ptr + base + first)


@triton.jit
def _round_verdict(score_ptr, token_ptr, mass_ptr, wide, min_p_ptr, row, num_chunks, CHUNKS_P2: tl.constexpr,
                   AFTER_FIRST: tl.constexpr):
    """The previous round's outcome for a row still in rounds: (token, done). Done: the row is
    settled (token: its draw, from that round or carried from an earlier one) or gives up (token
    -1: the exact path takes it). Not done: the round's draw is not kept (token: it, whose score is
    the next round's floor)."""
    best, token = _round_token(score_ptr, token_ptr, row, num_chunks, CHUNKS_P2)
    fresh = best < float("inf")  # else +inf: a token carried from an earlier round (-1: gave up); or NaN
    chunks = tl.arange(0, CHUNKS_P2)
    masses = mass_ptr + row.to(tl.int64) * 2 * num_chunks + chunks
    above = tl.sum(tl.load(masses, mask=chunks < num_chunks, other=0.0), axis=0)  # a fixed order
    target = tl.load(wide + 2)
    kept = fresh & (above < target)
    rejected = fresh & ~kept
    if AFTER_FIRST:
        # Round 1 drew over s >= lo: its verdict holds only if no kept token is below lo, i.e. t_p
        # >= lo (the tokens >= lo reach the target) or lo is min-p's cut (t_min >= lo: the
        # threshold kernel raised lo to t_min, so this is lo == t_min; t_min as it computes it).
        reach = tl.sum(tl.load(masses + num_chunks, mask=chunks < num_chunks, other=0.0), axis=0)
        min_p = tl.load(min_p_ptr + row)
        t_min = tl.where(min_p > 0.0, tl.load(wide + 1) + tl.log(min_p), float("-inf"))
        valid = (reach >= target) | (t_min >= tl.load(wide))
        kept = kept & valid
        rejected = rejected & valid
    settled = kept | ((best == float("inf")) & (token >= 0))
    return tl.where(settled | rejected, token, -1), ~rejected


@triton.jit
def _round_draw_kernel(
    logits_ptr, stride_row, temperature_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    min_p_ptr, key_ptr, counter_ptr,
    chosen_ptr,  # [rows] int32: -3 marks a row in rounds; the last launch (not DRAW) writes the settled rows' tokens
    wide_ptr,  # [rows, 4] float32 (the threshold kernel's): lo, max, top_p * Z
    last_score_ptr, last_token_ptr,  # [rows, num_chunks]: the previous round's chunk bests (not FIRST)
    mass_ptr,  # [rows, 2, num_chunks] float32: the previous round's partial weights (not FIRST)
    score_ptr,  # [rows, num_chunks] float32 out (DRAW): this round's best s + g of each chunk
    token_ptr,  # [rows, num_chunks] int32 out (DRAW): its token
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    FIRST: tl.constexpr,  # round 1: candidates s >= lo, no previous round
    AFTER_FIRST: tl.constexpr,  # the previous round was round 1 (its verdict checks lo)
    DRAW: tl.constexpr,  # False: the last launch, (rows, 1) programs that only judge the last round
    HAS_STATE: tl.constexpr,
    FAST_LOG: tl.constexpr,  # the noise's logs as the final draw takes them (``sampling_rows._ln``)
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(chosen_ptr + row) == -3:
        wide = wide_ptr + row.to(tl.int64) * 4
        floor = tl.load(wide)  # round 1's candidates: s >= lo
        token = -1
        done = False
        temperature = tl.load(temperature_ptr + row)
        bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
            row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
        if not FIRST:
            # Every program judges the previous round itself (a few hundred bytes of partials, read
            # in one fixed order): no launch of its own, and all agree bit for bit.
            token, done = _round_verdict(last_score_ptr, last_token_ptr, mass_ptr, wide, min_p_ptr, row, num_chunks,
                                         CHUNKS_P2, AFTER_FIRST)
            if DRAW:
                if not done:
                    # The candidates are now the tokens strictly above the rejected one (a strict
                    # comparison: no next-float arithmetic; its ties stay out too).
                    floor = _scores(logits_ptr, stride_row, row, token, token < vocab_size, temperature, bias_slot,
                                    bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row,
                                    repetition, frequency, presence, HAS_STATE)
        if DRAW:
            out = row.to(tl.int64) * num_chunks + chunk
            if done:
                # Carried on as the final draw marks a drawn row: chunk 0 holds it with +inf.
                tl.store(score_ptr + out, tl.where(chunk == 0, float("inf"), float("-inf")))
                tl.store(token_ptr + out, tl.where(chunk == 0, token, chunk * CHUNK))
            else:
                best, drawn = _chunk_draw(logits_ptr, stride_row, row, chunk, temperature, key_ptr, counter_ptr, floor,
                                          bias_slot, bias_ptr, penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size,
                                          words_per_row, repetition, frequency, presence, CHUNK, not FIRST, HAS_STATE,
                                          FAST_LOG)
                tl.store(score_ptr + out, best)
                tl.store(token_ptr + out, drawn)
        elif done & (token >= 0):
            tl.store(chosen_ptr + row, token)


@triton.jit
def _round_weigh_kernel(
    logits_ptr, stride_row, temperature_ptr,
    bias_slot_ptr, bias_ptr, penalty_slot_ptr, counts_ptr, prompt_bits_ptr, repetition_ptr, frequency_ptr,
    presence_ptr, words_per_row,
    chosen_ptr, wide_ptr,
    score_ptr, token_ptr,  # [rows, num_chunks]: this round's chunk bests
    mass_ptr,  # [rows, 2, num_chunks] float32 out: per chunk the weight exp(s - max) strictly above the
    # round's token ([:, 0]) and, in round 1, at or above lo ([:, 1])
    vocab_size,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    FIRST: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(chosen_ptr + row) == -3:
        best, token = _round_token(score_ptr, token_ptr, row, num_chunks, CHUNKS_P2)
        if best < float("inf"):  # a fresh draw (+inf: settled or given up in an earlier round)
            temperature = tl.load(temperature_ptr + row)
            bias_slot, penalty_slot, repetition, frequency, presence = _row_state(
                row, bias_slot_ptr, penalty_slot_ptr, repetition_ptr, frequency_ptr, presence_ptr, HAS_STATE)
            # The token's score as every pass computes it (the same operations, the same bits).
            s_token = _scores(logits_ptr, stride_row, row, token, token < vocab_size, temperature, bias_slot, bias_ptr,
                              penalty_slot, counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition,
                              frequency, presence, HAS_STATE)
            tokens = chunk * CHUNK + tl.arange(0, CHUNK)
            valid = tokens < vocab_size
            s = _scores(logits_ptr, stride_row, row, tokens, valid, temperature, bias_slot, bias_ptr, penalty_slot,
                        counts_ptr, prompt_bits_ptr, vocab_size, words_per_row, repetition, frequency, presence,
                        HAS_STATE)
            wide = wide_ptr + row.to(tl.int64) * 4
            weight = tl.exp(s - tl.load(wide + 1))
            out = mass_ptr + row.to(tl.int64) * 2 * num_chunks + chunk
            tl.store(out, _total(tl.where(valid & (s > s_token), weight, 0.0)))
            if FIRST:
                tl.store(out + num_chunks, _total(tl.where(valid & (s >= tl.load(wide)), weight, 0.0)))


def draw_rounds(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                min_p: torch.Tensor, state_args: tuple, chosen: torch.Tensor, wide: torch.Tensor, rounds: int,
                chunk: int, has_state: bool, compile_only: bool) -> None:
    """Launch ``rounds`` argmax rounds and the verdict of the last: the rows marked -3 in ``chosen``
    (wide top-p rows, with the threshold kernel's ``wide`` figures) that a round settles get their
    token there; the others stay -3. ``chunk``: tokens per program, the final draw's."""
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    # Two buffers of chunk bests, one round's and the previous one's (separate tensors: each
    # aligned, so the compiled variant does not depend on the batch size).
    scores = [torch.empty((rows, num_chunks), dtype=torch.float32, device=device) for _ in range(2)]
    tokens = [torch.empty((rows, num_chunks), dtype=torch.int32, device=device) for _ in range(2)]
    mass = torch.empty((rows, 2, num_chunks), dtype=torch.float32, device=device)
    row_scores = (logits, logits.stride(0), temperature, *state_args)
    options = dict(CHUNK=chunk, CHUNKS_P2=triton.next_power_of_2(num_chunks), HAS_STATE=has_state, num_warps=8,
                   enable_fp_fusion=False)
    for r in range(rounds + 1):
        last, this = (r + 1) % 2, r % 2
        draw = r < rounds
        launcher(_round_draw_kernel, (rows, num_chunks if draw else 1), compile_only)(
            *row_scores, min_p, keys, counters, chosen, wide, scores[last], tokens[last], mass, scores[this],
            tokens[this], vocab, num_chunks, FIRST=r == 0, AFTER_FIRST=r == 1, DRAW=draw,
            FAST_LOG=fast_log(), **options,
        )
        if draw:
            launcher(_round_weigh_kernel, (rows, num_chunks), compile_only)(
                *row_scores, chosen, wide, scores[this], tokens[this], mass, vocab, num_chunks, FIRST=r == 0, **options,
            )
