"""The sampling kernels' cases and checks under the interpreter, run by the workers of
``test_kernels_interpret.py`` (which merges ``CASES`` and ``CHECKS`` into its own): the Gumbel-max
draw, and penalties, logit bias and top-k / top-p / min-p with the draw (narrow rows, wide top-p
rows through the argmax rounds and the histogram passes), against ``reference.sample_ref`` token for
token; the sampled tokens' logprobs in two passes against ``reference.token_logprobs_ref``, and the
sampler's path without a table (``sampler.kernel_logprobs``: the kernel, then for k >= 2 topk of the
logits) against its table path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


# The sampler's draw (temperature, Philox Gumbel noise, argmax): vocabularies under one chunk (and
# not a multiple of 4), exactly one, and over several chunks.
for _dt in ("float32", "float16"):
    for _vocab in (37, 2048, 5003):
        _case("gumbel_argmax", f"gumbel-argmax-v{_vocab}-{_dt}", dtype=_dt, vocab=_vocab)

# The draw's noise alone against its float64 twin: the range's ends and the series' edge.
_case("gumbel_noise", "gumbel-noise", count=4096)

# Penalties, logit bias, top-k / top-p / min-p and the draw (three kernels and the draw): one row of
# each kind (see _check_sample_tokens), over vocabularies that hold a wide row's bracket at once
# (5003) or need sweeps to narrow it (20000, past the 8,192-token bracket).
_case("sample_tokens", "sample-tokens-v5003-float32", dtype="float32", vocab=5003, rows=None)
_case("sample_tokens", "sample-tokens-v5003-float16", dtype="float16", vocab=5003, rows=None)
_case("sample_tokens", "sample-tokens-v20000-wide-float32", dtype="float32", vocab=20000, rows=[0, 3, 5, 11])
# Each slot's own counts read from the int16 table, odd vocabularies (a padding column a row).
_case("penalty_counts", "penalty-counts-v5003-float32", dtype="float32", vocab=5003)
_case("penalty_counts", "penalty-counts-v2049-float16", dtype="float16", vocab=2049)
# Wide top-p rows through the histogram passes (several splits, a last partial tile), mixed with
# narrow, min-p-only and greedy rows; at 9,000 tokens a row of ties overflows the bracket (sweeps).
_case("sample_tokens_wide", "sample-tokens-wide-v5003-float32", dtype="float32", vocab=5003)
_case("sample_tokens_wide", "sample-tokens-wide-v5003-float16", dtype="float16", vocab=5003)
_case("sample_tokens_wide", "sample-tokens-wide-v9000-float32", dtype="float32", vocab=9000)
# Wide top-p rows settled by argmax rounds (in round 1, 2 or 3) or left to the exact path after them,
# mixed with rows of every other kind (seeds chosen so that every path is taken; the check asserts it).
# fp32 only: the round kernels read fp16 logits through the scores every kernel here shares, and
# sample-tokens-wide-v5003-float16 draws eight of its fp16 rows in the rounds (the interpreter takes
# ~15 s a run of this check).
_case("sample_tokens_rounds", "sample-tokens-rounds-v9000-float32", dtype="float32", vocab=9000, seed=5)
# The sampled tokens' logprobs, ranks and top-1 in two passes (logprobs 0 / 1): a vocabulary under one
# block, one over several with a partial last block, ties at the row's maximum and at the sampled token.
for _dt in ("float32", "float16"):
    for _vocab in (37, 9000):
        for _top in (False, True):
            _case("token_logprobs", f"token-logprobs-v{_vocab}-{'top1' if _top else 'top0'}-{_dt}", dtype=_dt,
                  vocab=_vocab, top=_top)
# The sampler's logprobs without a table against ``with_logprobs`` over ``log_softmax``, for every k
# kind (0, the kernel's top-1, topk for 2 and more), over one block and several; the rows of
# support/logprob_cases.py: random, ties inside the top k, flat.
for _dt in ("float32", "float16"):
    for _vocab, _ks in ((9000, (0, 1, 2, 5, 20)), (37, (2, 20))):
        for _k in _ks:
            _case("kernel_logprobs", f"kernel-logprobs-k{_k}-v{_vocab}-{_dt}", dtype=_dt, vocab=_vocab, k=_k)


@contextlib.contextmanager
def _poisoned_empty() -> Iterator[None]:
    """``torch.empty`` filled with NaN (integers with -7) meanwhile, so an output a kernel leaves
    unwritten cannot pass for a result."""
    import torch

    empty = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def _check_gumbel_argmax(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import gumbel_argmax_ref
    from tokenmill.kernels.triton.sampling import gumbel_argmax

    vocab, dtype = p["vocab"], getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen) * 4
    logits[1, ::3] = float("-inf")  # banned tokens are never drawn
    top = logits.max() + 1
    logits[0, [vocab // 2, vocab - 1]] = top  # a greedy tie (across chunks when vocab > one chunk)
    logits[4, 3] = top  # greedy
    logits[5] = 0.0  # a flat row: the draw is all noise
    logits = logits.to(dtype)
    temperature = torch.tensor([0.0, 0.3, 1.0, 0.7, 0.0, 2.0, 1e-2, 1.0])
    keys = torch.randint(0, 2**63 - 1, (8,), generator=gen)
    counters = torch.tensor([0, 1, 2**32 + 3, 2**40, 5, 6, 7, 2**31 + 1])
    got = gumbel_argmax(logits, temperature, keys, counters)
    want = gumbel_argmax_ref(logits, temperature, keys, counters)
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    assert got[0] == vocab // 2 and got[4] == 3, "greedy rows take the first argmax"
    assert got[1] % 3 != 0, "drew a banned (-inf) token"
    # The draw depends on the key and counter, and on nothing else in the batch.
    alone = gumbel_argmax(logits[5:6], temperature[5:6], keys[5:6], counters[5:6])
    assert alone.tolist() == got[5:6].tolist()
    flat = logits[5].expand(16, vocab).contiguous()
    draws = gumbel_argmax(flat, torch.ones(16), keys[5].expand(16).contiguous(), torch.arange(16))
    assert len(set(draws.tolist())) > 8, draws.tolist()


def _check_gumbel_noise(p: dict[str, Any]) -> None:
    from support.gumbel_noise_kernel import EXACT_LOG_TOLERANCE, NOISE_MAX, NOISE_MIN, gumbel_noise, noise_inputs
    from tokenmill.kernels.reference import gumbel_from_bits_ref

    bits = noise_inputs(p["count"], seed=7)
    got = gumbel_noise(bits, fast_log=False)
    want = gumbel_from_bits_ref(bits)
    assert NOISE_MIN <= float(got.min()) and float(got.max()) <= NOISE_MAX, (float(got.min()), float(got.max()))
    error = (got - want).abs()
    assert float(error.max()) <= EXACT_LOG_TOLERANCE, (float(error.max()), int(bits[error.argmax()]))


def _state_rows(state, rows):
    """``state`` for a subset of its rows: their slots; the tables and per-slot factors stay whole."""
    return state._replace(bias_slots=state.bias_slots[rows], penalty_slots=state.penalty_slots[rows])


def _check_sample_tokens(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import sample_ref
    from support.sampling_cases import sampling_rows
    from tokenmill.kernels.triton.sampling import sample_tokens

    logits, temperature, keys, counters, filters, state = sampling_rows(p["vocab"], getattr(torch, p["dtype"]), p["vocab"])
    if p["rows"] is not None:  # a subset of the rows (the state tables, penalty factors included, stay whole)
        take = torch.tensor(p["rows"])
        logits, temperature, keys, counters = (t[take] for t in (logits, temperature, keys, counters))
        filters = type(filters)(*(f[take] for f in filters))
        state = _state_rows(state, take)
    got = sample_tokens(logits, temperature, keys, counters, filters, state)
    want = sample_ref(logits, temperature, keys, counters, tuple(filters), tuple(state))
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    if p["rows"] is not None:
        return
    # Each row depends on its own inputs only: a row alone draws what it drew in the batch.
    for row in (1, 9):
        alone = [t[row : row + 1] for t in (logits, temperature, keys, counters)]
        one_filters = type(filters)(*(f[row : row + 1] for f in filters))
        one_state = _state_rows(state, slice(row, row + 1))
        assert sample_tokens(*alone, one_filters, one_state).tolist() == got[row : row + 1].tolist()
    # Without filters or state, the plain draw matches its twin too.
    assert sample_tokens(logits, temperature, keys, counters).tolist() == sample_ref(logits, temperature, keys, counters).tolist()


def _check_sample_tokens_wide(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import filter_threshold_ref, sample_ref
    from support.sampling_cases import wide_sampling_rows
    from tokenmill.kernels.triton import sampling

    logits, temperature, keys, counters, filters, state, histogram_rows = wide_sampling_rows(
        p["vocab"], getattr(torch, p["dtype"]), seed=p["vocab"])
    got = sampling.sample_tokens(logits, temperature, keys, counters, filters, state)
    want = sample_ref(logits, temperature, keys, counters, tuple(filters), tuple(state))
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    # The thresholds are the twin's, and the wide top-p rows were settled by the histogram passes.
    args = (logits, temperature, keys, counters, filters, sampling._state_args(state, logits), True, False)
    thresholds, chosen = sampling._thresholds(*args)
    for row, s in enumerate(_twin_scores(logits, temperature, state)):
        k, top_p, min_p = (float(f[row]) for f in filters)
        want_t = filter_threshold_ref(s, int(k), top_p, min_p) if float(temperature[row]) > 0 else float("-inf")
        if float(temperature[row]) > 0 and (k > 0 or top_p < 1.0 or min_p > 0.0):
            assert float(thresholds[row]) == want_t, (row, float(thresholds[row]), want_t)
    settled = [row for row in range(len(chosen)) if int(chosen[row]) == -4]
    assert settled == histogram_rows, (settled, histogram_rows)
    # Deterministic: the same call gives the same bits; and the same with one split a row.
    again, chosen_again = sampling._thresholds(*args)
    assert torch.equal(again, thresholds) and torch.equal(chosen_again, chosen)
    programs = sampling._WIDE_PROGRAMS
    try:
        sampling._WIDE_PROGRAMS = 1
        one_split, _ = sampling._thresholds(*args)
    finally:
        sampling._WIDE_PROGRAMS = programs
    assert torch.equal(one_split, thresholds), (one_split.tolist(), thresholds.tolist())
    assert sampling.sample_tokens(logits, temperature, keys, counters, filters, state).tolist() == got.tolist()
    # A caller that says no row has top-p alone gets no histogram passes; such rows still come out
    # right (by sweeps), so a wrong hint costs time, never a wrong draw.
    without, chosen_without = sampling._thresholds(*args[:-1], False, False)
    assert torch.equal(without, thresholds) and not (chosen_without == -4).any()


def _check_sample_tokens_rounds(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import filter_threshold_ref, sample_ref
    from support.sampling_cases import ROUND_SAMPLING_ROWS, round_sampling_rows
    from tokenmill.kernels.triton import sampling

    logits, temperature, keys, counters, filters, state, tail_rows = round_sampling_rows(
        p["vocab"], getattr(torch, p["dtype"]), seed=p["seed"])
    rows = len(ROUND_SAMPLING_ROWS)
    want = sample_ref(logits, temperature, keys, counters, tuple(filters), tuple(state))
    # Without rounds: every filtered row's threshold the twin's, and the tail rows wide (-4).
    args = (logits, temperature, keys, counters, filters, sampling._state_args(state, logits), True, False)
    exact, exact_chosen = sampling._thresholds(*args)
    for row, s in enumerate(_twin_scores(logits, temperature, state)):
        k, top_p, min_p = (float(f[row]) for f in filters)
        if float(temperature[row]) > 0 and (k > 0 or top_p < 1.0 or min_p > 0.0):
            assert float(exact[row]) == filter_threshold_ref(s, int(k), top_p, min_p), row
    assert all(int(exact_chosen[row]) == -4 for row in tail_rows), exact_chosen.tolist()
    # With 1, 2, 3 rounds (the default among them) the draw is the twin's; and in the thresholds the
    # draw was made from: a row the rounds settle holds the twin's draw (no threshold), stays settled
    # with more rounds, and every other row comes out of the exact path exactly as without rounds.
    settled_in: dict[int, int] = {}
    default = sampling._ROUNDS
    assert default in (1, 2, 3)
    try:
        for rounds in (1, 2, 3):
            sampling._ROUNDS = rounds
            with _recorded_thresholds() as calls:
                drawn = sampling.sample_tokens(logits, temperature, keys, counters, filters, state)
            assert drawn.tolist() == want.tolist(), (rounds, drawn.tolist(), want.tolist())
            [(called_rounds, (thresholds, chosen))] = calls
            assert called_rounds == rounds, (called_rounds, rounds)
            if rounds == default:
                got = drawn
            settled = {row for row in range(rows) if int(chosen[row]) >= 0 and int(exact_chosen[row]) < 0}
            assert set(settled_in) <= settled, (rounds, sorted(settled_in), sorted(settled))
            for row in range(rows):
                if row in settled:
                    settled_in.setdefault(row, rounds)
                    assert int(chosen[row]) == int(want[row]) and float(thresholds[row]) == float("-inf"), (rounds, row)
                else:
                    assert int(chosen[row]) == int(exact_chosen[row]), (rounds, row, chosen.tolist())
                    assert float(thresholds[row]) == float(exact[row]), (rounds, row)
    finally:
        sampling._ROUNDS = default
    by_round = [sorted(row for row in tail_rows if settled_in.get(row) == r) for r in (1, 2, 3)]
    left = sorted(set(tail_rows) - set(settled_in))
    assert all(by_round) and left, f"settled in rounds 1, 2, 3: {by_round}; left to the exact path: {left}"
    # Seeded rows: the same key, counter and logits draw the same token ("copy"), a row alone draws
    # what it drew in the batch ("next", and row 2's settling round).
    copy, following = (next(i for i, r in enumerate(ROUND_SAMPLING_ROWS) if r[0] == kind) for kind in ("copy", "next"))
    assert got[copy] == got[2] and settled_in.get(copy) == settled_in.get(2)
    for row in (2, following):
        one = [t[row : row + 1] for t in (logits, temperature, keys, counters)]
        one_filters = type(filters)(*(f[row : row + 1] for f in filters))
        one_state = _state_rows(state, slice(row, row + 1))
        assert sampling.sample_tokens(*one, one_filters, one_state).tolist() == got[row : row + 1].tolist(), row


@contextlib.contextmanager
def _recorded_thresholds() -> Iterator[list[tuple[int, Any]]]:
    """``sampling._thresholds`` records each call's ``rounds`` and result meanwhile: the thresholds a
    ``sample_tokens`` call drew from, without computing them a second time (the interpreter is slow)."""
    import inspect

    from tokenmill.kernels.triton import sampling

    original = sampling._thresholds
    calls: list[tuple[int, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls.append((inspect.signature(original).bind(*args, **kwargs).arguments.get("rounds", 0), result))
        return result

    sampling._thresholds = recording
    try:
        yield calls
    finally:
        sampling._thresholds = original


def _twin_scores(logits: Any, temperature: Any, state: Any) -> list:
    """Each row's tempered, biased and penalised scores, as ``reference.sample_ref`` computes them."""
    import torch

    from tokenmill.kernels.reference import penalize_ref, prompt_mask_ref

    x = logits.float().clone()
    bias_slots, bias, penalty_slots, counts, prompt_bits, rep, freq, pres = state
    rows = torch.nonzero(bias_slots >= 0).flatten()
    x[rows] += bias[bias_slots[rows].long()]
    rows = torch.nonzero(penalty_slots >= 0).flatten()
    slots = penalty_slots[rows].long()
    x[rows] = penalize_ref(x[rows], counts[slots, : x.shape[1]], prompt_mask_ref(prompt_bits[slots], x.shape[1]),
                           rep[rows], freq[rows], pres[rows])
    return [x[row] / torch.tensor(t) if t > 0 else x[row] for row, t in enumerate(temperature.tolist())]


