"""A request and its sequences: the state the scheduler, cache manager and runner share.

A user request with ``n`` samples becomes one `Request` holding ``n`` `Sequence`s. Each sequence
is scheduled on its own; the siblings of a request share the prompt's KV blocks (see
`Scheduler`), so the prompt is computed once. A beam search request's sequences are its live
beams (see `tokenmill.engine.beam_search`).
"""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from tokenmill.engine.beam_search import BeamSearch
    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    from tokenmill.logprobs import PromptLogprobs, SampleLogprobs
    from tokenmill.lora.adapter import AdapterSpec
    from tokenmill.sampling_params import SamplingParams


ParamsT = TypeVar("ParamsT")  # SamplingParams; PoolingParams for pooling requests (tokenmill/pooling/)


def max_output_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The length rule: a sequence ends after ``max_tokens`` outputs or when it fills max_model_len."""
    room = max_model_len - num_prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    index: int  # sample index within its request (CompletionOutput.index)
    request: "Request[Any]"
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # How many of all_token_ids already have their keys/values in the cache.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prefix-cache keys of this sequence's full blocks, in order; extends as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    # How many of block_ids are already indexed in the prefix cache (so each step indexes only new ones).
    num_committed_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    seed: int | None = None  # the key of this sequence's random draws when its request has a seed
    cumulative_logprob: float = 0.0
    logprobs: "SampleLogprobs | None" = None
    detokenizer: "IncrementalDetokenizer | None" = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt tokens its first admission counts as prefix-cache hits, as vLLM's child request of this
    # sample would find them (0 where vLLM looks nothing up); for the metrics (Scheduler._count_lookup).
    num_cached_tokens: int = 0
    best_of_logprob: float = 0.0  # sum of sampled-token logprobs, kept for best_of ranking
    grammar: Any = None  # xgrammar matcher when the request has structured_outputs
    # How much of the output earlier DELTA outputs already carried.
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    # Tokens sampled on the device but not yet read back (asynchronous scheduling: the next step
    # is launched before this one's ids reach the host). They count as tokens of the sequence,
    # so the scheduler can give them a slot, but their values are known only on the device.
    num_inflight: int = 0
    # Beam search: the beam this one was forked from; it shares that beam's full blocks when admitted.
    fork_parent: "Sequence | None" = None
    # Its next token waits on other sequences (a beam waiting for the rest of its group), so the
    # scheduler leaves it alone until then.
    on_hold: bool = False
    # (source block, own block): admitted on another sequence's blocks, it counts the tokens of the
    # source's partial block as computed; the first launched plan holding it copies that block.
    copy_pending: tuple[int, int] | None = None

    @property
    def params(self) -> "SamplingParams":
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, including those still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (positions [0, num_known_tokens))."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, including those still in flight."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_at(self, position: int) -> int:
        prompt_len = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < prompt_len else self.output_token_ids[position - prompt_len]

    def tokens(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""


@dataclass(eq=False)
class Request(Generic[ParamsT]):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: ParamsT
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0  # prompt tokens it computed into full blocks of the prefix cache
    prompt_logprobs_sent: bool = False  # DELTA outputs carry the prompt logprobs once
    # One entry per prompt token once computed (the first empty: nothing predicts it); a list of
    # dicts (the first None) or a FlatLogprobs (flat_logprobs=True).
    prompt_logprobs: "PromptLogprobs | None" = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    beam: "BeamSearch | None" = None  # set for LLM.beam_search requests; sequences are then its live beams
    # Outputs each sequence may have (`max_output_tokens`, set at intake; no limit until then).
    max_output_tokens: int = sys.maxsize
    # The prompt's cache_salt: its blocks are shared only with prompts of the same salt.
    cache_salt: str | None = None
    # vLLM's priority (lower first): orders the waiting queue under scheduling_policy="priority".
    priority: int = 0
    # Its random seed when the caller gave it one apart from its params (add_request's ``seed``):
    # requests sharing one params object, each drawing its own samples.
    seed: int | None = None
    # Its LoRA adapter: the user's LoRARequest (for its outputs) and the checked adapter (tokenmill/lora/).
    lora_request: Any = None
    adapter: "AdapterSpec | None" = None
    # Why the engine could not finish it (its sequences then end with finish_reason "error").
    error: str | None = None

    def release(self) -> None:
        """The request has left the engine (finished with its last output built, or aborted): let go
        of its sequences. Each sequence points back at its request, so the two would otherwise form
        a reference cycle that only a full garbage collection frees, and `LLM`'s blocking calls run
        without full collections (`tokenmill/gc_policy.py`); with the cycle broken, reference
        counting frees both (and the sequences' blocks lists, detokenizer, grammar matcher) as
        soon as the last step holding a sequence is read back. A sequence still in a step in
        flight keeps ``seq.request``; nothing reads a released request's sequences (it is
        finished, so no output or schedule is made from them again)."""
        self.sequences = []

    @property
    def lora_id(self) -> int:
        """Its adapter's ``uid`` (a reloaded adapter is another one), 0 for the base model."""
        return self.adapter.uid if self.adapter is not None else 0

    @cached_property
    def sampler_needs(self) -> int:
        """Its params' ``SamplerNeeds``, computed once: the runner reads it for every row of every
        step, and intake has made its additions to the params (bad words) before any step."""
        params: Any = self.params  # a generation request's SamplingParams (pooling never asks)
        return int(params.sampler_needs)  # a plain int: IntFlag's & runs in Python, per row, per step

    @property
    def needs_sync(self) -> bool:
        """Its next step depends on this step's results on the host, so the engine must read each
        step back before scheduling the next: sampling that reads every earlier output id, or a
        beam search (beam selection picks which sequences continue with which tokens)."""
        params: Any = self.params  # a generation request's SamplingParams (pooling never asks)
        return self.beam is not None or params.reads_output_history

    @property
    def ranks_within_grammar(self) -> bool:
        """A beam search under a grammar: its beams' candidates are the best tokens the grammar allows."""
        return self.beam is not None and self.beam.params.structured_outputs is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some prompt position has none yet (a preempted lead recomputes)."""
        done = len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0
        params: Any = self.params  # SamplingParams: pooling requests never reach the generation runner
        return params.prompt_logprobs is not None and done < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        if len(self.sequences) == 1:  # n = 1, nearly every request: asked for every request every step
            return self.sequences[0].is_finished
        return all(seq.is_finished for seq in self.sequences)
