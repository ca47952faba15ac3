"""The objects `LLM.generate` and `LLM.beam_search` return, shaped like vLLM's so user code reads them unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

# Logprob and the containers live in tokenmill/logprobs.py (vLLM: vllm/logprobs.py); importing
# them from here keeps working.
from tokenmill.logprobs import Logprob, LogprobsOnePosition, PromptLogprobs, SampleLogprobs  # noqa: F401

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None  # a list of dicts, or a FlatLogprobs with flat_logprobs=True
    # vLLM's fields in vLLM's order (positional construction matches): the experts it routed to, which
    # tokenmill does not return, and (below) the adapter, None here (it is on the RequestOutput).
    routed_experts: None = None
    finish_reason: str | None = None  # "stop" | "length" | "repetition" | "error" | None while running
    # The stop string or stop token id that ended it ("repetition_detected" for "repetition").
    stop_reason: int | str | None = None
    lora_request: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's times on the engine's monotonic clock (seconds), vLLM v0's names, and under vLLM
    v1's `RequestStateStats` names the same times (0.0 while unset, as vLLM's), so that code written
    for either reads them unchanged. One difference: vLLM's ``arrival_time`` is wall-clock; here
    every time is on the one clock, so differences between any two are durations."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # over all the request's completions, as vLLM counts them
    last_token_time: float | None = None  # when the newest token of this output was read back
    is_corrupted: bool = False  # vLLM's NaN-in-logits flag (it counts NaNs only when asked to): never set here

    @property
    def queued_ts(self) -> float:
        return self.arrival_time

    @property
    def scheduled_ts(self) -> float:
        return self.first_scheduled_time or 0.0

    @property
    def first_token_ts(self) -> float:
        return self.first_token_time or 0.0

    @property
    def last_token_ts(self) -> float:
        return self.last_token_time or 0.0

    @property
    def first_token_latency(self) -> float:
        return 0.0 if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    # In vLLM's positional order from here to num_cache_creation_tokens.
    metrics: RequestMetrics | None = None
    lora_request: Any = None  # the request's LoRARequest (tokenmill/lora/); None: the base model
    # vLLM's fields for what tokenmill does not do (encoder-decoder models, KV / encoder-cache
    # transfer between engines): always None here, present so that code reading them runs unchanged.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache
    num_cache_creation_tokens: int = 0  # prompt tokens this request computed into full blocks of the prefix cache
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    # Why the engine could not finish the request (its completions end with finish_reason "error",
    # as vLLM's for a request-level failure; vLLM gives no message): e.g. its LoRA adapter's folder
    # was deleted after the adapter was checked, or its grammar rejected the token drawn (every
    # token it allowed was banned). None otherwise.
    error: str | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Fold a later output of this request into this one (vLLM's ``add``): with ``aggregate``,
        a DELTA output's new text, tokens and logprobs extend the completion of the same index;
        without, its completion replaces that one. A completion seen first is appended."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            at = next((i for i, old in enumerate(self.outputs) if old.index == new.index), None)
            if at is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[at] = new
            else:
                old = self.outputs[at]
                old.text += new.text
                old.token_ids = [*old.token_ids, *new.token_ids]
                if new.logprobs and old.logprobs is None:
                    old.logprobs = new.logprobs
                elif new.logprobs:
                    old.logprobs.extend(new.logprobs)
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason


@dataclass
class BeamSearchSequence:
    """One beam returned by `LLM.beam_search` (vLLM's shape): ``tokens`` holds the prompt and the
    generated tokens (with the final eos, if it ended on one); ``logprobs`` has one dict per
    generated token, with the top candidates of the beam at that step."""

    tokens: list[int]
    logprobs: list[LogprobsOnePosition]
    lora_request: Any = None  # the search's LoRARequest (vLLM's field)
    cum_logprob: float = 0.0
    text: str | None = None  # the decoded tokens, prompt included (the eos only with include_stop_str_in_output)
    finish_reason: str | None = None  # "stop" (eos) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (``beam_width`` of them)."""

    sequences: list[BeamSearchSequence]


# ---- pooling models (LLM.encode / embed / classify / score) ----------------------------------


@dataclass
class PoolingOutput:
    """What the pooler produced for one request: a CPU float32 tensor whose shape depends on the task
    ([hidden], or [dimensions], for embed; [num_tokens, hidden] for token_embed; [num_labels] for classify
    and score; [num_tokens, num_labels] for token_classify)."""

    data: "torch.Tensor"

    def __eq__(self, other: object) -> bool:
        """Equal tensors (shape and values), as vLLM compares them; dataclass equality would ask a
        tensor comparison for one bool and raise."""
        import torch

        return isinstance(other, PoolingOutput) and torch.equal(self.data, other.data)


@dataclass
class PoolingRequestOutput:
    """vLLM's fields in vLLM 0.26's order, so that positional construction
    (request_id, outputs, prompt_token_ids, num_cached_tokens, finished) means the same."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int  # always 0: a pooling step keeps no prefix cache
    finished: bool


def one_vector(output: PoolingOutput, what: str) -> "torch.Tensor":
    """``output.data``, which must be one vector (``what`` names it in the error)."""
    if output.data.ndim != 1:
        raise ValueError(f"{what} must be one vector, got a tensor of shape {tuple(output.data.shape)}")
    return output.data


def _one_vector(output: PoolingOutput, what: str) -> list[float]:
    return one_vector(output, what).tolist()


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        return EmbeddingOutput(_one_vector(output, "an embedding"))

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the raw logits when use_activation=False)

    @staticmethod
    def from_base(output: PoolingOutput) -> "ClassificationOutput":
        return ClassificationOutput(_one_vector(output, "class probabilities"))

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> "ScoringOutput":
        data = output.data.squeeze()
        if data.ndim != 0:
            raise ValueError(f"a score is one number, got a tensor of shape {tuple(output.data.shape)}")
        return ScoringOutput(float(data.item()))


@dataclass
class _TypedPoolingRequestOutput(PoolingRequestOutput):
    """A PoolingRequestOutput whose ``outputs`` is read as one task's output type."""

    output_type: ClassVar[Any]

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> Any:
        return cls(output.request_id, cls.output_type.from_base(output.outputs), output.prompt_token_ids,
                   output.num_cached_tokens, output.finished)


@dataclass
class EmbeddingRequestOutput(_TypedPoolingRequestOutput):
    outputs: EmbeddingOutput  # type: ignore[assignment]
    output_type: ClassVar[Any] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TypedPoolingRequestOutput):
    outputs: ClassificationOutput  # type: ignore[assignment]
    output_type: ClassVar[Any] = ClassificationOutput


@dataclass
class ScoringRequestOutput(_TypedPoolingRequestOutput):
    outputs: ScoringOutput  # type: ignore[assignment]
    output_type: ClassVar[Any] = ScoringOutput
