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

    @property
    def sampler_needs(self) -> int:
        return self.params.sampler_needs


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


@pytest.mark.parametrize("slice_rows", [None, 3])
def test_prompt_logprobs_of_each_chunk(runner, tiny_llama_dir, monkeypatch, slice_rows):
    """Each chunk's prompt logprobs against HF; with slice_rows, scored 3 rows at a time (the first
    chunk's 4 rows as 3 + 1), as a long chunk is to bound its [rows, V] tensors."""
    if slice_rows is not None:
        monkeypatch.setattr(runner, "prompt_logprob_rows", slice_rows)  # read by prompt_logprobs.score_prompts
    hf = hf_model(str(tiny_llama_dir))
    prompt = [7, 120, 33, 260, 15, 88, 2]
    request = MadeUpRequest(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), True)
    seq = MadeUpSequence(3, request, block_ids=[4, 13])
    chunks = _run(runner, [(seq, 4)]).prompt_logprobs.read() + _run(runner, [(seq, 3)]).prompt_logprobs.read()
    assert [(c.first, len(c.token_logprobs)) for c in chunks] == [(1, 4), (5, 2)]
    for chunk in chunks:
        assert chunk.seq is seq
        for i, logprob in enumerate(chunk.token_logprobs):
            position = chunk.first + i
            expected = hf_next_logprobs(hf, prompt[:position])
            assert logprob == pytest.approx(float(expected[prompt[position]]), abs=1e-4)
            assert chunk.top_ids[i] == expected.topk(2).indices.tolist()


