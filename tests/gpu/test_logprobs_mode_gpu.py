"""``LLM(logprobs_mode="processed_logprobs")`` on a CUDA GPU: the processed logits are made in torch
and the Triton draw kernel samples from them (no state, no filters), so the tokens must equal the
default mode's (the kernels filtering and penalising themselves) and every reported value HF's
processors on the same prefix; fp32 model, HF fp32 on the CPU as the reference. The CPU twin:
tests/test_logprobs_mode.py."""

from __future__ import annotations

import math

import pytest
import torch

from reference import hf_model
from test_generate import as_inputs, random_prompts
from test_logprobs_mode import _positions, _processed_reference, _reported
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=4, repetition_penalty=1.3, seed=3),
                                      dict(temperature=1.3, top_p=0.6, frequency_penalty=0.5, seed=4)])
def test_processed_logprobs_on_gpu_match_hf_processors_and_keep_the_draws(tiny_llama_dir, settings):
    options = dict(dtype="float32", max_model_len=256, gpu_memory_utilization=0.2, seed=0)
    prompts = random_prompts(289, [4, 19, 33], seed=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5, **settings)
    processed = LLM(str(tiny_llama_dir), logprobs_mode="processed_logprobs", **options).generate(
        as_inputs(prompts), params, use_tqdm=False)
    default = LLM(str(tiny_llama_dir), **options).generate(as_inputs(prompts), params, use_tqdm=False)
    hf = hf_model(str(tiny_llama_dir))
    for prompt, output, plain in zip(prompts, processed, default):
        completion = output.outputs[0]
        assert completion.token_ids == plain.outputs[0].token_ids
        if params.frequency_penalty:
            continue  # HF has no frequency penalty processor: the draws above are this case's check
        for i, (ids, logits) in enumerate(_positions(hf, prompt, completion.token_ids)):
            expected = torch.log_softmax(_processed_reference(ids, logits, params, greedy_batch=False), dim=-1)
            for token, value in _reported(completion, i).items():
                if math.isinf(float(expected[token])):
                    assert value == float("-inf")
                else:
                    assert value == pytest.approx(float(expected[token]), abs=2e-3)
