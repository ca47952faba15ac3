"""Turns the last-position logits of each sampling sequence into the next tokens.

Order of operations (vLLM's): logprobs are taken from the raw logits (the top ones, or those of
each row's logprob_token_ids, gathered by ids kept on the device; a structured-output row's logits
masked by its grammar first, as vLLM's runner masks them before its sampler); then the logit controls
(allowed_token_ids, logit_bias, bad_words, logits_processors), penalties, the min_tokens mask,
greedy argmax for temperature 0; else temperature, top-k, top-p, min-p and a draw.

``LLM(logprobs_mode=...)`` (vLLM's; RL loops compare the sampled distribution with the trainer's):
``raw_logprobs`` as above, ``raw_logits`` the raw logits themselves; ``processed_logprobs`` /
``processed_logits`` those of the distribution the tokens are drawn from: after the controls and
penalties and, unless every row is greedy, temperature (1 for greedy rows) and the filters, the
cut tokens at -inf. Those steps then run in torch on the logits (`_processed`) and the draw reads
the result, so every token drawn is one the reported distribution allows.

On a GPU, raw logprobs of a step that writes nothing into its logits (no bans, grammars, logits
processors) come without a [rows, V] float32 table: the sampled tokens' logprobs and ranks from a
two-pass kernel, the top ones from ``topk`` of the logits in their own dtype (``kernel_logprobs``).

Nothing here reads the device back or rebuilds per-sequence state from Python lists: a logit bias
(logit_bias, allowed_token_ids), the penalties' counts and prompt tokens and the recent ids that
bad words need live on the device, per sequence (``sampling_state.py``); bans (bad words, eos
below min_tokens) are applied in place. On a GPU the Triton kernels of
``kernels/triton/sampling.py`` add the bias and penalties as they read the logits and do the
filters and the draw without sorting; only structured outputs and Python logits processors, which
the engine steps synchronously anyway, work on a float32 copy in torch first.

A draw is an exact sample of softmax(logits / T) by a race of random noise: ``argmax(probs / E)``
with ``E ~ Exp(1)`` per token, which is ``argmax(logits / T + g)`` with Gumbel noise g. Each row's
noise is a pure function of its (key, counter) pair, which the runner sets to (the request's seed,
the output position) for seeded requests, so their samples depend on nothing else in the batch.
On a GPU the kernels draw Philox noise; on the CPU torch's generator, seeded per row from the
pair, draws E (Philox in plain torch would cost more than the model's forward here).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from tokenmill.engine.step import RequestCodeError, SamplerOutput
from tokenmill.kernels.sampling_args import Filters, RowState, counts_width
from tokenmill.worker.sampling_state import (
    BadWordState, LogprobIdsState, StepRows, apply_bias, apply_penalties, gather_ids,
)


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [N] float, 0 = greedy
    all_greedy: bool
    # The filters, all three or none (when no row uses any).
    top_k: torch.Tensor | None  # [N] int64, 0 = off
    max_top_k: int  # the largest top_k of any row (a host int: no device sync), 0 when none uses it
    top_p: torch.Tensor | None  # [N] float, 1 = off
    min_p: torch.Tensor | None  # [N] float, 0 = off
    top_p_alone: bool = True  # some row has top-p without top-k (a host fact: else the GPU skips two passes)
    # Some row has top-p < 1 / min-p > 0 (host facts, so the torch filters test no device tensor).
    any_top_p: bool = True
    any_min_p: bool = True
    # The random draw of each row: a 64-bit key and a counter (see the module docstring); None when
    # every row is greedy.
    draw_keys: torch.Tensor | None = None  # [N] int64
    draw_counters: torch.Tensor | None = None  # [N] int64
    # Logit bias and penalties from the per-sequence device state, only when some row has either;
    # the rows that have each, with their slots.
    state: RowState | None = None
    bias_rows: StepRows | None = None
    penalty_rows: StepRows | None = None
    bad_words: tuple[BadWordState, StepRows] | None = None
    # Tokens that may not be sampled yet (eos and stop ids while below min_tokens): [2, B] (row, id).
    banned: torch.Tensor | None = None
    max_num_logprobs: int = -1  # -1: no row wants logprobs; else the most top logprobs a row wants
    # The rows with logprob_token_ids and the device state holding their ids.
    logprob_ids: tuple[LogprobIdsState, StepRows] | None = None
    # vLLM-style logits processors per row: (row, its sequence's id, callables, prompt ids, output ids so far).
    processors: list[tuple[int, int, list, list[int], list[int]]] | None = None
    # Structured outputs: xgrammar's packed allowed-token bitmask and the function applying it.
    grammar_bitmask: torch.Tensor | None = None  # [N, ceil(V / 32)] int32
    apply_grammar: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    # Rows whose top logprobs are ranked among the tokens their grammar allows (beam search under a
    # grammar; the values stay the raw logprobs): [N] bool, None when no row is one.
    rank_within_grammar: torch.Tensor | None = None
    # LLM(logits_processors=...): their apply, on the float32 logits of every row.
    batch_processors: Callable[[torch.Tensor], torch.Tensor] | None = None
    # What logprobs report (LLM(logprobs_mode=...), vLLM's four modes; see the module docstring).
    logprobs_mode: str = "raw_logprobs"

    @property
    def filters(self) -> Filters | None:
        return None if self.top_k is None else Filters(self.top_k, self.top_p, self.min_p)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] in the model's dtype (the step's own: bans are applied to them in place)."""
        mode = batch.logprobs_mode if batch.max_num_logprobs >= 0 else None
        raw_logprobs = None
        # Raw logprobs from logits nothing below writes into: one Triton kernel reads them after the
        # draw (and topk the raw logits for k >= 2), no table (kernel_logprobs). Bans go into the
        # logits in place, and so do grammars, and processors when the logits are float32 already
        # (.float() makes no copy then), so steps with any of them take the table path (raw_outputs).
        two_passes = (mode == "raw_logprobs" and logits.is_cuda
                      and logits.stride(1) == 1 and batch.bad_words is None and batch.banned is None
                      and batch.grammar_bitmask is None and not batch.processors and batch.batch_processors is None
                      and batch.logprob_ids is None and batch.rank_within_grammar is None)
        raw_logits = logits
        # The table path's raw values are kept in the logits' own dtype (a copy where the controls
        # below write into the logits) and turned into float32 logprobs LOGPROB_TABLE_ROWS rows at
        # a time once the tokens are drawn (raw_outputs), rather than held as a [N, V] float32 table:
        # at 1,024 rows the table and the float32 copy it was made from were ~1.2 GB of V = 152K,
        # which the memory plan set aside from the KV cache (worker/sampling_profile.py).
        raw_values = None
        if mode == "raw_logits" or (mode == "raw_logprobs" and not two_passes):
            writes = (batch.grammar_bitmask is not None or batch.bad_words is not None or bool(batch.processors)
                      or batch.batch_processors is not None or batch.banned is not None)
            raw_values = logits.clone() if writes else logits
            if batch.grammar_bitmask is not None:
                _mask_by_grammar(raw_values, batch)
        state = batch.state
        bias_pending = batch.bias_rows is not None  # the logit bias is still to be added (a host fact)
        if batch.processors or batch.batch_processors:
            # Python processors see float32 logits with the controls before them applied, in vLLM's
            # order; the kernels then add only the penalties.
            logits = logits.float()
            if batch.grammar_bitmask is not None:
                batch.apply_grammar(logits, batch.grammar_bitmask)  # in place: disallowed tokens -> -inf
            if batch.bias_rows is not None:
                apply_bias(logits, state.bias, batch.bias_rows)
                state = state._replace(bias_slots=torch.full_like(state.bias_slots, -1))
                bias_pending = False
        elif batch.grammar_bitmask is not None:
            # In place in the logits' own dtype (-inf is exact in any; the kernels read them into
            # float32 as they would a float32 copy): no [rows, V] float32 copy a step, and the
            # kernels LLM() compiled for the model's dtype (the bias, added to -inf or not, commutes).
            batch.apply_grammar(logits, batch.grammar_bitmask)
        if batch.bad_words is not None:
            batch.bad_words[0].apply(logits, batch.bad_words[1])
        for row, seq_id, functions, prompt_ids, output_ids in batch.processors or ():
            for i, fn in enumerate(functions):
                try:
                    # vLLM's two forms: fn(output_ids, logits) or fn(prompt_ids, output_ids, logits).
                    takes_prompt = len(inspect.signature(fn).parameters) == 3
                    args = (prompt_ids, list(output_ids), logits[row]) if takes_prompt else (list(output_ids), logits[row])
                    logits[row] = fn(*args)
                except Exception as exc:  # the request's own code: it fails alone (LLMEngine.step)
                    name = getattr(fn, "__qualname__", type(fn).__name__)
                    raise RequestCodeError(seq_id, f"SamplingParams.logits_processors[{i}] ({name}) raised "
                                                   f"{type(exc).__name__}: {exc}") from exc
        if batch.batch_processors is not None:
            logits = batch.batch_processors(logits)
        if batch.banned is not None:
            # The value made on the logits' device: ``logits[rows, ids] = float("-inf")`` would copy a
            # CPU scalar to the GPU, a host sync every step a sequence is short of its min_tokens.
            logits.index_put_((batch.banned[0], batch.banned[1]), logits.new_full((), float("-inf")))
        if mode in ("processed_logprobs", "processed_logits") or not logits.is_cuda:
            # The CPU always samples this way: the same steps in plain torch, from the same state.
            token_ids, processed = self._processed(logits, batch, state, bias_pending)
            if mode == "processed_logits":
                raw_logprobs = processed
            elif mode == "processed_logprobs":
                raw_logprobs = _log_softmax(processed, batch)
        else:
            token_ids = self._sample_on_gpu(logits, batch, state)
        if two_passes:
            return kernel_logprobs(raw_logits, token_ids, batch.max_num_logprobs)
        if raw_values is not None:
            return raw_outputs(raw_values, mode == "raw_logprobs", token_ids, batch, logits)
        output = with_logprobs(token_ids, raw_logprobs, batch.max_num_logprobs, _ranked(raw_logprobs, batch, logits))
        if batch.logprob_ids is not None:
            assert raw_logprobs is not None, "rows with logprob_token_ids count as rows wanting logprobs"
            output.requested_logprobs = batch.logprob_ids[0].gather(raw_logprobs, batch.logprob_ids[1])
        return output

    @staticmethod
    def precompile(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile every variant of the GPU sampling kernels for the model's logits: with and
        without filters, with and without per-sequence state, and the sampled tokens' logprobs
        with a top-1 or none (k >= 2 launch the top-1-less one; ``precompile.py`` runs this in
        ``parallel_compile``). float32 logits, which only Python logits processors lead to, compile
        when first met."""
        from tokenmill.kernels.triton.sampling import sample_tokens
        from tokenmill.kernels.triton.token_logprobs import token_logprobs

        logits = torch.empty(1, vocab_size, dtype=dtype, device=device)
        temperature = torch.ones(1, dtype=torch.float32, device=device)
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        slots = torch.zeros(1, dtype=torch.int32, device=device)
        table = torch.empty(1, vocab_size, dtype=torch.float32, device=device)
        counts = torch.empty(1, counts_width(vocab_size), dtype=torch.int16, device=device)
        bits = torch.empty(1, -(-vocab_size // 32), dtype=torch.int32, device=device)
        state = RowState(slots, table, slots, counts, bits, temperature, temperature, temperature)
        filters = Filters(ids, temperature, temperature)
        for f, alone in ((None, True), (filters, True), (filters, False)):
            for s in (None, state):
                sample_tokens(logits, temperature, ids, ids, f, s, top_p_alone=alone, compile_only=True)
        for top in (False, True):  # logprobs 1, and every other k
            token_logprobs(logits, ids, top, compile_only=True)

    @staticmethod
    def _sample_on_gpu(logits: torch.Tensor, batch: SamplingBatch, state: RowState | None) -> torch.Tensor:
        from tokenmill.kernels.triton.sampling import sample_tokens

        if batch.all_greedy and state is None:
            return logits.argmax(dim=-1)
        keys, counters = batch.draw_keys, batch.draw_counters
        if keys is None:  # every row greedy: no draw, but the kernel still applies the state
            keys = counters = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        return sample_tokens(logits, batch.temperature, keys, counters, batch.filters, state,
                             top_p_alone=batch.top_p_alone)

    @staticmethod
    def _processed(logits: torch.Tensor, batch: SamplingBatch, state: RowState | None,
                   bias_pending: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and the float32 logits they are drawn from (the CPU's sampling, and the
        ``processed_*`` logprobs modes'): the per-sequence state applied; unless every row is greedy,
        divided by the temperature (1 for greedy rows, which take the argmax) and filtered (the filters
        act on the tempered distribution). The draw then needs no state, filters or temperature."""
        processed = _with_state(logits, batch, state, bias_pending).float()
        if batch.all_greedy:
            return processed.argmax(dim=-1), processed
        temperature = batch.temperature
        processed = processed / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
        if batch.top_k is not None:
            processed = _filtered(processed, batch)
        keys, counters = batch.draw_keys, batch.draw_counters
        assert keys is not None and counters is not None, "a sampled row needs its draw key"
        unit = (temperature > 0.0).to(torch.float32)
        if processed.is_cuda:
            from tokenmill.kernels.triton.sampling import sample_tokens

            return sample_tokens(processed, unit, keys, counters), processed
        return _exponential_race(processed, unit, keys, counters), processed


# Rows whose float32 logprobs raw_outputs forms at a time: [rows, V] float32 twice over (the
# widened logits, their log-softmax) and a bool comparison, 9 V bytes a row (~1.4 GB for 1,024
# rows at V = 152K; ~350 MB for these).
LOGPROB_TABLE_ROWS = 256


def _ranked(logprobs: torch.Tensor | None, batch: SamplingBatch, logits: torch.Tensor,
            rows: slice = slice(None)) -> torch.Tensor | None:
    """``logprobs`` (of ``rows``) with the tokens a row's grammar forbids at -inf for the rows whose
    top logprobs are ranked within their grammar (beams): ``logits``, after the controls, hold -inf
    there (a beam row has no other bans)."""
    if batch.rank_within_grammar is None or logprobs is None:
        return logprobs
    forbidden = batch.rank_within_grammar[rows, None] & (logits[rows] == float("-inf"))
    return logprobs.masked_fill(forbidden, float("-inf"))


def _mask_by_grammar(raw: torch.Tensor, batch: SamplingBatch) -> None:
    """Mask the raw values of the rows under a grammar, in place, as vLLM's runner masks a grammar
    row's logits before its sampler reads its raw logprobs: a constrained request's logprobs are
    those of the distribution its grammar leaves (forbidden tokens at -inf, the allowed ones summing
    to 1), not the whole vocabulary's. Beams ranked within their grammar keep the vocabulary's
    (transformers' beam scores; `_ranked` drops their forbidden tokens from the top)."""
    assert batch.grammar_bitmask is not None and batch.apply_grammar is not None
    bitmask = batch.grammar_bitmask
    if batch.rank_within_grammar is not None:
        bitmask = bitmask.masked_fill(batch.rank_within_grammar.to(bitmask.device)[:, None], -1)
    batch.apply_grammar(raw, bitmask)


def _log_softmax(values: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Log-softmax of each row. A grammar row whose grammar left nothing to draw (every token at
    -inf: the draw took one outside it, and the request ends with "error") gets -inf, a token's
    logprob where the grammar gives it no chance, rather than log(0 / 0), a NaN."""
    logprobs = torch.log_softmax(values, dim=-1)
    if batch.grammar_bitmask is not None:
        logprobs.masked_fill_(logprobs.isnan(), float("-inf"))
    return logprobs


def raw_outputs(raw: torch.Tensor, as_logprobs: bool, token_ids: torch.Tensor, batch: SamplingBatch,
                logits: torch.Tensor) -> SamplerOutput:
    """``with_logprobs`` (and the rows' logprob_token_ids) of the raw values ``raw`` [N, V]: their
    log-softmax (``as_logprobs``) or themselves (raw_logits mode) in float32, formed
    LOGPROB_TABLE_ROWS rows at a time. Each row's values depend on that row alone, so they equal the
    whole table's. ``logits``: after the controls, for the rows ranked within their grammar."""
    k, parts = batch.max_num_logprobs, []
    ids_by_row = None
    if batch.logprob_ids is not None:
        ids_state, rows = batch.logprob_ids
        ids_by_row, has_ids = ids_state.by_row(raw.shape[0], rows)
    for start in range(0, max(raw.shape[0], 1), LOGPROB_TABLE_ROWS):  # one (empty) part for no rows
        chunk = slice(start, start + LOGPROB_TABLE_ROWS)
        table = raw[chunk].float()
        table = _log_softmax(table, batch) if as_logprobs else table
        part = with_logprobs(token_ids[chunk], table, k, _ranked(table, batch, logits, chunk))
        if ids_by_row is not None:
            part.requested_logprobs = gather_ids(table, ids_by_row[chunk], has_ids[chunk])
        parts.append(part)
        del table
    if len(parts) == 1:
        return parts[0]
    fields = zip(*(part.tensors() for part in parts))
    return SamplerOutput(*(None if column[0] is None else torch.cat(column) for column in fields))


def with_logprobs(token_ids: torch.Tensor, logprobs: torch.Tensor | None, k: int,
                  ranked: torch.Tensor | None = None) -> SamplerOutput:
    """The tokens' logprobs and ranks from a [N, V] table of logprobs, and the top ``k`` of ``ranked``
    (the logprobs, or them with some rows' forbidden tokens at -inf); prompt logprobs use it too."""
    if logprobs is None:
        return SamplerOutput(token_ids)
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
    top_logprobs, top_ids = (logprobs if ranked is None else ranked).topk(k, dim=-1) if k > 0 else (None, None)
    return SamplerOutput(token_ids, sampled, ranks, top_ids, top_logprobs)


def kernel_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
    """``with_logprobs(token_ids, log_softmax(logits.float()), k)`` without the [N, V] float32 table,
    for raw logits with contiguous rows on a GPU (or under Triton's interpreter; prompt logprobs use
    it too). The two-pass kernel gives each token's logprob and rank, for k == 1 the top-1 (the
    first of equal largest logits), and each row's max and log(sum exp(x - max)).

    For k >= 2 ``topk`` picks the ids from the logits in their own dtype (no float32 copy) and their
    logprobs are (x - max) - log_sum, formed as the kernel forms the token's: a top token that is
    the sampled one gets its logprob's very bits, so list and rank never contradict. That form
    never orders two logits the other way round, so these are a top k of the logprobs too, with the
    values of the table path to float32 rounding (its log(sum) is summed in another order). Among
    exactly equal logits (equal logprobs on both paths) which come first, and which are kept at the
    k-th place, is ``torch.topk``'s choice on either path and guaranteed by neither; where distinct
    float32 logits round to one logprob, this path keeps the larger logit first.
    """
    from tokenmill.kernels.triton.token_logprobs import token_logprobs

    scored = token_logprobs(logits, token_ids, k == 1)
    top_ids, top_logprobs = scored.top_id, scored.top_logprob
    if k >= 2:
        values, top_ids = logits.topk(k, dim=-1)
        top_logprobs = (values.float() - scored.row_max[:, None]) - scored.log_sum[:, None]
    return SamplerOutput(token_ids, scored.logprob, scored.rank, top_ids, top_logprobs)


def _with_state(logits: torch.Tensor, batch: SamplingBatch, state: RowState | None, bias_pending: bool) -> torch.Tensor:
    """The logits with the rows' logit bias (unless ``bias_pending`` is False: Python processors
    took it already) and penalties from the per-sequence state (torch)."""
    if state is None:
        return logits
    logits = logits.float()
    if bias_pending and batch.bias_rows is not None:
        logits = logits.clone()
        apply_bias(logits, state.bias, batch.bias_rows)
    if batch.penalty_rows is not None:
        logits = apply_penalties(logits, state, batch.penalty_rows)
    return logits


def _filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """top-k, then top-p, then min-p on tempered float32 logits (cut tokens at -inf)."""
    assert batch.top_k is not None and batch.top_p is not None and batch.min_p is not None
    if batch.max_top_k > 0:
        logits = _top_k(logits, batch.top_k, batch.max_top_k)
    if batch.any_top_p:
        logits = _top_p(logits, batch.top_p)
    if batch.any_min_p:
        # min-p keeps exp(s - max) >= min_p, i.e. s >= max + log(min_p) (the kernels' form).
        cut = logits.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return logits


def _exponential_race(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                      counters: torch.Tensor) -> torch.Tensor:
    """The CPU draw: ``argmax(softmax(logits / T) / E)``, E ~ Exp(1) from a generator seeded by the row's
    (key, counter); rows with T = 0 take the argmax."""
    probs = torch.softmax(logits.float() / torch.where(temperature == 0.0, 1.0, temperature)[:, None], dim=-1)
    race = torch.empty_like(probs)
    for row, (key, counter) in enumerate(zip(keys.tolist(), counters.tolist())):
        race[row].exponential_(generator=torch.Generator().manual_seed(hash((key, counter)) & (2**63 - 1)))
    return torch.where(temperature == 0.0, logits.argmax(dim=-1), (probs / race).argmax(dim=-1))


# The filters on the CPU (the GPU kernels find the same cut without sorting). top-k takes one topk
# of the largest k the host knows; top-p sorts each row by logit.


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keeps each row's top_k largest logits (0 = all); ties with the k-th largest are all kept (vLLM's rule).

    ``max_top_k`` is the largest k of the rows that use top-k, which the host knows from the
    requests. One ``topk(max_top_k)`` (not a sort: k is small) gives every row its k-th largest logit.
    """
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(1, max_top_k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drops a token once the tokens more probable than it hold top_p of the mass (top_p = 1: off).

    Tokens of equal logit are kept or dropped together: a token stays iff the tokens with a
    strictly larger logit sum to less than top_p. That is the sort-based nucleus (vLLM's
    ``cumsum <= 1 - p`` rule) with all ties of the last kept token kept; the most probable token
    always stays. Masses are summed in float64 over the float32 probabilities.
    """
    ordered = logits.sort(dim=-1, descending=True).values
    probs = ordered.softmax(dim=-1).double()
    mass_before = probs.cumsum(dim=-1) - probs
    # >= 0 (nothing precedes the top) but for a row without a finite mass (a NaN logit, or every token
    # banned), where no comparison holds: clamped, that row is left as it is rather than failing the step.
    last = ((mass_before < top_p[:, None].double()).sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    cutoff = torch.where(top_p[:, None] >= 1.0, float("-inf"), ordered.gather(1, last))
    return logits.masked_fill(logits < cutoff, float("-inf"))
