"""Tensor parallelism on the CPU over gloo: two ranks (this process and one worker process).

Greedy tokens with tensor_parallel_size=2 must equal those of one rank and of Hugging Face (also
with decode steps going through mirrored graph replays, and with random weights sliced from one
seeded model);
collective_rpc / apply_model must reach both ranks (checked against HF's unsplit weights); a
killed worker must surface as a RuntimeError within seconds and leave no process behind; and
a rank must read only its slices of the checkpoint.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from reference import hf_greedy, hf_model
from support.processes import check_worker_killed_during_generate, child_pids
from tokenmill import LLM, SamplingParams

# A small step budget splits the longer prompts into prefill chunks, so steps mix chunks and decodes.
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=8 * 2**20,
               max_num_batched_tokens=24, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT_LENGTHS = [3, 17, 41, 9]


def make_llm(path: Path, tp: int, **kwargs) -> LLM:
    return LLM(str(path), tensor_parallel_size=tp, **{**OPTIONS, **kwargs})


def random_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def worker_pids(llm: LLM) -> list[int]:
    return [proc.pid for proc in llm.llm_engine.executor.workers.procs]


@pytest.fixture(scope="module")
def llama_tp2(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, 2)
    yield llm
    llm.llm_engine.executor.shutdown()


@pytest.fixture(scope="module")
def llama_tp1(tiny_llama_dir):
    return make_llm(tiny_llama_dir, 1)


def _greedy_matches(tp2: LLM, tp1: LLM, path: Path, seed: int) -> None:
    prompts = random_prompts(tp1.llm_engine.config.vocab_size, seed)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = GREEDY.clone(logprobs=1, prompt_logprobs=1)  # prompt logprobs: several logits calls a step
    split = tp2.generate(inputs, params, use_tqdm=False)
    single = tp1.generate(inputs, params, use_tqdm=False)
    reference = hf_model(str(path))
    for prompt, a, b in zip(prompts, split, single, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens)[0]
        # Sums over ranks add in another order than one rank does: equal to rounding.
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_llama_greedy_tp2_equals_tp1_and_hf(llama_tp2, llama_tp1, tiny_llama_dir):
    _greedy_matches(llama_tp2, llama_tp1, tiny_llama_dir, seed=1)


def test_qwen3_greedy_tp2_equals_tp1_and_hf_then_deleting_stops_workers(tiny_qwen3_dir):
    """Qwen3: q/k norms, head_dim 32 != hidden / heads, biases, tied head over a padded odd vocabulary.
    With asynchronous scheduling, so the mirrored inputs include ids gathered from the last step."""
    before = child_pids()
    tp2 = make_llm(tiny_qwen3_dir, 2, async_scheduling=True)
    workers = worker_pids(tp2)
    assert set(workers) <= child_pids() - before
    _greedy_matches(tp2, make_llm(tiny_qwen3_dir, 1), tiny_qwen3_dir, seed=2)
    assert tp2.llm_engine.stats.num_overlapped_steps > 0
    del tp2
    gc.collect()
    assert child_pids() - before == set()


def test_apply_model_returns_each_rank_shard(llama_tp2, tiny_llama_dir):
    """Rank r holds query heads 2r, 2r+1 and KV head r of HF's q/k/v projections (4 and 2 heads)."""
    shards = llama_tp2.apply_model(lambda model: model.model.layers[1].self_attn.qkv_proj.weight.clone())
    assert len(shards) == 2
    hf_attn = hf_model(str(tiny_llama_dir)).model.layers[1].self_attn
    head_dim = hf_attn.head_dim
    for rank, shard in enumerate(shards):
        q, k, v = shard.split([2 * head_dim, head_dim, head_dim])
        torch.testing.assert_close(q, hf_attn.q_proj.weight[2 * rank * head_dim : (2 * rank + 2) * head_dim], rtol=0, atol=0)
        torch.testing.assert_close(k, hf_attn.k_proj.weight[rank * head_dim : (rank + 1) * head_dim], rtol=0, atol=0)
        torch.testing.assert_close(v, hf_attn.v_proj.weight[rank * head_dim : (rank + 1) * head_dim], rtol=0, atol=0)


def test_collective_rpc_reaches_every_rank(llama_tp2, llama_tp1):
    def describe(worker, layer, *, what):
        return worker.rank, what, tuple(worker.runner.kv_caches[layer].shape)

    results = llama_tp2.collective_rpc(describe, args=(1,), kwargs={"what": "kv"})
    (rank0, _, shape0), (rank1, _, shape1) = results
    assert (rank0, rank1) == (0, 1)
    assert shape0 == shape1 and shape0[3] == 1  # one of the two KV heads each, the same blocks on both
    by_name = llama_tp2.collective_rpc("apply_model", args=(lambda model: model.lm_head.weight.shape[0],))
    assert by_name == [145, 145]  # 289 rows padded to 290, split in two
    assert llama_tp1.collective_rpc("apply_model", args=(lambda model: model.lm_head.weight.shape[0],)) == [289]
    assert llama_tp1.apply_model(lambda model: model.num_kv_heads) == [2]
    with pytest.raises(ValueError, match="no_such_method"):
        llama_tp2.collective_rpc("no_such_method")


