"""Turns the last-position logits of each sampling sequence into the next tokens.

Order of operations (vLLM's): logprobs are taken from the raw logits; then the logit controls
(allowed_token_ids, logit_bias, bad_words, logits_processors), penalties, the min_tokens mask,
greedy argmax for temperature 0; else temperature, top-k, top-p, min-p and a draw.

A draw is an exact sample of softmax(logits / T) by a race of random noise: ``argmax(probs / E)``
with ``E ~ Exp(1)`` per token, which is ``argmax(logits / T + g)`` with Gumbel noise g. Each row's
noise is a pure function of its (key, counter) pair, which the runner sets to (the request's seed,
the output position) for seeded requests, so their samples depend on nothing else in the batch.
On a GPU one Triton kernel (``kernels/triton/sampling.py``) does temperature, Philox noise and the
argmax in a single read of the logits; on the CPU torch's generator, seeded per row from the pair,
draws E (Philox in plain torch would cost more than the model's forward here).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from tokenmill.engine.step import SamplerOutput


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [N] float, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64, 0 = off
    max_top_k: int  # the largest top_k of any row (a host int: no device sync), 0 when none uses it
    top_p: torch.Tensor | None  # [N] float, 1 = off
    min_p: torch.Tensor | None  # [N] float, 0 = off
    # The random draw of each row: a 64-bit key and a counter (see the module docstring); None when
    # every row is greedy.
    draw_keys: torch.Tensor | None = None  # [N] int64
    draw_counters: torch.Tensor | None = None  # [N] int64
    # Penalties, only when some row uses them.
    presence: torch.Tensor | None = None  # [N]
    frequency: torch.Tensor | None = None  # [N]
    repetition: torch.Tensor | None = None  # [N]
    output_counts: torch.Tensor | None = None  # [N, V] counts of each token among the outputs
    seen_mask: torch.Tensor | None = None  # [N, V] token appears in prompt or outputs
    # Tokens that may not be sampled yet (eos and stop ids while below min_tokens): (row, ids).
    banned: list[tuple[int, list[int]]] | None = None
    max_num_logprobs: int = -1  # -1: no row wants logprobs
    # Logit controls, only when some row uses them: an additive bias (-inf bans a token) and
    # vLLM-style processors per row: (row, callables, prompt ids, output ids so far).
    logit_bias: torch.Tensor | None = None  # [N, V]
    processors: list[tuple[int, list, list[int], list[int]]] | None = None
    # Structured outputs: xgrammar's packed allowed-token bitmask and the function applying it.
    grammar_bitmask: torch.Tensor | None = None  # [N, ceil(V / 32)] int32
    apply_grammar: Callable[[torch.Tensor, torch.Tensor], None] | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] in the model's dtype; upcast to fp32 only by the steps that compute with them."""
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if batch.max_num_logprobs >= 0 else None
        if batch.grammar_bitmask is not None or batch.logit_bias is not None or batch.processors or batch.banned \
                or batch.repetition is not None:
            logits = logits.float()  # they compute in fp32, some in place (the step's own logits)
            logits = self._apply_logit_controls(logits, batch)
            logits = self._apply_penalties(logits, batch)
            for row, ids in batch.banned or ():
                logits[row, ids] = float("-inf")
        token_ids = logits.argmax(dim=-1) if batch.all_greedy else self._draw(logits, batch)
        return self._with_logprobs(token_ids, raw_logprobs, batch.max_num_logprobs)

    @staticmethod
    def precompile(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the GPU draw kernel for the two logits it sees: the model's own, and fp32 ones
        once filters or penalties have run (``precompile.py`` runs this in ``parallel_compile``)."""
        from tokenmill.kernels.triton.sampling import gumbel_argmax

        keys = torch.zeros(1, dtype=torch.int64, device=device)
        counters = torch.zeros(1, dtype=torch.int64, device=device)
        temperature = torch.ones(1, dtype=torch.float32, device=device)
        for logits_dtype in dict.fromkeys((dtype, torch.float32)):
            logits = torch.empty(1, vocab_size, dtype=logits_dtype, device=device)
            gumbel_argmax(logits, temperature, keys, counters, compile_only=True)

    @staticmethod
    def _apply_logit_controls(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.grammar_bitmask is not None:
            batch.apply_grammar(logits, batch.grammar_bitmask)  # in place: disallowed tokens -> -inf
        if batch.logit_bias is not None:
            logits = logits + batch.logit_bias
        for row, functions, prompt_ids, output_ids in batch.processors or ():
            for fn in functions:
                # vLLM's two forms: fn(output_ids, logits) or fn(prompt_ids, output_ids, logits).
                takes_prompt = len(inspect.signature(fn).parameters) == 3
                args = (prompt_ids, list(output_ids), logits[row]) if takes_prompt else (list(output_ids), logits[row])
                logits[row] = fn(*args)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.repetition is None:
            return logits
        rep = batch.repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(batch.seen_mask, penalised, logits)
        counts = batch.output_counts
        logits = logits - batch.frequency[:, None] * counts
        return logits - batch.presence[:, None] * (counts > 0).to(logits.dtype)

    @staticmethod
    def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A sample per row (greedy rows: the argmax), after temperature and the top-k/top-p/min-p filters."""
        temperature = batch.temperature
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            # The filters act on the tempered distribution: scale first, then draw at temperature 1.
            # A greedy row stays greedy (temperature 0), and every filter keeps its top token.
            logits = logits.float() / torch.where(temperature == 0.0, 1.0, temperature)[:, None]
            if batch.top_k is not None:
                logits = _top_k(logits, batch.top_k, batch.max_top_k)
            if batch.top_p is not None:
                logits = _top_p(logits, batch.top_p)
            if batch.min_p is not None:
                probs = torch.softmax(logits, dim=-1)
                keep = probs >= batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
                logits = logits.masked_fill(~keep, float("-inf"))
            temperature = (temperature > 0.0).to(torch.float32)
        assert batch.draw_keys is not None and batch.draw_counters is not None, "a sampled row needs its draw key"
        if logits.is_cuda:
            from tokenmill.kernels.triton.sampling import gumbel_argmax

            return gumbel_argmax(logits, temperature, batch.draw_keys, batch.draw_counters)
        return _exponential_race(logits, temperature, batch.draw_keys, batch.draw_counters)

    @staticmethod
    def _with_logprobs(token_ids: torch.Tensor, logprobs: torch.Tensor | None, k: int) -> SamplerOutput:
        if logprobs is None:
            return SamplerOutput(token_ids)
        sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
        top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return SamplerOutput(token_ids, sampled, ranks, top_ids, top_logprobs)


def _exponential_race(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                      counters: torch.Tensor) -> torch.Tensor:
    """The CPU draw: ``argmax(softmax(logits / T) / E)``, E ~ Exp(1) from a generator seeded by the row's
    (key, counter); rows with T = 0 take the argmax."""
    probs = torch.softmax(logits.float() / torch.where(temperature == 0.0, 1.0, temperature)[:, None], dim=-1)
    race = torch.empty_like(probs)
    for row, (key, counter) in enumerate(zip(keys.tolist(), counters.tolist())):
        race[row].exponential_(generator=torch.Generator().manual_seed(hash((key, counter)) & (2**63 - 1)))
    return torch.where(temperature == 0.0, logits.argmax(dim=-1), (probs / race).argmax(dim=-1))


# top-k and top-p without sorting the vocabulary and without a host sync. top-k takes one topk of
# the largest k the host knows. top-p keeps, in each row, the tokens that have less than top_p of
# probability strictly above them: that set is "every token >= a cutoff", and the cutoff is found by
# a radix select over the float32 bits, two histogram passes over [N, V].
_HALF = 16  # bits per pass: the high half of a 32-bit key, then the low half
_BINS = 1 << _HALF


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keeps each row's top_k largest logits (0 = all); ties with the k-th largest are all kept (vLLM's rule).

    ``max_top_k`` is the largest k of the rows that use top-k, which the host knows from the
    requests: reading it from ``top_k`` would make the host wait for the device. One
    ``topk(max_top_k)`` (not a sort: k is small) gives every row its k-th largest logit.
    """
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(1, max_top_k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drops a token once the tokens more probable than it hold top_p of the mass (top_p = 1: off).

    Tokens of equal probability are kept or dropped together: a token stays iff the tokens strictly
    more probable than it sum to less than top_p. That is the sort-based nucleus (vLLM's
    ``cumsum <= 1 - p`` rule) with all ties of the last kept token kept; the most probable token
    always stays. Masses are summed in float64 over the float32 probabilities.
    """
    probs = logits.softmax(dim=-1)
    budget = torch.where(top_p >= 1.0, float("inf"), top_p.to(torch.float64))
    keys = probs.view(torch.int32)  # non-negative floats order like their bits
    cutoff = _cutoff(keys, probs.to(torch.float64), budget)
    return logits.masked_fill(keys < cutoff[:, None], float("-inf"))


