"""What crosses from the scheduler to the runner and back: the plan of one step and its result.

This module is the only part of `tokenmill.engine` that the workers import. The runner sees a
sequence through `StepSequence`, the few fields it reads to build a batch and sample, so it
can be driven by a test with made-up sequences and plans; the scheduler's `Sequence` has them all.
Nothing here imports torch at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from tokenmill.sampling_params import SamplingParams

NULL_BLOCK = 0  # never handed out: padding in block tables and slot mappings points here


class RequestCodeError(RuntimeError):
    """A request's own code raised in a step (a function of its SamplingParams.logits_processors):
    that request is to blame, and `LLMEngine.step` ends it alone with finish_reason "error"."""

    def __init__(self, seq_id: int, message: str):
        super().__init__(message)
        self.seq_id = seq_id


class StepRequest(Protocol):
    """The request fields the runner reads (prompt logprobs are scored once per request)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def params(self) -> "SamplingParams": ...

    @property
    def needs_prompt_logprobs(self) -> bool: ...

    @property
    def sampler_needs(self) -> int: ...  # SamplerNeeds bits of its params (see SamplingParams.sampler_needs)

    @property
    def ranks_within_grammar(self) -> bool: ...  # its top logprobs are the best tokens its grammar allows

    @property
    def lora_id(self) -> int: ...  # its LoRA adapter (AdapterSpec.uid, as in SchedulerOutput.lora_slots), 0: none


class StepSequence(Protocol):
    """The sequence fields the runner reads: its tokens, its blocks and its sampling settings."""

    @property
    def seq_id(self) -> int: ...

    @property
    def index(self) -> int: ...  # sample index within its request: only sample 0 scores the prompt

    @property
    def request(self) -> StepRequest: ...

    @property
    def params(self) -> "SamplingParams": ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...  # where this step's tokens start

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def seed(self) -> int | None: ...

    @property
    def grammar(self) -> Any: ...  # an xgrammar matcher, or None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int: ...  # the rest (one token at most) is still in flight

    @property
    def num_output_tokens(self) -> int: ...  # including tokens still in flight

    def token_at(self, position: int) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


S = TypeVar("S", bound=StepSequence)


@dataclass
class ScheduledSequence(Generic[S]):
    seq: S
    num_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens
    samples: bool  # this step reaches its last known token, so a new token is sampled


@dataclass
class SchedulerOutput(Generic[S]):
    """One step's plan."""

    scheduled: list[ScheduledSequence[S]]
    num_batched_tokens: int
    num_preempted: int
    # Sequences that finished, were aborted or were preempted since the previous plan (including
    # this plan's preemptions): the runner may drop any per-sequence state it keeps for them. Ids
    # are never reused; a preempted sequence that comes back is computed from its first token.
    finished_seq_ids: set[int] = field(default_factory=set)
    # LoRA adapter (AdapterSpec.uid) -> its device slot, for this step's adapters (set by the engine at launch).
    lora_slots: dict[int, int] = field(default_factory=dict)
    # (source, destination) KV blocks to copy before the step's forward, every layer: a sequence
    # admitted on another's blocks counts the copied tokens as computed (Scheduler._shareable_prefix).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SamplerOutput:
    token_ids: "torch.Tensor"  # [N] int64
    # Only when some row asked for logprobs; taken from the raw (unpenalised, untempered) logits.
    sampled_logprobs: "torch.Tensor | None" = None  # [N]
    sampled_ranks: "torch.Tensor | None" = None  # [N], 1 = most likely
    top_ids: "torch.Tensor | None" = None  # [N, K]
    top_logprobs: "torch.Tensor | None" = None  # [N, K]
    # Only when some row has logprob_token_ids: row r's logprobs at its ids in its first
    # len(ids) columns (the host knows the ids; the other columns are padding).
    requested_logprobs: "torch.Tensor | None" = None  # [N, W]

    def tensors(self) -> tuple["torch.Tensor | None", ...]:
        """Every field, in order (to copy them all to the host at once)."""
        return (self.token_ids, self.sampled_logprobs, self.sampled_ranks, self.top_ids, self.top_logprobs,
                self.requested_logprobs)


@dataclass
class PromptLogprobs(Generic[S]):
    """Log-probabilities of prompt tokens[first : first + len(token_logprobs)], from one prefill
    chunk of ``seq`` (sample 0 of its request)."""

    seq: S
    first: int  # prompt position of the first token scored
    token_logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class PromptScores(Protocol):
    """A step's prompt logprobs, scored on the device (worker/prompt_logprobs.py's ScoredPrompts)."""

    def read(self) -> list[PromptLogprobs[Any]]:
        """Per prefill chunk, its scores as lists: only once the step is done (`StepResult.wait`)."""
        ...


@dataclass
class SampledTokens:
    """A step's sampled rows on the host, as Python lists (the logprob fields only when asked for)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    requested_logprobs: list[list[float]] | None = None  # per row, at its logprob_token_ids


@dataclass
class StepResult(Generic[S]):
    """One launched step. ``output`` holds host tensors that are filled asynchronously on a GPU:
    read them only after `wait`, which blocks until this step (not any later one) is done.

    A step with grammar rows comes back with its forward launched and its draw not yet:
    ``pending_draw`` launches it, once the previous step's tokens are in the matchers (the engine
    calls it right after reading that step back; ``output`` is None until then)."""

    sampled: list[ScheduledSequence[S]]  # the sequences that got a new token, in row order
    output: SamplerOutput | None
    prompt_logprobs: PromptScores | None = None  # read after `wait`
    ready: "torch.cuda.Event | None" = None
    pending_draw: "Callable[[], None] | None" = field(default=None, repr=False)
    _host: SampledTokens | None = field(default=None, repr=False)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def read(self) -> SampledTokens | None:
        """Wait for the step, then its sampled rows as lists (converted once); None if nothing sampled."""
        self.wait()
        if self.output is None:
            return None
        if self._host is None:
            self._host = SampledTokens(*(t.tolist() if t is not None else None for t in self.output.tensors()))
        return self._host
