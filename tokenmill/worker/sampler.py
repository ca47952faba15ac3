"""Turns the last-position logits of each sampling sequence into the next tokens.

Order of operations (vLLM's): logprobs are taken from the raw logits; then the logit controls
(allowed_token_ids, logit_bias, bad_words, logits_processors), penalties, the min_tokens mask,
greedy argmax for temperature 0; else temperature, top-k, top-p, min-p and a draw. A draw is
``argmax(probs / E)`` with ``E ~ Exp(1)`` per token (the exponential race, an
exact sample of ``probs``); a seeded request draws ``E`` from its own generator, so its samples
do not depend on which other requests share the batch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [N] float, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64, 0 = off
    top_p: torch.Tensor | None  # [N] float, 1 = off
    min_p: torch.Tensor | None  # [N] float, 0 = off
    generators: list[torch.Generator | None]  # per row; None draws from the engine's generator
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


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # Only when some row asked for logprobs; taken from the raw (unpenalised, untempered) logits.
    sampled_logprobs: torch.Tensor | None = None  # [N]
    sampled_ranks: torch.Tensor | None = None  # [N], 1 = most likely
    top_ids: torch.Tensor | None = None  # [N, K]
    top_logprobs: torch.Tensor | None = None  # [N, K]


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs >= 0 else None
        logits = self._apply_logit_controls(logits, batch)
        logits = self._apply_penalties(logits, batch)
        if batch.banned:
            for row, ids in batch.banned:
                logits[row, ids] = float("-inf")
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            token_ids = greedy
        else:
            sampled = self._draw(logits, batch)
            token_ids = torch.where(batch.temperature == 0.0, greedy, sampled)
        return self._with_logprobs(token_ids, raw_logprobs, batch.max_num_logprobs)

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

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        temperature = torch.where(batch.temperature == 0.0, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temperature[:, None]
        if batch.top_k is not None:
            logits = _top_k(logits, batch.top_k)
        if batch.top_p is not None:
            logits = _top_p(logits, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.min_p is not None:
            keep = probs >= batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        race = torch.empty_like(probs)
        shared_rows = [i for i, g in enumerate(batch.generators) if g is None]
        if len(shared_rows) == len(batch.generators):
            race.exponential_(generator=self.generator)
        else:
            for i, gen in enumerate(batch.generators):
                race[i].exponential_(generator=gen if gen is not None else self.generator)
        return (probs / race).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(token_ids: torch.Tensor, logprobs: torch.Tensor | None, k: int) -> SamplerOutput:
        if logprobs is None:
            return SamplerOutput(token_ids)
        sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
        top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return SamplerOutput(token_ids, sampled, ranks, top_ids, top_logprobs)


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens before it already hold top_p of the mass; the first always stays.
    drop = (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
