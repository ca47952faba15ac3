"""Random inputs of ``kernels/triton/sampling.sample_tokens`` for the sampling kernel tests (CPU
interpreter and GPU): one row of each filter kind (``sampling_rows``), wide top-p rows
(``wide_sampling_rows``) and tail-heavy rows for the argmax rounds (``round_sampling_rows``), with
per-row penalty and bias state. Plain torch."""

from __future__ import annotations

import functools

import torch

# (logit scale or kind, temperature, top_k, top_p, min_p) of each row of ``sampling_rows``.
SAMPLING_ROWS = [
    (3.0, 1.0, 5, 1.0, 0.0),  # top-k: the kept tokens gathered and drawn in the threshold kernel
    (3.0, 0.7, 50, 0.9, 0.0),  # top-k then top-p
    (6.0, 1.0, 0, 0.9, 0.0),  # top-p on peaked logits
    (0.05, 1.0, 0, 0.9, 0.0),  # top-p on flat logits: a wide row
    (1.0, 1.0, 300, 1.0, 0.0),  # top-k past the 256 gathered groups: wide
    (1.0, 0.8, 300, 0.8, 0.0),  # both, wide
    (2.0, 1.0, 0, 1.0, 0.1),  # min-p
    (2.0, 0.0, 0, 1.0, 0.0),  # greedy
    (2.0, 1.0, 0, 1.0, 0.0),  # no filter
    (0.0, 1.0, 7, 0.5, 0.0),  # every logit equal
    ("round", 1.0, 20, 0.95, 0.0),  # few distinct values: ties at the cuts
    ("masked", 1.0, 50, 0.9, 0.0),  # ten finite logits, top_k above them
    (1.0, 1.5, 1, 1.0, 0.0),  # top_k 1
    (1.0, 1.0, 0, 0.3, 0.2),  # top-p below min-p's cut
]


