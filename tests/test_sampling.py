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
from tokenmill.sampling_params import RequestOutputKind


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


def test_the_models_eos_ends_a_request_unless_ignore_eos(llm, prompts):
    """The engine adds the model's eos ids to every request's stop ids (not a user stop id: no
    stop_reason); ignore_eos=True leaves them out. eos is forced with a large bias at one position."""
    (eos,) = llm.llm_engine.config.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0})
    ended = llm.generate(as_inputs([prompts[0]]), params, use_tqdm=False)[0].outputs[0]
    assert ended.token_ids == [eos] and (ended.finish_reason, ended.stop_reason) == ("stop", None)
    kept = llm.generate(as_inputs([prompts[0]]), params.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == [eos] * 8 and kept.finish_reason == "length"


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

    with pytest.raises(ValueError, match="must be 1 when using greedy sampling"):  # vLLM's rule: n identical samples
        SamplingParams(n=3, temperature=0.0)


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


# ---- logit controls: each output token checked against HF's logits with the control applied here ----

def greedy_with_controls(llm, prompt, **controls):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **controls)
    return llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0].outputs[0].token_ids


def assert_teacher_forced(hf, prompt, tokens, adjust):
    """Each token must be the argmax of HF's next-token logits after ``adjust(logits, output_so_far)``."""
    for t, token in enumerate(tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens[:t]])).logits[0, -1].float()
        assert token == int(adjust(logits, tokens[:t]).argmax()), f"position {t}"


def test_logit_bias_shifts_exactly_the_given_tokens(llm, hf, prompts):
    baseline = greedy_with_controls(llm, prompts[1])
    bias = {baseline[0]: -100.0, baseline[1]: 3.0, 11: 4.5}
    tokens = greedy_with_controls(llm, prompts[1], logit_bias={str(k): v for k, v in bias.items()})  # JSON-style keys
    assert tokens[0] != baseline[0]

    def adjust(logits, _):
        for tid, b in bias.items():
            logits[tid] += b
        return logits

    assert_teacher_forced(hf, prompts[1], tokens, adjust)
    forced = greedy_with_controls(llm, prompts[1], logit_bias={7: 100.0})
    assert forced == [7] * 8


def test_one_params_edited_between_calls_samples_with_its_current_settings(llm, hf, prompts):
    # FINAL_ONLY, ignore_eos and no stop ids: the engine keeps the caller's object rather than a
    # copy, so a snapshot of what the sampler needs must not outlive the call.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    plain = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0].outputs[0].token_ids
    forced_token = next(t for t in range(5, 100) if t not in plain)
    params.logit_bias = {forced_token: 100.0}
    forced = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [forced_token] * 8
    params.logit_bias = None
    params.presence_penalty, params.repetition_penalty = 0.5, 1.5
    penalised = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        assert penalised == _penalised_greedy(hf, prompts[1], 8, 0.5, 0.0, 1.5)


def test_allowed_token_ids_restrict_greedy_and_sampled_tokens(llm, hf, prompts):
    allowed = [5, 17, 23, 40, 61]
    tokens = greedy_with_controls(llm, prompts[2], allowed_token_ids=allowed)

    def adjust(logits, _):
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0.0
        return logits + mask

    assert_teacher_forced(hf, prompts[2], tokens, adjust)
    sampled = llm.generate(as_inputs([prompts[2]]), SamplingParams(temperature=1.5, max_tokens=40, ignore_eos=True, seed=3,
                                                                   allowed_token_ids=allowed), use_tqdm=False)
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated(llm, hf, prompts):
    tokenizer = llm.get_tokenizer()
    baseline = greedy_with_controls(llm, prompts[0])
    # A generated token that is a word of its own, so banning the word must change the output.
    word = next(w for w in map(lambda t: tokenizer.decode([t]), baseline)
                if w.strip() == w and len(tokenizer.encode(w, add_special_tokens=False)) == 1)
    encodings = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    tokens = greedy_with_controls(llm, prompts[0], bad_words=[word])
    assert tokens != baseline

    def adjust(logits, out):
        for enc in encodings:
            if len(enc) == 1 or (len(out) >= len(enc) - 1 and out[len(out) - len(enc) + 1:] == enc[:-1]):
                logits[enc[-1]] = float("-inf")
        return logits

    assert_teacher_forced(hf, prompts[0], tokens, adjust)
    for enc in encodings:
        assert not any(tokens[i:i + len(enc)] == enc for i in range(len(tokens))), enc


def test_logits_processors_in_both_vllm_forms(llm, hf, prompts):
    seen_prompts = []

    def no_repeats(output_ids, logits):
        logits[list(output_ids)] = float("-inf")
        return logits

    def records_prompt(prompt_ids, output_ids, logits):
        seen_prompts.append(list(prompt_ids))
        return logits

    tokens = greedy_with_controls(llm, prompts[3], logits_processors=[no_repeats, records_prompt])
    assert len(set(tokens)) == len(tokens)
    assert seen_prompts and all(p == prompts[3] for p in seen_prompts)
    assert_teacher_forced(hf, prompts[3], tokens, lambda logits, out: no_repeats(out, logits))


