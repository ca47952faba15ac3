"""``LLM(logprobs_mode=...)`` (vLLM's four modes) against Hugging Face transformers fp32 and its own
logits processors (RepetitionPenalty, Temperature, TopK, TopP), teacher-forced along our tokens:
``raw_logits`` reports the model's logits; ``processed_logprobs`` / ``processed_logits`` the
distribution the tokens are drawn from (penalties, then temperature and the filters unless every
row is greedy), with cut tokens at -inf; the draws themselves do not depend on the mode."""

from __future__ import annotations

import math

import pytest
import torch

from reference import hf_model
from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import BeamSearchParams, SamplingParams

ATOL = 1e-4
TOP = 5  # logprobs asked for per position


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    return random_prompts(289, [4, 19], seed=8)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return hf_model(str(tiny_llama_dir))


def _positions(hf, prompt: list[int], tokens: list[int]):
    """HF's fp32 next-token logits after each prefix of prompt + tokens, with the ids before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    return [(torch.tensor([prompt + tokens[:i]]), logits[len(prompt) - 1 + i][None]) for i in range(len(tokens))]


def _processed_reference(ids, logits, params: SamplingParams, greedy_batch: bool) -> torch.Tensor:
    from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits.clone())
    if greedy_batch:
        return scores[0]
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if 0 < params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return scores[0]


def _reported(completion, position: int) -> dict[int, float]:
    return {token: lp.logprob for token, lp in completion.logprobs[position].items()}


def test_raw_logits_are_the_models_logits(tiny_llama_dir, prompts, hf):
    llm = make_llm(tiny_llama_dir, logprobs_mode="raw_logits")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=TOP)
    for prompt, output in zip(prompts, llm.generate(as_inputs(prompts), params, use_tqdm=False)):
        completion = output.outputs[0]
        for i, (_, logits) in enumerate(_positions(hf, prompt, completion.token_ids)):
            top = torch.topk(logits[0], TOP)
            reported = _reported(completion, i)
            assert set(top.indices.tolist()) <= set(reported)
            for token, value in reported.items():
                assert value == pytest.approx(float(logits[0, token]), abs=ATOL)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("settings, greedy", [
    (dict(temperature=0.0, repetition_penalty=1.5), True),
    (dict(temperature=0.7, top_k=4, repetition_penalty=1.3, seed=3), False),
    (dict(temperature=1.3, top_p=0.6, seed=4), False),
])
def test_processed_modes_report_the_distribution_drawn_from(tiny_llama_dir, prompts, hf, mode, settings, greedy):
    """Each position's reported values equal HF's processors applied to its logits (log-softmaxed for
    processed_logprobs); cut tokens are -inf, the drawn token is never one of them, and the tokens
    equal those the default mode draws with the same seeds."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=TOP, **settings)
    outputs = make_llm(tiny_llama_dir, logprobs_mode=mode).generate(as_inputs(prompts), params, use_tqdm=False)
    default = make_llm(tiny_llama_dir).generate(as_inputs(prompts), params, use_tqdm=False)
    cut_seen = False
    for prompt, output, plain in zip(prompts, outputs, default):
        completion = output.outputs[0]
        assert completion.token_ids == plain.outputs[0].token_ids
        for i, (ids, logits) in enumerate(_positions(hf, prompt, completion.token_ids)):
            expected = _processed_reference(ids, logits, params, greedy)
            if mode == "processed_logprobs":
                expected = torch.log_softmax(expected, dim=-1)
            reported = _reported(completion, i)
            assert math.isfinite(reported[completion.token_ids[i]])
            for token, value in reported.items():
                if math.isinf(float(expected[token])):
                    assert value == float("-inf")
                    cut_seen = True
                else:
                    assert value == pytest.approx(float(expected[token]), abs=ATOL)
    assert greedy or cut_seen or params.top_p < 1.0  # top-k 4 < TOP: the fifth reported token is cut


