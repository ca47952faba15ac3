"""Tensor parallelism over NCCL on two GPUs: TP=2 against TP=1 (and HF), with decode CUDA graphs
holding the NCCL all-reduces, and a killed worker. Skipped below two GPUs (the single-GPU machine
checks the graph capture of NCCL collectives in test_nccl_graphs_gpu.py instead).

NVLink multicast stays off: tokenmill sets NCCL_NVLS_ENABLE=0 (and the symmetric-memory and
NVSHMEM switches) wherever it creates an NCCL group, unless the environment already sets them.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from reference import hf_greedy, hf_model
from support.processes import check_worker_killed_during_generate, child_pids
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# The Llama-3-8B shape of bench/peer_bench.py (P3).
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                 tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()} for n in lengths]


def _release(llm: LLM) -> None:
    llm.llm_engine.executor.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _graph_buckets(worker) -> list[int]:
    return sorted(worker.runner.graphs.graphs)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_tp2_greedy_equals_tp1_and_hf_on_a_tiny_checkpoint(model, request):
    """fp32, CUDA graphs on: TP=2's decode steps replay graphs with the NCCL all-reduces inside."""
    from tokenmill.distributed.mirror import MirroredGraphs

    path = request.getfixturevalue(model)
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=2**26, seed=0)
    prompts = _prompts(289, [3, 17, 41, 9, 60, 5, 22, 11, 30, 2, 14], seed=1)  # 11: a padded bucket (16)
    params = GREEDY.clone(logprobs=1)
    tp2 = LLM(str(path), tensor_parallel_size=2, **options)
    assert isinstance(tp2.llm_engine.executor.runner.graphs, MirroredGraphs)
    buckets = tp2.collective_rpc(_graph_buckets)
    assert buckets[0] == buckets[1] and buckets[0]
    split = tp2.generate(prompts, params, use_tqdm=False)
    _release(tp2)
    single = LLM(str(path), tensor_parallel_size=1, **options).generate(prompts, params, use_tqdm=False)
    reference = hf_model(str(path))
    for prompt, a, b in zip(prompts, split, single, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_ids == hf_greedy(reference, prompt["prompt_token_ids"], GREEDY.max_tokens)[0]
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)


def test_tp2_greedy_matches_tp1_on_the_8b_shape(tmp_path):
    """bf16 at the 8B shape, random weights sliced from one seeded full model on each rank (so TP=2
    and TP=1 run the same model). Sums over two ranks round differently in bf16, so a greedy path
    may fork at a near tie: up to the first differing token the two must agree token for token with
    close logprobs, and at a fork each token must be among the other run's top 5 (vLLM's rule)."""
    from support.seeded_weights import load_seeded_weights

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    options = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32,
                   gpu_memory_utilization=0.6, seed=0)
    prompts = _prompts(LLAMA3_8B["vocab_size"], [7, 100, 250, 33, 500, 64, 1, 300] * 3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5, detokenize=False)
    runs = []
    for tp in (2, 1):
        llm = LLM(str(tmp_path), tensor_parallel_size=tp, **options)
        llm.collective_rpc(load_seeded_weights, args=(str(tmp_path), 11))
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        _release(llm)
    compared = 0
    for a, b in zip(*runs, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        for position, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert x in b.logprobs[position] and y in a.logprobs[position], (position, x, y)
                break
            assert abs(a.logprobs[position][x].logprob - b.logprobs[position][y].logprob) < 0.15, position
            compared += 1
    assert compared >= 4 * len(prompts)  # mostly the same paths, not forks at the first token


def test_worker_killed_on_the_gpu_raises_within_seconds_and_leaves_no_process(tiny_llama_dir):
    """Killed between decode steps that replay graphs: the next step must fail within seconds with
    the rank and the signal named (the watchdog aborts the NCCL group, so no kernel waits on the
    dead peer), later calls fail at once, and no worker process is left."""
    before = child_pids()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", max_model_len=256, max_num_seqs=16,
              kv_cache_memory_bytes=2**26, seed=0)
    assert llm.llm_engine.executor.runner.graphs is not None
    check_worker_killed_during_generate(llm, GREEDY, before)
