"""The GPU memory plan (worker/sizing.py) holds at the sampling side's worst case: 512 sequences
with penalties, logit_bias, filters and logprobs admitted in one step on a model with Qwen's
vocabulary (151,936), under a KV pool as large as gpu_memory_utilization allows. The sampling
state (the penalty and bias tables at 512 rows, ~632 MB, and the bias rows' copy when they are
filled) and the sampler's working memory must fit the share the plan left. First run (H200): peak
reserved 1,041 MiB under the share; with the plan as it was (a forward and a softmax), 955 MiB over."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from support.tiny_models import save_redrawn_bf16_model
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # before fixtures build models

VOCAB = 151_936
MAX_NUM_SEQS = 512
UTILIZATION = 0.25
SLACK = 32 * 2**20  # the allocator's rounding; the plan itself keeps 256 MB of headroom besides


@pytest.fixture(scope="module")
def qwen_vocab_model(tmp_path_factory) -> str:
    from transformers import Qwen3Config

    # Small layers and a large KV block (256 KiB), so that a 32K-token max_model_len makes the pool
    # take all of its share, not max_num_seqs full sequences' worth.
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return save_redrawn_bf16_model(tmp_path_factory.mktemp("qwen_vocab"), config)


def test_sampling_state_and_sampler_fit_the_memory_plan(qwen_vocab_model):
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(qwen_vocab_model, skip_tokenizer_init=True, max_model_len=32768, max_num_seqs=MAX_NUM_SEQS,
              gpu_memory_utilization=UTILIZATION, seed=0)
    runner = llm.llm_engine.executor.runner
    total = torch.cuda.mem_get_info()[1]
    blocks = llm.llm_engine.executor.num_blocks
    assert blocks - 1 < MAX_NUM_SEQS * (32768 // 16), "the pool must be sized by the memory share, not capped"
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(16)]} for _ in range(MAX_NUM_SEQS)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
                            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1,
                            logit_bias={i: 0.5 for i in range(3, 40)}, logprobs=20)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    # The worst case was reached: every sequence held both tables' rows at once.
    assert runner.penalties.table.capacity == runner.logit_bias.table.capacity == MAX_NUM_SEQS
    share = UTILIZATION * total
    print(f"peak reserved {peak / 2**30:.3f} GiB, share {share / 2**30:.3f} GiB, "
          f"margin {(share - peak) / 2**20:.0f} MiB, {blocks} KV blocks")
    assert peak <= share + SLACK, f"peak reserved {peak / 2**30:.3f} GiB passed the share {share / 2**30:.3f} GiB"


def test_prompt_logprobs_of_a_long_chunk_fit_the_memory_plan(qwen_vocab_model):
    """Prompt logprobs over 8,192-token chunks (the default max_num_batched_tokens) with the full
    vocabulary: scored whole, a chunk's [8191, V] float32 log-probabilities alone would be ~5 GB,
    beyond the share; scored in slices of the sampler pass's rows (ModelRunner._score_prompt), the
    run stays within it. 64 sequences: the smallest slice (MIN_PROMPT_LOGPROB_ROWS) and a sampler
    reserve of as many rows, so the test does not lean on the plan's headroom."""
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(qwen_vocab_model, skip_tokenizer_init=True, max_model_len=32768, max_num_seqs=64,
              max_num_batched_tokens=8192, gpu_memory_utilization=UTILIZATION, seed=0)
    total = torch.cuda.mem_get_info()[1]
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(12_000)]} for _ in range(2)]
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, prompt_logprobs=5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    assert all(len(o.prompt_logprobs) == 12_000 and o.prompt_logprobs[0] is None for o in outputs)
    share = UTILIZATION * total
    print(f"peak reserved {peak / 2**30:.3f} GiB, share {share / 2**30:.3f} GiB, margin {(share - peak) / 2**20:.0f} MiB")
    assert peak <= share + SLACK, f"peak reserved {peak / 2**30:.3f} GiB passed the share {share / 2**30:.3f} GiB"
