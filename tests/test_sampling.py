"""Sampling on a tiny random Llama, each feature checked against a computation of its own:
Hugging Face logits with the filter or penalty applied here by hand (or by transformers' own
logits processors), and seeded draws compared across batch compositions."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from reference import hf_model, hf_next_logprobs
from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=64)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return hf_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(llm.llm_engine.config.vocab_size, [6, 19, 31, 12], seed=7)


def first_tokens(llm, prompt, params, count):
    outs = llm.generate(as_inputs([prompt]), params.clone(n=count, max_tokens=1), use_tqdm=False)
    return [c.token_ids[0] for c in outs[0].outputs]


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(as_inputs([prompts[0]]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed_params = [seeded, SamplingParams(temperature=0.8, max_tokens=5), SamplingParams(temperature=0.0, max_tokens=20),
                    SamplingParams(seed=99, max_tokens=12)]
    mixed = llm.generate(as_inputs([prompts[0], prompts[1], prompts[2], prompts[3]]), mixed_params, use_tqdm=False)
    reordered = llm.generate(as_inputs([prompts[2], prompts[0]]), [mixed_params[2], seeded], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert reordered[1].outputs[0].token_ids == alone
    other_seed = llm.generate(as_inputs([prompts[0]]), seeded.clone(seed=4321), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy_and_samples_follow_the_model_distribution(llm, hf, prompts):
    prompt = prompts[1]
    greedy = llm.generate(as_inputs([prompt]), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert first_tokens(llm, prompt, SamplingParams(temperature=1.0, top_k=1, seed=3), 4) == [greedy[0].outputs[0].token_ids[0]] * 4

    temperature, k, draws = 0.7, 4, 600
    logits = hf_next_logprobs(hf, prompt) / temperature
    top = torch.topk(logits, k)
    expected = dict(zip(top.indices.tolist(), torch.softmax(top.values, dim=-1).tolist()))
    counts = collections.Counter(first_tokens(llm, prompt, SamplingParams(temperature=temperature, top_k=k, seed=5), draws))
    assert set(counts) <= set(expected)
    total_variation = 0.5 * sum(abs(counts[t] / draws - p) for t, p in expected.items())
    assert total_variation < 0.08


def test_top_p_and_min_p_keep_only_the_allowed_tokens(llm, hf, prompts):
    prompt = prompts[2]
    probs = torch.softmax(hf_next_logprobs(hf, prompt), dim=-1)
    ordered, order = probs.sort(descending=True)
    mass_before = ordered.cumsum(0) - ordered
    nucleus = set(order[mass_before <= 0.5].tolist())
    sampled = set(first_tokens(llm, prompt, SamplingParams(top_p=0.5, seed=11), 300))
    assert sampled <= nucleus and len(sampled) > 1 or len(nucleus) == 1

    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    sampled = set(first_tokens(llm, prompt, SamplingParams(min_p=0.3, seed=12), 300))
    assert sampled <= allowed


def _penalised_greedy(hf, prompt, steps, presence, frequency, repetition):
    ids = list(prompt)
    out: list[int] = []
    rep = RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    for _ in range(steps):
        raw = hf(torch.tensor([ids])).logits[0, -1].float()
        if rep is not None:
            raw = rep(torch.tensor([ids]), raw[None])[0]
        for token, count in collections.Counter(out).items():
            raw[token] -= frequency * count + presence
        token = int(raw.argmax())
        out.append(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("presence, frequency, repetition", [(1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (0.0, 0.0, 1.8), (0.5, 0.5, 1.3)])
def test_penalties_match_independent_computation(llm, hf, prompts, presence, frequency, repetition):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition)
    ours = llm.generate(as_inputs([prompts[0]]), params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        expected = _penalised_greedy(hf, prompts[0], 12, presence, frequency, repetition)
    assert ours == expected


def test_stop_token_ids_and_min_tokens(llm, hf, prompts):
    free = llm.generate(as_inputs([prompts[3]]), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    k = 5
    stop_id = tokens[k]
    first = tokens.index(stop_id)
    stopped = llm.generate(as_inputs([prompts[3]]), SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id

    # Below min_tokens the stop id may not even be sampled: at its first position the next best token wins.
    held = llm.generate(as_inputs([prompts[3]]), SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id],
                                                                min_tokens=first + 3), use_tqdm=False)[0].outputs[0]
    assert stop_id not in held.token_ids[: first + 3] and len(held.token_ids) >= first + 3
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[3] + tokens[:first]])).logits[0, -1].float()
    logits[stop_id] = float("-inf")
    assert held.token_ids[: first + 1] == tokens[:first] + [int(logits.argmax())]


def test_n_samples_share_the_prompt_and_greedy_n_repeats(llm, prompts):
    prompt = prompts[2]  # 31 tokens: one full block of 16 is shared
    engine = llm.llm_engine
    before = engine.stats.num_batched_tokens
    out = llm.generate(as_inputs([prompt]), SamplingParams(n=4, temperature=1.0, seed=8, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    computed = engine.stats.num_batched_tokens - before
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Without sharing this would be 4 * 31 prompt tokens + 4 * 5 decode tokens.
    assert computed <= 31 + 3 * (31 - 16) + 4 * 5

    greedy = llm.generate(as_inputs([prompt]), SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_top_logprobs_match_hf(llm, hf, prompts):
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=4, logprobs=5, ignore_eos=True)
    out = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0].outputs[0]
    ids = list(prompts[1])
    for position, token in enumerate(out.token_ids):
        ref = hf_next_logprobs(hf, ids)
        entry = out.logprobs[position]
        top = torch.topk(ref, 5)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[tid].rank == rank and abs(entry[tid].logprob - lp) < 1e-4
        assert abs(entry[token].logprob - float(ref[token])) < 1e-4
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        ids.append(token)