def test_collective_rpc_errors_and_timeouts_leave_the_llm_working(llama_tp2, llama_tp1):
    def fail_on_rank1(worker):
        if worker.rank == 1:
            raise KeyError("only on rank 1")
        return worker.rank

    with pytest.raises(RuntimeError, match="only on rank 1"):
        llama_tp2.collective_rpc(fail_on_rank1)

    def slow_on_rank1(worker):
        time.sleep(1.0 if worker.rank == 1 else 0.0)
        return worker.rank

    with pytest.raises(TimeoutError):
        llama_tp2.collective_rpc(slow_on_rank1, timeout=0.1)
    assert llama_tp2.collective_rpc(lambda worker: worker.rank) == [0, 1]  # the late reply is dropped
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    assert (llama_tp2.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            == llama_tp1.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_worker_killed_during_generate_raises_and_leaves_no_process(tiny_llama_dir):
    before = child_pids()
    check_worker_killed_during_generate(make_llm(tiny_llama_dir, 2), GREEDY, before)


def test_worker_killed_between_generates_raises_and_leaves_no_process(llama_tp1, tiny_llama_dir):
    before = child_pids()
    llm = make_llm(tiny_llama_dir, 2)
    prompt = [{"prompt_token_ids": [9, 8, 7, 6]}]
    assert (llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            == llama_tp1.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    os.kill(worker_pids(llm)[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 .*SIGKILL"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5.0
    assert child_pids() - before == set()


def test_decode_graph_replays_are_mirrored_on_every_rank(llama_tp1, tiny_llama_dir):
    """Decode graphs under TP (CUDA-only) stood in for by an eager twin with the same run(): rank 0's
    replays must reach rank 1 with the same inputs (else its collectives would not pair and the
    tokens would differ), steps over the stand-in's max batch run eagerly, and both ranks run alike."""
    from support.eager_graphs import graph_runs, install_eager_graphs

    from tokenmill.distributed.mirror import MirroredGraphs

    llm = make_llm(tiny_llama_dir, 2)
    try:
        llm.collective_rpc(install_eager_graphs, args=(2,))  # 4 prompts: decode steps of 1-4 sequences
        llm.llm_engine.executor.mirror_decode_graphs()
        assert isinstance(llm.llm_engine.executor.runner.graphs, MirroredGraphs)
        _greedy_matches(llm, llama_tp1, tiny_llama_dir, seed=3)
        rank0, rank1 = llm.collective_rpc(graph_runs)
        assert rank0 == rank1 and rank0 and max(rank0) <= 2
        assert llama_tp1.llm_engine.executor.runner.graphs is None
    finally:
        llm.llm_engine.executor.shutdown()


def test_seeded_full_weights_are_one_model_at_tp2_and_tp1(tiny_llama_dir):
    """The GPU tests' dummy 8B model (tests/support/seeded_weights.py), at the tiny shape: each rank
    keeps its slices of one seeded full model, so TP=2, TP=1 and HF with those weights agree."""
    from support.seeded_weights import hf_seeded_model, load_seeded_weights

    prompts = random_prompts(289, seed=4)
    outputs = []
    for tp in (2, 1):
        llm = make_llm(tiny_llama_dir, tp, load_format="dummy")
        try:
            llm.collective_rpc(load_seeded_weights, args=(str(tiny_llama_dir), 7))
            outputs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
        finally:
            llm.llm_engine.executor.shutdown()
    reference = hf_seeded_model(tiny_llama_dir, 7)
    for prompt, a, b in zip(prompts, *outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens)[0]


def test_nvlink_multicast_stays_off_unless_the_user_turned_it_on(monkeypatch):
    from tokenmill.distributed.process_group import keep_nvlink_multicast_off

    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    keep_nvlink_multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "0"  # the user's own setting stands


def test_heads_not_divisible_by_tp_size_is_refused_before_any_worker_starts(tiny_llama_dir, monkeypatch):
    """Refused in LLM() from the config, naming the sizes that fit, not by the layers of a worker
    process started for it (seconds later)."""
    from tokenmill.distributed import worker_processes

    def no_workers(*args, **kwargs):
        raise AssertionError("worker processes were started for a tensor_parallel_size the model cannot split over")

    monkeypatch.setattr(worker_processes.WorkerProcesses, "__init__", no_workers)
    before = child_pids()
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=3 .*"
                                         r"allowed: tensor_parallel_size in \[1, 2, 4\]"):
        make_llm(tiny_llama_dir, 3)
    # kv heads: 8 heads over 4 ranks, but 6 kv heads neither split over 4 ranks nor are copied evenly.
    with pytest.raises(ValueError, match=r"num_key_value_heads=6 is not divisible by tensor_parallel_size=4 .*"
                                         r"allowed: tensor_parallel_size in \[1, 2\]"):
        make_llm(tiny_llama_dir, 4, hf_overrides={"num_attention_heads": 12, "num_key_value_heads": 6})
    with pytest.raises(ValueError, match=r"intermediate_size=130 is not divisible by tensor_parallel_size=4 .*"
                                         r"allowed: tensor_parallel_size in \[1, 2\]"):
        make_llm(tiny_llama_dir, 4, hf_overrides={"intermediate_size": 130})
    assert child_pids() - before == set()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(tiny_llama_dir, 0)


@pytest.mark.parametrize(("shape", "tp_size", "problem"), [
    (dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536), 3, None),  # SmolLM2-135M
    (dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536), 2, "num_attention_heads=9"),
    (dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536), 9, "intermediate_size=1536"),
    (dict(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336), 8, None),  # Llama-3-8B
    (dict(num_attention_heads=32, num_key_value_heads=2, intermediate_size=256), 4, None),  # kv heads copied
    (dict(num_attention_heads=12, num_key_value_heads=4, intermediate_size=256), 6, "tensor_parallel_size=6 is not a multiple"),
    (dict(num_attention_heads=8, num_key_value_heads=6, intermediate_size=256), 4, "num_key_value_heads=6"),
])
def test_tensor_parallel_shapes(shape, tp_size, problem):
    """The splits the layers make (models/layers/linear.py), decided from the config alone."""
    from transformers import LlamaConfig

    from tokenmill.tensor_parallel_shapes import tensor_parallel_problem

    found = tensor_parallel_problem(tp_size, LlamaConfig(hidden_size=64 * shape["num_attention_heads"], **shape))
    assert (found is None) if problem is None else (found is not None and found.startswith(problem))