def sampling_rows(vocab: int, dtype: torch.dtype, seed: int, device: str | torch.device = "cpu") -> tuple:
    """Inputs of ``sampling.sample_tokens`` with one row of each kind in SAMPLING_ROWS, and per-row
    state: penalties on four rows (one greedy), a bias on four (one bans 50 tokens, one shifts 30).
    Returns (logits, temperature, keys, counters, Filters, RowState)."""
    from tokenmill.kernels.sampling_args import counts_width
    from tokenmill.kernels.triton.sampling import Filters, RowState

    gen = torch.Generator().manual_seed(seed)
    rows = len(SAMPLING_ROWS)
    logits = torch.randn(rows, vocab, generator=gen)
    temperature, top_p, min_p = torch.zeros(rows), torch.ones(rows), torch.zeros(rows)
    top_k = torch.zeros(rows, dtype=torch.int64)
    for i, (kind, t, k, p, mp) in enumerate(SAMPLING_ROWS):
        if kind == "round":
            logits[i] = (logits[i] * 2).round() / 2
        elif kind == "masked":
            row = torch.full((vocab,), float("-inf"))
            keep = torch.randperm(vocab, generator=gen)[:10]
            row[keep] = logits[i, keep]
            logits[i] = row
        else:
            logits[i] *= kind
        temperature[i], top_k[i], top_p[i], min_p[i] = t, k, p, mp
    counts = torch.zeros(4, counts_width(vocab), dtype=torch.int16)  # a padding column where V is odd: never read
    for s in range(4):
        counts[s].index_add_(0, torch.randint(0, vocab, (30,), generator=gen), torch.ones(30, dtype=torch.int16))
    in_prompt = torch.zeros(4, -(-vocab // 32) * 32, dtype=torch.int64)
    in_prompt[:, :vocab] = (torch.rand(4, vocab, generator=gen) < 0.05).long()
    prompt_bits = (in_prompt.view(4, -1, 32) << torch.arange(32)).sum(-1).to(torch.int32)
    penalty_slots = torch.full((rows,), -1, dtype=torch.int32)
    penalty_slots[[1, 2, 4, 7]] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    bias_slots = torch.full((rows,), -1, dtype=torch.int32)
    bias_slots[[2, 3, 7, 13]] = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    bias = torch.zeros(2, vocab)
    bias[0, torch.randint(0, vocab, (50,), generator=gen)] = float("-inf")
    bias[1, torch.randint(0, vocab, (30,), generator=gen)] = torch.randn(30, generator=gen) * 3
    # Per slot, each its own factors: a kernel reading them by row instead would penalise wrongly.
    state = RowState(bias_slots, bias, penalty_slots, counts, prompt_bits, torch.tensor([1.3, 0.7, 1.8, 1.1]),
                     torch.tensor([0.4, 0.0, 0.9, -0.3]), torch.tensor([0.2, 0.6, 0.0, 0.1]))
    keys = torch.randint(0, 2**62, (rows,), generator=gen)
    counters = torch.randint(0, 2**40, (rows,), generator=gen)
    move = functools.partial(torch.Tensor.to, device=device)
    return (move(logits.to(dtype)), move(temperature), move(keys), move(counters), Filters(*map(move, (top_k, top_p, min_p))),
            RowState(*map(move, state)))


# (kind, logit scale, temperature, top_k, top_p, min_p) of each row of ``wide_sampling_rows``; "hist":
# the row's threshold comes from the histogram passes (see the function for the vocab-dependent one).
WIDE_SAMPLING_ROWS = [
    ("hist", 0.3, 1.0, 0, 0.9, 0.0),  # flat top-p, penalised
    ("hist", 0.3, 1.0, 0, 0.5, 0.0),  # flat top-p 0.5, biased
    ("hist", 0.5, 0.8, 0, 0.99, 0.0),  # flat top-p 0.99
    ("hist masked", 0.3, 1.0, 0, 0.95, 0.0),  # every third token -inf
    ("hist ties", 0.3, 1.0, 0, 0.9, 0.0),  # multiples of 1/8: ~25 values, many ties at the cut
    ("equal", 0.0, 1.0, 0, 0.9, 0.0),  # all equal but 5 tokens: past 8,192 tokens the bracket overflows
    ("", 0.3, 1.0, 0, 1.0, 0.05),  # min-p alone: its cut needs no search
    ("hist", 0.3, 1.0, 0, 0.8, 0.3),  # top-p below min-p's cut: settled as min-p's
    ("", 0.3, 0.0, 0, 0.9, 0.0),  # greedy
    ("", 5.0, 1.0, 0, 0.9, 0.0),  # peaked: the threshold kernel gathers and draws it
    ("", 0.3, 1.0, 20, 0.9, 0.0),  # top-k bounds it: the threshold kernel
    ("hist", 0.3, 0.5, 0, 0.7, 0.0),  # flat top-p at T 0.5
    ("", 0.3, 1.0, 0, 1.0, 0.0),  # no filter
]


def wide_sampling_rows(vocab: int, dtype: torch.dtype, seed: int) -> tuple:
    """Inputs of ``sampling.sample_tokens`` with one row of each kind in WIDE_SAMPLING_ROWS (a
    repetition penalty on row 0, a bias on row 1) -> (logits, temperature, keys, counters, Filters,
    RowState, the rows the histogram passes should settle)."""
    from tokenmill.kernels.triton.sampling import Filters

    gen = torch.Generator().manual_seed(seed)
    rows = len(WIDE_SAMPLING_ROWS)
    logits = torch.randn(rows, vocab, generator=gen)
    temperature, top_p, min_p = torch.zeros(rows), torch.ones(rows), torch.zeros(rows)
    top_k = torch.zeros(rows, dtype=torch.int64)
    histogram_rows = []
    for i, (kind, scale, t, k, p, mp) in enumerate(WIDE_SAMPLING_ROWS):
        logits[i] *= scale
        if kind.endswith("masked"):
            logits[i, ::3] = float("-inf")
        elif kind.endswith("ties"):
            logits[i] = (logits[i] * 8).round() / 8
        elif kind == "equal":
            logits[i, torch.randperm(vocab, generator=gen)[:5]] = 2.0
        if kind.startswith("hist") or (kind == "equal" and vocab <= 8192):
            histogram_rows.append(i)
        temperature[i], top_k[i], top_p[i], min_p[i] = t, k, p, mp
    state = _one_slot_state(vocab, rows, gen)
    keys = torch.randint(0, 2**62, (rows,), generator=gen)
    counters = torch.randint(0, 2**40, (rows,), generator=gen)
    return (logits.to(dtype), temperature, keys, counters, Filters(top_k, top_p, min_p), state, histogram_rows)


# (kind, tail or logit scale, temperature, top_k, top_p, min_p) of each row of ``round_sampling_rows``.
# "tail": three tokens hold 40% of the mass above a long flat tail (past 8,192 tokens, so no gather
# holds it), and top_p about 0.5 keeps them and the top of the tail: a Gumbel argmax over the bound lo
# lands outside the kept set often (round 1 rejects ~40%, later rounds less), so over the tail rows
# some settle in round 1, some in round 2 or 3, some take the exact path after the rounds. Mixed
# with rows of every other kind.
ROUND_SAMPLING_ROWS = [
    ("tail", 0.4, 1.0, 0, 0.5, 0.0),  # penalised
    ("tail", 0.3, 1.0, 0, 0.5, 0.0),  # biased
    ("tail", 0.5, 1.0, 0, 0.5, 0.0),  # seeded: rows "copy" and "next" share its key
    ("tail", 0.6, 0.9, 0, 0.5, 0.0),
    ("tail", 0.5, 1.0, 0, 0.6, 0.0),
    ("tail", 0.3, 1.0, 0, 0.45, 0.0),
    ("tail", 0.5, 1.0, 0, 0.5, 1e-4),  # min-p far below the cut
    ("tail", 0.4, 1.0, 0, 0.5, 0.0),
    ("tail", 0.5, 1.3, 0, 0.55, 0.0),
    ("tail", 0.3, 0.7, 0, 0.5, 0.0),
    ("copy", 0.5, 1.0, 0, 0.5, 0.0),  # row 2 again, same key and counter: the same draw
    ("next", 0.5, 1.0, 0, 0.5, 0.0),  # row 2's logits and key, the next counter
    ("flat", 0.3, 1.0, 0, 0.9, 0.0),  # flat top-p 0.9: round 1 settles it most of the time
    ("flat", 0.5, 0.8, 0, 0.95, 0.02),  # with min-p below the cut
    ("flat", 0.3, 1.0, 0, 0.8, 0.3),  # top-p below min-p's cut: lo is t_min, round 1's check passes by it
    ("ties", 0.3, 1.0, 0, 0.9, 0.0),  # multiples of 1/8: many ties at the cut and at each draw
    ("flat", 0.3, 0.0, 0, 0.5, 0.0),  # greedy
    ("flat", 0.3, 1.0, 20, 0.9, 0.0),  # top-k bounds it: the threshold kernel
    ("flat", 0.3, 1.0, 0, 1.0, 0.05),  # min-p alone
    ("flat", 5.0, 1.0, 0, 0.9, 0.0),  # peaked: the threshold kernel gathers and draws it
]


def round_sampling_rows(vocab: int, dtype: torch.dtype, seed: int) -> tuple:
    """Inputs of ``sampling.sample_tokens`` with one row of each kind in ROUND_SAMPLING_ROWS (a
    repetition penalty on row 0, a bias on row 1) -> (logits, temperature, keys, counters, Filters,
    RowState, the tail rows)."""
    from tokenmill.kernels.triton.sampling import Filters

    gen = torch.Generator().manual_seed(seed)
    rows = len(ROUND_SAMPLING_ROWS)
    logits = torch.randn(rows, vocab, generator=gen)
    temperature, top_p, min_p = torch.zeros(rows), torch.ones(rows), torch.zeros(rows)
    top_k = torch.zeros(rows, dtype=torch.int64)
    keys = torch.randint(0, 2**62, (rows,), generator=gen)
    counters = torch.randint(0, 2**40, (rows,), generator=gen)
    tail_rows = []
    for i, (kind, scale, t, k, p, mp) in enumerate(ROUND_SAMPLING_ROWS):
        logits[i] *= scale
        if kind == "tail":
            tail_rows.append(i)
            tail = torch.logsumexp(logits[i] / t, dim=0)  # the heads weigh 2/3 of the tail: 40% of the mass
            heads = torch.randperm(vocab, generator=gen)[:3]
            logits[i, heads] = t * (tail + torch.log(torch.tensor(2 / 9)))
        elif kind == "ties":
            logits[i] = (logits[i] * 8).round() / 8
        elif kind in ("copy", "next"):
            logits[i], keys[i], counters[i] = logits[2], keys[2], counters[2] + (kind == "next")
        temperature[i], top_k[i], top_p[i], min_p[i] = t, k, p, mp
    state = _one_slot_state(vocab, rows, gen)
    return logits.to(dtype), temperature, keys, counters, Filters(top_k, top_p, min_p), state, tail_rows


def _one_slot_state(vocab: int, rows: int, gen: torch.Generator):
    """Per-row state with one slot each: row 0 penalised (300 random output counts, a random prompt
    bitmap; repetition 1.2, frequency 0.1, presence 0.05), row 1 biased (N(0, 0.2) on every token)."""
    from tokenmill.kernels.sampling_args import counts_width
    from tokenmill.kernels.triton.sampling import RowState

    words = -(-vocab // 32)
    counts = torch.zeros(1, counts_width(vocab), dtype=torch.int16)
    counts[0].index_add_(0, torch.randint(0, vocab, (300,), generator=gen), torch.ones(300, dtype=torch.int16))
    prompt_bits = torch.randint(-2**31, 2**31, (1, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bias = torch.randn(1, vocab, generator=gen) * 0.2

    def slot_of(row: int) -> torch.Tensor:
        return torch.tensor([0 if i == row else -1 for i in range(rows)], dtype=torch.int32)

    return RowState(slot_of(1), bias, slot_of(0), counts, prompt_bits, torch.tensor([1.2]), torch.tensor([0.1]),
                    torch.tensor([0.05]))