@pytest.mark.parametrize("with_processor", [False, True])
def test_processed_logits_add_the_logit_bias_once(tiny_llama_dir, prompts, hf, with_processor):
    """A logit bias shows in processed_logits exactly once, also when a Python logits processor
    (which takes the bias before it runs) is on the row; the row without a bias is untouched."""
    bias = {7: 6.0, 11: -2.0}
    noop = [lambda ids, logits: logits] if with_processor else None
    biased = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=TOP, logit_bias=bias,
                            logits_processors=noop)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=TOP, logits_processors=noop)
    llm = make_llm(tiny_llama_dir, logprobs_mode="processed_logits")
    outputs = llm.generate(as_inputs(prompts), [biased, plain], use_tqdm=False)
    assert any(7 in position for position in outputs[0].outputs[0].logprobs)  # the biased token is reported
    for prompt, output, shift in zip(prompts, outputs, (bias, {})):
        completion = output.outputs[0]
        for i, (_, logits) in enumerate(_positions(hf, prompt, completion.token_ids)):
            for token, value in _reported(completion, i).items():
                assert value == pytest.approx(float(logits[0, token]) + shift.get(token, 0.0), abs=ATOL)
            assert completion.token_ids[i] == int((logits[0] + torch.tensor([shift.get(t, 0.0) for t in range(logits.shape[1])])).argmax())


def test_beam_search_and_best_of_need_logprobs_not_logits(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir, logprobs_mode="processed_logits")
    with pytest.raises(ValueError, match="logprobs_mode='processed_logits'"):
        llm.beam_search(as_inputs(prompts), BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ValueError, match="best_of=3 ranks by log-probabilities"):
        llm.generate(as_inputs(prompts), SamplingParams(n=1, best_of=3, max_tokens=3), use_tqdm=False)
    beams = make_llm(tiny_llama_dir, logprobs_mode="processed_logprobs").beam_search(
        as_inputs(prompts), BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(beams) == len(prompts)


def test_an_unknown_logprobs_mode_is_refused():
    from tokenmill.config import EngineArgs

    with pytest.raises(ValueError, match="logprobs_mode='logits'.*'raw_logprobs'"):
        EngineArgs.from_kwargs("some-model", logprobs_mode="logits")


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_values_of_a_constrained_request_are_those_its_grammar_leaves(tiny_llama_dir, hf, prompts, mode):
    """vLLM's runner masks a grammar row's logits before its sampler reads them, so a constrained
    request's raw logprobs are those of the distribution its grammar leaves (the allowed tokens'
    summing to 1, the others -inf; vLLM's server writes those -9999.0), not the whole vocabulary's.
    Reference: Hugging Face's fp32 logits masked by a matcher of xgrammar's own compiler."""
    import xgrammar

    from tokenmill import StructuredOutputsParams

    regex = "[a-e]{2,6}"
    llm = make_llm(tiny_llama_dir, logprobs_mode=mode)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=TOP,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(llm.get_tokenizer())).compile_regex(regex)
    for prompt, out in zip(prompts, llm.generate(as_inputs(prompts), params, use_tqdm=False)):
        completion = out.outputs[0]
        matcher = xgrammar.GrammarMatcher(compiled)
        for (_, logits), token, position in zip(_positions(hf, prompt, completion.token_ids), completion.token_ids,
                                                completion.logprobs, strict=True):
            mask = xgrammar.allocate_token_bitmask(1, logits.shape[-1])
            matcher.fill_next_token_bitmask(mask)
            xgrammar.apply_token_bitmask_inplace(logits, mask)
            want = (torch.log_softmax(logits, dim=-1) if mode == "raw_logprobs" else logits)[0]
            for t, entry in position.items():
                assert entry.logprob == pytest.approx(want[t].item(), abs=ATOL), (t, completion.token_ids)
            assert matcher.accept_token(token)
        assert completion.finish_reason == "stop"
