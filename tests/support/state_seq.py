"""A stand-in for the sequences the runner hands ``worker/sampling_state.py``: what the slotted
states read of one (its id, its request's ``sampler_needs``, its prompt and outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill import SamplingParams


@dataclass
class StateSeq:
    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    is_finished: bool = False

    @property
    def request(self) -> "StateSeq":  # the runner reads a request's sampler_needs through its sequences
        return self

    @property
    def sampler_needs(self) -> int:
        return self.params.sampler_needs
