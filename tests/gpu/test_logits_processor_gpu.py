"""LLM(logits_processors=[...]) on a CUDA GPU (decode steps from CUDA graphs, the engine stepping
synchronously for the processors): rows a processor targets produce only its token, the other rows
the tokens of the same engine without processors (fp32, so the two runs agree bit for bit)."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # before fixtures build models

VOCAB = 1024


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    from support.tiny_models import save_redrawn_bf16_model

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)
    return save_redrawn_bf16_model(tmp_path_factory.mktemp("llama_logits_processors"), config)


def test_batch_processors_on_gpu(model_path):
    from test_logits_processor import TargetTokenProcessor

    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(1, VOCAB) for _ in range(rng.choice([3, 40, 200]))]} for _ in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 5, ignore_eos=True, detokenize=False,
                             extra_args={"target_token": 17} if i % 3 == 0 else None) for i in range(24)]
    options = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16)
    with_processors = LLM(model_path, logits_processors=[TargetTokenProcessor], **options)
    got = with_processors.generate(prompts, params, use_tqdm=False)
    assert with_processors.llm_engine.executor.runner.graphs is not None  # decode from CUDA graphs
    del with_processors
    plain = LLM(model_path, **options).generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(got, plain)):
        tokens = a.outputs[0].token_ids
        assert tokens == ([17] * len(tokens) if i % 3 == 0 else b.outputs[0].token_ids)