def test_mixture_of_experts_splits_each_experts_width():
    """Qwen-MoE's experts are moe_intermediate_size wide; its dense intermediate_size (unused when
    every layer has experts) decides only once a layer keeps a dense MLP."""
    from transformers import Qwen3MoeConfig

    from tokenmill.tensor_parallel_shapes import tensor_parallel_problem

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=130,
                            moe_intermediate_size=96, num_experts=4)
    assert tensor_parallel_problem(2, config) is None
    assert tensor_parallel_problem(4, Qwen3MoeConfig(**{**config.to_dict(), "moe_intermediate_size": 98})).startswith(
        "moe_intermediate_size=98")
    dense_layer = Qwen3MoeConfig(**{**config.to_dict(), "mlp_only_layers": [0]})  # layer 0 keeps a dense MLP
    assert tensor_parallel_problem(4, config) is None
    assert tensor_parallel_problem(4, dense_layer).startswith("intermediate_size=130")


def test_qwen2_moe_splits_its_shared_expert_too():
    from transformers import Qwen2MoeConfig

    from tokenmill.tensor_parallel_shapes import tensor_parallel_problem

    config = Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                            moe_intermediate_size=96, shared_expert_intermediate_size=98, num_experts=4)
    assert tensor_parallel_problem(2, config) is None
    assert tensor_parallel_problem(4, config).startswith("shared_expert_intermediate_size=98")


# ---- weight loading: each rank reads its slices only -----------------------------------------


def test_each_rank_reads_only_its_slices_of_the_checkpoint(tiny_llama_dir, monkeypatch):
    """Count the elements safetensors hands out: summed over both ranks, every split tensor is
    read exactly once (each rank strictly less than all of it); replicated norms once per rank.
    The shards equal the slices of the tensors as safetensors loads them whole."""
    import safetensors
    from safetensors.torch import load_file

    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model

    read: dict[str, int] = {}
    real_open = safetensors.safe_open

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            tensor = self.file.get_tensor(name)
            read[name] = read.get(name, 0) + tensor.numel()
            return tensor

        def get_slice(self, name):
            file_slice = self.file.get_slice(name)

            class CountingSlice:
                def get_shape(self):
                    return file_slice.get_shape()

                def get_dtype(self):  # the header's, read without the data
                    return file_slice.get_dtype()

                def __getitem__(self, index):
                    tensor = file_slice[index]
                    read[name] = read.get(name, 0) + tensor.numel()
                    return tensor

            return CountingSlice()

    monkeypatch.setattr(safetensors, "safe_open", CountingFile)
    source = resolve_model(str(tiny_llama_dir))
    models = [load_model(source, torch.float32, torch.device("cpu"), "safetensors", tp_rank=r, tp_size=2) for r in (0, 1)]
    full = load_file(tiny_llama_dir / "model.safetensors")
    per_rank = {}
    for name, tensor in full.items():
        replicated = name.endswith("norm.weight")
        assert read[name] == (2 if replicated else 1) * tensor.numel(), name
        per_rank[name] = read[name]
    assert sum(per_rank.values()) < 2 * sum(t.numel() for t in full.values())
    for rank, model in enumerate(models):
        o_proj = model.model.layers[0].self_attn.o_proj.weight
        torch.testing.assert_close(o_proj, full["model.layers.0.self_attn.o_proj.weight"][:, rank * 32 : (rank + 1) * 32])
        embed = model.model.embed_tokens.weight
        rows = full["model.embed_tokens.weight"][rank * 145 : (rank + 1) * 145]
        torch.testing.assert_close(embed[: len(rows)], rows)
        assert torch.all(embed[len(rows) :] == 0)  # rank 1's padding row
