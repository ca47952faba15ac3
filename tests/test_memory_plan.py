"""The sampling side of the GPU memory plan (``worker/sampling_profile.py``, ``ModelRunner.profile_run``),
on the CPU: the tables the profile holds are those the engine's own tables grow to under
``max_num_seqs`` running sequences with penalties and logit_bias (the real state classes on both
sides); the tables never pass that size, since an unlaunched plan's finished ids still reach the
runner; and profile_run holds them while it runs the sampler over a step's largest set of rows.
tests/gpu/test_memory_plan_gpu.py checks the plan against a GPU's memory."""

from __future__ import annotations

import random

import pytest
import torch

from support.state_seq import StateSeq
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.sampling_args import counts_width
from tokenmill.worker.sampling_profile import SamplingReserve, float32_path_shapes, largest_state, state_bytes
from tokenmill.worker.sampling_state import LogitBiasState, PenaltyState, SlotTable, slot_capacity

CPU = torch.device("cpu")
MAX_NUM_SEQS = 5  # not a power of two: the tables grow to 8 rows


def same(x: torch.Tensor) -> torch.Tensor:
    return x


def make_llm(path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=64 * 2**20, seed=0,
                   max_num_seqs=MAX_NUM_SEQS)
    return LLM(str(path), **{**options, **kwargs})


def test_slot_capacity_is_the_tables_growth_rule():
    assert [slot_capacity(n) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert slot_capacity(1024) == 1024 and slot_capacity(1025) == 2048
    table, penalties, bias = SlotTable(), PenaltyState(50, CPU), LogitBiasState(50, CPU)
    params = SamplingParams(repetition_penalty=1.2, logit_bias={3: 1.0})
    for n in range(1, 20):  # one more sequence at a time: each doubling as SlotTable makes it
        seq = StateSeq(n, params, [1, 2])
        table.assign(seq)
        penalties.slots([seq], same)
        bias.slots([seq], same)
        assert table.capacity == penalties.counts.shape[0] == bias.bias.shape[0] == slot_capacity(n)


def test_engine_tables_stay_within_the_planned_size(tiny_llama_dir):
    # More requests than max_num_seqs, of different lengths: sequences finish and others take their
    # place while the rest run, with penalties and a logit bias each (n = 2 for some).
    llm = make_llm(tiny_llama_dir)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randrange(2, 30))]} for _ in range(13)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 12), ignore_eos=True, temperature=1.0, seed=i, n=1 + i % 3 // 2,
                             repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={7: 2.0}) for i in range(13)]
    llm.generate(prompts, params, use_tqdm=False)
    runner = llm.llm_engine.executor.runner
    planned_penalties, planned_bias = largest_state(runner.vocab_size, CPU, MAX_NUM_SEQS, same)
    # Reached and not passed: the profile's tables are the engine's, shape for shape.
    for got, planned in ((runner.penalties, planned_penalties), (runner.logit_bias, planned_bias)):
        assert got.table.capacity == planned.table.capacity == slot_capacity(MAX_NUM_SEQS) == 8
    shapes = lambda p, b: [tuple(t.shape) for t in (p.counts, p.prompt_bits, p.repetition, p.frequency, p.presence, b.bias)]
    assert shapes(runner.penalties, runner.logit_bias) == shapes(planned_penalties, planned_bias)
    assert state_bytes(runner.penalties, runner.logit_bias) == state_bytes(planned_penalties, planned_bias)


def test_an_unlaunched_plans_finished_ids_reach_the_runner(tiny_llama_dir):
    # Aborted while it is the only request: the next plan schedules nothing and is never launched.
    # Its report must reach the runner with the following plan, or the aborted sequence would keep
    # its slots and the tables could grow past max_num_seqs rows.
    llm = make_llm(tiny_llama_dir)
    engine = llm.llm_engine
    runner = engine.executor.runner
    plans = []
    execute = runner.execute
    runner.execute = lambda plan: plans.append(plan) or execute(plan)
    params = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3, logit_bias={7: 2.0})
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.step()
    engine.step()
    aborted = engine.requests["a"].sequences[0].seq_id
    assert runner.penalties.table.get(aborted) is not None
    engine.abort_request("a")
    engine.step()  # nothing to schedule
    launched = len(plans)
    engine.add_request("b", {"prompt_token_ids": [8, 9]}, params)
    engine.step()
    assert len(plans) == launched + 1 and aborted in plans[-1].finished_seq_ids
    assert runner.penalties.table.get(aborted) is None and runner.logit_bias.table.get(aborted) is None


def test_profile_run_holds_the_largest_state_while_it_samples(tiny_llama_dir, monkeypatch):
    llm = make_llm(tiny_llama_dir)
    runner = llm.llm_engine.executor.runner
    vocab = runner.vocab_size
    seen = {}
    sample = runner.sampler.__class__.__call__

    def spy(sampler, logits, batch):
        state = batch.state
        seen.update(logits=tuple(logits.shape), bias=tuple(state.bias.shape), counts=tuple(state.counts.shape),
                    bits=tuple(state.prompt_bits.shape), bias_rows=batch.bias_rows.rows.tolist(),
                    penalty_rows=batch.penalty_rows.slots.tolist(), filters=batch.filters is not None,
                    greedy=batch.all_greedy, logprobs=batch.max_num_logprobs, mode=batch.logprobs_mode)
        return sample(sampler, logits, batch)

    monkeypatch.setattr(runner.sampler.__class__, "__call__", spy)
    allocated = []
    empty = torch.empty

    def spy_empty(*shape, **kwargs):  # the float32 path's extra tensors, allocated around the pass
        size = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        allocated.append((size, kwargs.get("dtype")))
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", spy_empty)
    # max_num_batched_tokens 3 < max_num_seqs 5: a step samples 3 rows at most, while 5 running
    # sequences still hold state (8 rows).
    reserve = runner.profile_run(3, MAX_NUM_SEQS, max_logprobs=20)
    rows = 8
    assert seen == dict(logits=(3, vocab), bias=(rows, vocab), counts=(rows, counts_width(vocab)),
                        bits=(rows, -(-vocab // 32)), bias_rows=[0, 1, 2], penalty_rows=[0, 1, 2], filters=True,
                        greedy=False, logprobs=20, mode="raw_logprobs")
    assert float32_path_shapes(3, vocab) == [(3, vocab), (3, vocab)]  # few rows: the bias gathered at once
    assert allocated.count(((3, vocab), torch.float32)) == 2
    expected_bytes = rows * (2 * counts_width(vocab) + 4 * -(-vocab // 32) + 12) + rows * 4 * vocab  # int16 counts
    assert reserve == SamplingReserve(state_rows=rows, state_bytes=expected_bytes, sampler_rows=3)
    # The engine's own tables are untouched (fresh ones were profiled and dropped).
    assert runner.penalties.table.capacity == 1 and runner.logit_bias.table.capacity == 1


@pytest.mark.parametrize("max_logprobs", [-1, 0])
def test_profile_run_asks_the_most_logprobs_allowed(tiny_llama_dir, monkeypatch, max_logprobs):
    llm = make_llm(tiny_llama_dir, max_logprobs=max_logprobs)
    runner = llm.llm_engine.executor.runner
    wanted = []
    sample = runner.sampler.__class__.__call__
    monkeypatch.setattr(runner.sampler.__class__, "__call__",
                        lambda sampler, logits, batch: wanted.append(batch.max_num_logprobs) or sample(sampler, logits, batch))
    runner.profile_run(4, 2, max_logprobs=max_logprobs)
    assert wanted == [runner.vocab_size if max_logprobs < 0 else max_logprobs]