def _cutoff(keys: torch.Tensor, weights: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest int32 key c whose strictly larger keys weigh less than ``budget``.

    keys: [N, V] int32; weights: [N, V] float64; budget: [N] float64 > 0.
    ``keys >= c`` is then exactly the set of tokens with less than ``budget`` weight above them.
    The first pass histograms all tokens by the high 16 bits of their key and picks the cutoff's
    bin; the second histograms the tokens of that bin by the low 16 bits.
    """
    rows = keys.shape[0]
    offsets = torch.arange(rows, dtype=torch.int32, device=keys.device)[:, None] * _BINS
    high = keys >> _HALF  # in [-2**15, 2**15) for any float32 bits; [0, 2**15) for probabilities
    nothing_above = torch.zeros(rows, 1, dtype=torch.float64, device=keys.device)
    high_bin, above = _pick_bin(high + (offsets + _BINS // 2), weights, budget, nothing_above)
    high_cut = (high_bin - _BINS // 2).to(torch.int32)  # int32 like `high`: no [N, V] promotion
    in_bin = torch.where(high == high_cut, weights, 0.0)
    low_bin, _ = _pick_bin((keys & (_BINS - 1)) + offsets, in_bin, budget, above)
    return (high_cut.to(torch.int64) * _BINS + low_bin).squeeze(1).to(torch.int32)


def _pick_bin(index: torch.Tensor, weights: torch.Tensor, budget: torch.Tensor,
              above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Histograms ``weights`` into _BINS bins a row (``index``: row * _BINS + bin) and returns, per
    row, the bin holding the cutoff and the weight above that bin (``above``: weight above them all)."""
    rows = index.shape[0]
    hist = torch.zeros(rows * _BINS, dtype=torch.float64, device=index.device)
    cumulative = hist.index_add_(0, index.flatten(), weights.flatten()).view(rows, _BINS).cumsum(dim=1)
    total = cumulative[:, -1:]
    # The weight above bin b is above + total - cumulative[b]; it reaches the budget in bins 0..m-1
    # (cumulative[b] <= above + total - budget), and m is the cutoff's bin (never past the top one).
    bin_ = torch.searchsorted(cumulative, above + total - budget[:, None], right=True).clamp(max=_BINS - 1)
    return bin_, above + total - cumulative.gather(1, bin_)
