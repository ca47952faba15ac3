"""The objects `LLM.generate` and `LLM.beam_search` return, shaped like vLLM's so user code reads them unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log probability of one token at one position, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token plus the top ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """One beam returned by `LLM.beam_search` (vLLM's shape): ``tokens`` holds the prompt and the
    generated tokens (with the final eos, if it ended on one); ``logprobs`` has one dict per
    generated token, with the top candidates of the beam at that step."""

    tokens: list[int]
    logprobs: SampleLogprobs
    lora_request: None = None  # vLLM's field; tokenmill has no LoRA
    cum_logprob: float = 0.0
    text: str | None = None  # the decoded tokens, prompt included (the eos only with include_stop_str_in_output)
    finish_reason: str | None = None  # "stop" (eos) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (``beam_width`` of them)."""

    sequences: list[BeamSearchSequence]