def _check_token_logprobs(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import token_logprobs_ref
    from tokenmill.kernels.triton.token_logprobs import token_logprobs

    dtype, vocab, top = getattr(torch, p["dtype"]), p["vocab"], p["top"]
    gen = torch.Generator().manual_seed(vocab + top)
    rows = 6
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[1, 5] = logits[1, vocab - 2] = logits[1].max() + 1  # two equal largest: the first is the top-1
    logits[2, :] = 0.5  # every entry equal: rank 1, top-1 id 0
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[3] = int(logits[3].float().argmax())  # the row's best: rank 1
    tokens[4] = int(logits[4].float().argmin())  # its worst: rank near V
    logits[5, tokens[5]] = logits[5, 3] = logits[5].max() + 0.5  # the sampled token tied with another at the top
    with _poisoned_empty():
        got = token_logprobs(logits, tokens, top)
    want = token_logprobs_ref(logits, tokens, top)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(got[1], want[1]), (got[1], want[1])
    # The row's max exactly (a logit), its log-normaliser to float32 rounding.
    assert torch.equal(got.row_max, want[4]), (got.row_max, want[4])
    torch.testing.assert_close(got.log_sum, want[5], atol=2e-6, rtol=1e-6)
    assert want[1][4] > vocab // 2 and want[1][2] == 1 and want[1][5] == 1  # the cases above are what they say
    if top:
        assert torch.equal(got[2], want[2]), (got[2], want[2])
        assert got[2][1, 0] == 5 and got[2][2, 0] == 0
        torch.testing.assert_close(got[3], want[3], atol=2e-5, rtol=1e-5)
    else:
        assert got[2] is None and got[3] is None


def _check_kernel_logprobs(p: dict[str, Any]) -> None:
    import torch

    from support.logprob_cases import assert_matches_table, tied_logprob_rows
    from tokenmill.worker.sampler import kernel_logprobs

    dtype, vocab, k = getattr(torch, p["dtype"]), p["vocab"], p["k"]
    logits, tokens = tied_logprob_rows(vocab, k, dtype, seed=vocab + 97 * k)
    top = logits[1].float().topk(k + 1).values
    assert k < 2 or (top[0] == top[1] and top[k - 1] > top[k]), "row 1: ties inside the top k, none across it"
    with _poisoned_empty():
        got = kernel_logprobs(logits, tokens, k)
    assert_matches_table(got, logits, k)


def _check_penalty_counts(p: dict[str, Any]) -> None:
    """The kernels read each slot's own counts from the int16 table (int32 words, rows of
    ``counts_width(V)`` columns, V odd here): greedy rows over flat logits, so a row's token is decided
    by its slot's counts alone. Slot s (frequency 1) penalises tokens 0 .. k_s - 1, so its rows take
    k_s; slot 4 (frequency -1) boosts the row's last token most (the word a padding column shares);
    slot 5 holds a count at COUNT_MAX on a token near the middle (frequency -1e-3); a row without a
    slot takes token 0. Any read of a neighbouring slot's row, or the wrong half of a word, moves them."""
    import torch

    from tokenmill.kernels.reference import sample_ref
    from tokenmill.kernels.sampling_args import COUNT_MAX, Filters, RowState, counts_width
    from tokenmill.kernels.triton.sampling import sample_tokens

    vocab = p["vocab"]
    counts = torch.zeros(6, counts_width(vocab), dtype=torch.int16)
    firsts = [3 + 7 * s for s in range(4)]
    for s, k in enumerate(firsts):
        counts[s, :k] = 1 + s
    counts[4, : vocab // 3] = 1
    counts[4, vocab - 1] = 5
    counts[5, vocab // 2 + 1] = COUNT_MAX
    frequency = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1e-3])
    slots = torch.tensor([3, 0, 4, 1, 2, -1, 5, 0, 3], dtype=torch.int32)
    rows = len(slots)
    state = RowState(torch.full((rows,), -1, dtype=torch.int32), torch.zeros(1, vocab), slots, counts,
                     torch.zeros(6, -(-vocab // 32), dtype=torch.int32), torch.ones(6), frequency, torch.zeros(6))
    logits = torch.zeros(rows, vocab, dtype=getattr(torch, p["dtype"]))
    temperature, keys = torch.zeros(rows), torch.zeros(rows, dtype=torch.int64)
    filters = Filters(torch.zeros(rows, dtype=torch.int64), torch.ones(rows), torch.zeros(rows))
    got = sample_tokens(logits, temperature, keys, keys, filters, state).tolist()
    want = [firsts[s] if 0 <= s < 4 else {4: vocab - 1, 5: vocab // 2 + 1}.get(s, 0) for s in slots.tolist()]
    assert got == want, (got, want)
    assert got == sample_ref(logits, temperature, keys, keys, filters, state).tolist()


CHECKS = {
    "token_logprobs": _check_token_logprobs,
    "kernel_logprobs": _check_kernel_logprobs,
    "gumbel_argmax": _check_gumbel_argmax,
    "gumbel_noise": _check_gumbel_noise,
    "sample_tokens": _check_sample_tokens,
    "sample_tokens_wide": _check_sample_tokens_wide,
    "sample_tokens_rounds": _check_sample_tokens_rounds,
    "penalty_counts": _check_penalty_counts,
}
