"""The runner driven alone, with made-up sequences and plans (no scheduler, no engine): the data in
tokenmill/engine/step.py is its whole interface. Greedy tokens and prompt logprobs are checked
against Hugging Face transformers' forward of the same tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from reference import hf_model, hf_next_logprobs
from tokenmill.engine.step import ScheduledSequence, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 4


@dataclass
class MadeUpRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    needs_prompt_logprobs: bool = False


@dataclass
class MadeUpSequence:
    """Only the fields of `StepSequence`: what the runner may read."""

    seq_id: int
    request: MadeUpRequest
    block_ids: list[int]
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight: int = 0
    seed: int | None = None
    grammar: None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_inflight

    def token_at(self, position: int) -> int:
        return (self.prompt_token_ids + self.output_token_ids)[position]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.worker.model_runner import ModelRunner

    cpu = torch.device("cpu")
    source = resolve_model(str(tiny_llama_dir))
    model = load_model(source, torch.float32, cpu)
    vocab_size = source.hf_config.vocab_size
    runner = ModelRunner(model, TorchAttentionBackend(), cpu, torch.float32, BLOCK_SIZE, vocab_size, 0, torch.float32)
    runner.allocate_kv_cache(16)
    return runner


def _run(runner, items: list[tuple[MadeUpSequence, int]], finished: set[int] = frozenset()):
    """One step: each sequence computes its next ``n`` tokens; the plan's bookkeeping done by hand."""
    scheduled = [
        ScheduledSequence(seq, n, samples=seq.num_computed_tokens + n == seq.num_known_tokens + seq.num_inflight)
        for seq, n in items
    ]
    result = runner.execute(SchedulerOutput(scheduled, sum(n for _, n in items), 0, set(finished)))
    for item in scheduled:
        item.seq.num_computed_tokens += item.num_tokens
    return result


def test_chunked_prefill_then_decode_with_a_token_in_flight(runner, tiny_llama_dir):
    hf = hf_model(str(tiny_llama_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    # Blocks out of order and shared by no one: a wrong slot or block table shows in the tokens.
    a = MadeUpSequence(1, MadeUpRequest([5, 77, 140, 9, 31, 200, 64, 12, 3, 250], greedy), block_ids=[9, 2, 14])
    b = MadeUpSequence(2, MadeUpRequest([18, 44, 101], greedy), block_ids=[6])

    first = _run(runner, [(a, 6), (b, 3)])  # a's first chunk (no sample), b's whole prompt
    assert [item.seq.seq_id for item in first.sampled] == [2]
    b.num_inflight = 1  # b's sampled token is not read back yet: the runner takes it from the device
    second = _run(runner, [(a, 4), (b, 1)])
    b_first = first.read().token_ids[0]
    b.output_token_ids.append(b_first)
    b.num_inflight = 0
    got = second.read().token_ids
    assert got[0] == int(hf_next_logprobs(hf, a.prompt_token_ids).argmax())
    assert b_first == int(hf_next_logprobs(hf, b.prompt_token_ids).argmax())
    assert got[1] == int(hf_next_logprobs(hf, b.prompt_token_ids + [b_first]).argmax())
    a.output_token_ids.append(got[0])
    b.output_token_ids.append(got[1])
    b.block_ids.append(11)  # position 4 starts b's second block
    third = _run(runner, [(a, 1), (b, 1)], finished={7})  # a plain decode step; ids of others' finished sequences
    for seq, token in zip((a, b), third.read().token_ids):
        assert token == int(hf_next_logprobs(hf, seq.tokens(0, seq.num_known_tokens)).argmax())


def test_prompt_logprobs_of_each_chunk(runner, tiny_llama_dir):
    hf = hf_model(str(tiny_llama_dir))
    prompt = [7, 120, 33, 260, 15, 88, 2]
    request = MadeUpRequest(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), True)
    seq = MadeUpSequence(3, request, block_ids=[4, 13])
    chunks = _run(runner, [(seq, 4)]).prompt_logprobs + _run(runner, [(seq, 3)]).prompt_logprobs
    assert [(c.first, len(c.token_logprobs)) for c in chunks] == [(1, 4), (5, 2)]
    for chunk in chunks:
        assert chunk.seq is seq
        for i, logprob in enumerate(chunk.token_logprobs):
            position = chunk.first + i
            expected = hf_next_logprobs(hf, prompt[:position])
            assert logprob == pytest.approx(float(expected[prompt[position]]), abs=1e-4)
            assert chunk.top_ids[i] == expected.topk(2).indices.tolist()
