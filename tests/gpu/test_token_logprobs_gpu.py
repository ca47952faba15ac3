"""The sampled tokens' logprobs in two passes (kernels/triton/token_logprobs.py) on the GPU: against
``reference.token_logprobs_ref`` (log_softmax over the whole row) on 16-bit and fp32 logits, and in
the engine, where a step with logprobs 0 or 1 takes it (and prompt logprobs 0 or 1: perplexity),
against the same engine's torch path (logprobs 2 makes the whole table: the sampled or prompt token's
logprob, its rank and the top-1 must agree)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 37, 1024])
@pytest.mark.parametrize("vocab", [151936, 32000, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_token_logprobs_match_log_softmax(rows, vocab, dtype):
    from tokenmill.kernels.reference import token_logprobs_ref
    from tokenmill.kernels.triton.token_logprobs import token_logprobs

    gen = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).cuda()
    tokens = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    tokens[0] = int(logits[0].float().argmax())
    for top in (False, True):
        got = token_logprobs(logits, tokens, top)
        want = token_logprobs_ref(logits, tokens, top)
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
        # 16-bit logits: distinct values stay distinct after the shift, so the counts are exact; fp32
        # ones may differ where two logprobs round apart in one computation and together in the other.
        if dtype == torch.float32:
            assert (got[1] - want[1]).abs().max() <= 1
        else:
            assert torch.equal(got[1], want[1])
        assert got[1][0] == 1
        if top:
            assert torch.equal(got[2], want[2])
            torch.testing.assert_close(got[3], want[3], atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def small_llm(tmp_path_factory):
    from transformers import Qwen3Config

    from support.tiny_models import save_redrawn_bf16_model

    config = Qwen3Config(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = save_redrawn_bf16_model(tmp_path_factory.mktemp("token_logprobs"), config)
    return LLM(model, skip_tokenizer_init=True, max_model_len=512, gpu_memory_utilization=0.2, seed=0)


def test_engine_logprobs_0_and_1_agree_with_the_full_table(small_llm):
    llm = small_llm
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 31000 for j in range(5 + i % 9)]} for i in range(48)]
    runs = {}
    for k in (0, 1, 2):  # 2: the torch path (the whole [rows, V] table)
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=k)
        runs[k] = llm.generate(prompts, params, use_tqdm=False)
    for a, b, full in zip(runs[0], runs[1], runs[2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == full.outputs[0].token_ids
        for token, lp0, lp1, lp2 in zip(full.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs,
                                        full.outputs[0].logprobs):
            assert abs(lp0[token].logprob - lp2[token].logprob) < 1e-4 and lp0[token].rank == lp2[token].rank
            top = max(lp2.values(), key=lambda entry: entry.logprob)
            top_id = next(t for t, entry in lp1.items() if entry.rank == 1)
            assert abs(lp1[top_id].logprob - top.logprob) < 1e-4 and lp2[top_id].rank == 1


def test_engine_prompt_logprobs_0_and_1_agree_with_the_full_table(small_llm):
    prompts = [{"prompt_token_ids": [3 + (11 * i + 5 * j) % 31000 for j in range(40 + i)]} for i in range(6)]
    runs = {k: small_llm.generate(prompts, SamplingParams(max_tokens=1, detokenize=False, prompt_logprobs=k),
                                  use_tqdm=False) for k in (0, 1, 2)}
    for a, b, full in zip(runs[0], runs[1], runs[2]):
        ids = full.prompt_token_ids
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            token = ids[position]
            lp0, lp1, lp2 = (run.prompt_logprobs[position] for run in (a, b, full))
            assert abs(lp0[token].logprob - lp2[token].logprob) < 1e-4 and lp0[token].rank == lp2[token].rank
            top = max(lp2.values(), key=lambda entry: entry.logprob)
            top_id = next(t for t, entry in lp1.items() if entry.rank == 1)
            assert abs(lp1[top_id].logprob - top.logprob) < 1e-4 and lp2[top_id].rank == 1