@pytest.mark.parametrize("slice_rows", [None, 3])
def test_prompt_logprobs_of_a_step_scored_together(runner, tiny_llama_dir, monkeypatch, slice_rows):
    """One step holding chunks that ask for 2, 0 and 2 top logprobs, with a sequence asking none
    between them (so the scored rows are not side by side) and one whose samples 1.. share sample 0's
    prompt (only sample 0 scores it): each chunk gets its own positions' logprobs, ranks and top ids,
    against HF, whether scored whole or 3 rows at a time (slices crossing the chunks' bounds)."""
    if slice_rows is not None:
        monkeypatch.setattr(runner, "prompt_logprob_rows", slice_rows)
    hf = hf_model(str(tiny_llama_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    asks = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k) for k in (2, 0, 2)]
    prompts = [[7, 120, 33, 260, 15, 88, 2], [9, 4, 200, 31, 77], [50, 51, 52, 53, 54, 55], [18, 44, 101, 3, 5, 6]]
    a = MadeUpSequence(10, MadeUpRequest(prompts[0], asks[0], True), block_ids=[1, 2])
    plain = MadeUpSequence(11, MadeUpRequest(prompts[1], greedy), block_ids=[3, 5])
    b = MadeUpSequence(12, MadeUpRequest(prompts[2], asks[1], True), block_ids=[6, 7])
    c = MadeUpSequence(13, MadeUpRequest(prompts[3], asks[2], True), block_ids=[8, 9])
    c_sample_1 = MadeUpSequence(14, c.request, block_ids=[8, 15], index=1)
    scores = _run(runner, [(a, 7), (plain, 5), (b, 4), (c, 6), (c_sample_1, 6)]).prompt_logprobs
    chunks = {chunk.seq.seq_id: chunk for chunk in scores.read()}
    assert sorted(chunks) == [10, 12, 13]
    for seq, scored_to in ((a, 7), (b, 4), (c, 6)):  # a whole prompt scores up to its last token
        chunk = chunks[seq.seq_id]
        k = seq.params.prompt_logprobs
        assert chunk.first == 1 and len(chunk.token_logprobs) == len(chunk.ranks) == min(scored_to, len(seq.prompt_token_ids) - 1)
        assert (chunk.top_ids is None) == (k == 0)
        for i, logprob in enumerate(chunk.token_logprobs):
            position = chunk.first + i
            expected = hf_next_logprobs(hf, seq.prompt_token_ids[:position])
            token = seq.prompt_token_ids[position]
            assert logprob == pytest.approx(float(expected[token]), abs=1e-4)
            assert chunk.ranks[i] == int((expected > expected[token]).sum()) + 1
            if k:
                assert chunk.top_ids[i] == expected.topk(k).indices.tolist()
                assert chunk.top_logprobs[i] == pytest.approx(expected.topk(k).values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def overlap_runner(tiny_llama_dir):
    """A runner that runs mixed steps as two micro-batches (on the CPU: one after the other)."""
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.worker.micro_batches import Overlap
    from tokenmill.worker.model_runner import ModelRunner

    cpu = torch.device("cpu")
    source = resolve_model(str(tiny_llama_dir))
    model = load_model(source, torch.float32, cpu)
    runner = ModelRunner(model, TorchAttentionBackend(), cpu, torch.float32, BLOCK_SIZE, source.hf_config.vocab_size, 0,
                         torch.float32, overlap=Overlap(mixed=True))
    runner.allocate_kv_cache(16)
    return runner


def test_mixed_steps_as_two_micro_batches(overlap_runner, tiny_llama_dir, monkeypatch):
    """Decodes in front of prompt chunks, cut into two micro-batches: the tokens are HF's."""
    import tokenmill.worker.model_runner as model_runner

    cuts = []
    real = model_runner.forward_micro_batches

    def spy(*args, **kwargs):
        cuts.append(args[6])
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "forward_micro_batches", spy)
    hf = hf_model(str(tiny_llama_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    a = MadeUpSequence(1, MadeUpRequest([18, 44, 101], greedy), block_ids=[6, 3])
    b = MadeUpSequence(2, MadeUpRequest([9, 250, 77, 12, 140], greedy), block_ids=[12, 1])
    c = MadeUpSequence(3, MadeUpRequest([5, 77, 140, 9, 31, 200, 64, 12, 3, 250], greedy), block_ids=[9, 2, 14])
    a.output_token_ids.append(_run(overlap_runner, [(a, 3)]).read().token_ids[0])  # a's prompt alone: one batch
    assert cuts == []
    # a decodes in front of b's whole prompt and c's first chunk (prefix of nothing yet).
    first = _run(overlap_runner, [(a, 1), (b, 5), (c, 6)])
    assert cuts == [1]
    # a and b decode in front of the rest of c's prompt (its first 6 tokens are context now).
    for seq, token in zip((a, b), first.read().token_ids):
        assert token == int(hf_next_logprobs(hf, seq.tokens(0, seq.num_known_tokens)).argmax())
        seq.output_token_ids.append(token)
    second = _run(overlap_runner, [(a, 1), (b, 1), (c, 4)])
    assert cuts == [1, 2]
    for seq, token in zip((a, b, c), second.read().token_ids):
        assert token == int(hf_next_logprobs(hf, seq.tokens(0, seq.num_known_tokens)).argmax())


def test_micro_batch_forward_equals_one_forward(overlap_runner):
    """The cut changes nothing but the order of work: the hidden states of a mixed step agree with
    one forward of the whole step (same kernels, same rows; only matmul blocking may differ)."""
    from tokenmill.attention.metadata import ForwardContext
    from tokenmill.worker.micro_batches import forward_micro_batches

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    d = MadeUpSequence(7, MadeUpRequest([3, 5, 8, 13, 21], greedy), block_ids=[4, 13], num_computed_tokens=4)
    e = MadeUpSequence(8, MadeUpRequest([40, 2, 99, 7, 61, 6, 30], greedy), block_ids=[10, 15], num_computed_tokens=2)
    runner = overlap_runner
    input_ids, positions, meta, _ = runner._prepare([ScheduledSequence(d, 1, True), ScheduledSequence(e, 5, True)])
    with torch.inference_mode():
        whole = runner.model(input_ids, positions, ForwardContext(meta, runner.kv_caches, runner.backend))
        cut = forward_micro_batches(runner.model, input_ids, positions, meta, runner.kv_caches, runner.backend, 1, None)
    assert cut.shape == whole.shape
    torch.testing.assert_close(cut, whole, atol=1e-5, rtol=1e-5)


def test_split_metadata_of_a_padded_decode_graph_batch():
    """A graph batch of 6 rows with 2 real ones, cut at 3: B starts past the real rows and gets
    no tokens; its tensors are fresh copies (aligned), A's are views of the step's."""
    from tokenmill.attention.metadata import AttentionMetadata
    from tokenmill.worker.micro_batches import split_metadata

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([17, 30, -1, -1, -1, -1]), query_start_loc=torch.tensor([0, 1, 2, 2, 2, 2, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 9, 0, 0, 0, 0], dtype=torch.int32), block_tables=torch.arange(12, dtype=torch.int32).view(6, 2),
        block_size=16, query_lens_host=[1] * 6, seq_lens_host=[64] * 6, max_query_len=1, max_seq_len=64,
    )
    tokens_a, a, b = split_metadata(meta, 3)
    assert tokens_a == 3
    assert a.query_start_loc.tolist() == [0, 1, 2, 2] and a.seq_lens.data_ptr() == meta.seq_lens.data_ptr()
    assert b.query_start_loc.tolist() == [0, 0, 0, 0]
    assert b.seq_lens.tolist() == [0, 0, 0] and b.block_tables.tolist() == [[6, 7], [8, 9], [10, 11]]
    assert b.slot_mapping.tolist() == [-1, -1, -1]
    assert b.seq_lens.data_ptr() != meta.seq_lens[3:].data_ptr()
    # Real rows past the cut: B's starts are rebased on the device.
    meta.query_start_loc.copy_(torch.arange(7, dtype=torch.int32))
    assert split_metadata(meta, 3)[2].query_start_loc.tolist() == [0, 1, 2, 3]