@pytest.mark.parametrize(
    ("controls", "field"),
    [
        (dict(logit_bias={10**7: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[3, 10**7]), "allowed_token_ids"),
        # vLLM refuses stop ids outside the vocabulary too; with min_tokens (which masks them) the step failed.
        (dict(stop_token_ids=[3, 10**7]), "stop_token_ids"),
        (dict(stop_token_ids=[10**7], min_tokens=2), "stop_token_ids"),
    ],
)
def test_logit_controls_outside_the_vocabulary_are_refused(llm, prompts, controls, field):
    with pytest.raises(ValueError, match=rf"prompts\[0\].*{field}.*outside the vocabulary"):
        llm.generate(as_inputs([prompts[0]]), SamplingParams(**controls), use_tqdm=False)


@pytest.mark.parametrize(
    ("controls", "field"),
    [
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(logits_processors=[3]), "logits_processors"),
    ],
)
def test_malformed_logit_controls_name_the_field(controls, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**controls)


# ---- prompt logprobs against HF's log_softmax over the whole prompt ----

@pytest.mark.parametrize("chunked, k, detokenize", [(False, 3, True), (True, 3, True), (False, 1, False), (True, 3, False)])
def test_prompt_logprobs_match_hf(tiny_llama_dir, hf, prompts, chunked, k, detokenize):
    # Chunked: an 8-token budget splits the 31-token prompt over four steps; prefix caching stays
    # on, and the second run of the same prompt must still score every position. Without
    # detokenize the positions are built on the output processor's direct path (no decoded tokens).
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=2) if chunked else make_llm(tiny_llama_dir)
    prompt = prompts[2]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k, detokenize=detokenize)
    for _ in range(2):
        out = llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[pos], expected[pos - 1]
            token = prompt[pos]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(k).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= k + 1 and list(entry)[0] == token
            for rank, tid in enumerate(top, start=1):
                assert abs(entry[tid].logprob - row[tid].item()) < 1e-4
                assert entry[tid].rank == rank
            assert all((lp.decoded_token is not None) == detokenize for lp in entry.values())
    assert llm.generate(as_inputs([prompt]), SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_samples_on_a_copied_partial_block_equal_one_sample_alone(tiny_llama_dir, prompts, kv_cache_dtype):
    """Samples 1..n-1 start from sample 0's blocks, its partial last block copied (prompts of 6-31
    tokens: a partial block each, 16-token blocks); at a temperature of 1e-4 (greedy in effect: vLLM
    refuses n > 1 at 0) every sample's tokens and logprobs equal those of the request run alone,
    over a float32 cache and an fp8 one (the copy moves bytes)."""
    from tokenmill import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=16 * 2**20,
              seed=0, kv_cache_dtype=kv_cache_dtype)
    copies = []
    runner = llm.llm_engine.executor.runner
    copy = runner._copy_blocks
    runner._copy_blocks = lambda pairs: copies.extend(pairs) or copy(pairs)
    greedy = SamplingParams(temperature=1e-4, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    alone = llm.generate(as_inputs(prompts), greedy, use_tqdm=False)
    shared = llm.generate(as_inputs(prompts), greedy.clone(n=3), use_tqdm=False)
    assert len(copies) == 2 * len(prompts)  # samples 1 and 2 of every prompt
    for one, three in zip(alone, shared, strict=True):
        for sample in three.outputs:
            assert sample.token_ids == one.outputs[0].token_ids
            assert sample.cumulative_logprob == pytest.approx(one.outputs[0].cumulative_logprob, abs=1e-5)


def test_best_of_returns_the_n_most_likely_of_best_of_samples(llm, prompts):
    base = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, logprobs=0)
    # best_of=4 runs exactly the four seeded samples that n=4 runs; it must return the top two of them.
    four = llm.generate(as_inputs([prompts[1]]), base.clone(n=4), use_tqdm=False)[0].outputs
    ranked = sorted(four, key=lambda c: c.cumulative_logprob, reverse=True)
    best = llm.generate(as_inputs([prompts[1]]), base.clone(n=2, best_of=4), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert len({tuple(c.token_ids) for c in four}) > 2  # the choice mattered
    quiet = llm.generate(as_inputs([prompts[1]]), base.clone(n=2, best_of=4, logprobs=None), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in quiet] == [c.token_ids for c in best] and quiet[0].logprobs is None
    with pytest.raises(ValueError, match=r"SamplingParams\.best_of=1"):
        SamplingParams(n=2, best_of=1)
