"""The engine controls on a CUDA GPU: what sleep frees (torch.cuda.memory_allocated and
mem_get_info), that waking (and reloading or updating the weights) gives the same greedy tokens,
cpu_offload_gb with half of the decoder layers streamed from pinned CPU memory, and the CUDA
kernels in a profiler trace. Two-GPU tests (NCCL weight transfer) skip on one GPU."""

from __future__ import annotations

import gc
import gzip
import json
import threading

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 2**20
KV_BYTES = 1024 * MiB
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)


def _save(folder, seed: int, layers: int = 8) -> str:
    from transformers import LlamaConfig

    from support.tiny_models import save_redrawn_bf16_model

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    return save_redrawn_bf16_model(folder, config, seed=seed, matrix_std=0.05, vector_std=0.2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("controls")
    return {"a": _save(root / "a", seed=0), "b": _save(root / "b", seed=1)}


def _prompts(count: int = 12) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(1, 32000, (int(n),), generator=gen).tolist()}
            for n in torch.randint(4, 300, (count,), generator=gen)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _baseline() -> int:
    """What this process holds before an engine starts, with cuBLAS's per-stream workspaces already
    made (torch allocates them on the first GEMMs and keeps them: not the engine's).

    Engines of earlier tests are collected first: a dropped LLM frees its KV cache at once, but its
    weights sit in reference cycles (each parameter's ``weight_loader`` is a method of its module)
    until the cyclic GC runs, which it may do in the middle of the next engine's start-up."""
    gc.collect()
    torch.cuda.empty_cache()
    x = torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")
    torch.nn.functional.linear(x, x, x[0])
    torch.nn.functional.linear(x, x)
    del x
    return _allocated()


def _engine_bytes(llm: LLM) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) that the engine put on the GPU."""
    from tokenmill.worker.sleep import model_tensors

    runner = llm.llm_engine.executor.runner
    weights = sum(t.numel() * t.element_size() for t, _ in model_tensors(runner.model) if t.is_cuda)
    return weights, sum(t.numel() * t.element_size() for t in runner.kv_caches)


def _make(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, max_model_len=1024, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=64, **kwargs)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_engines_gpu_memory_and_waking_gives_the_same_tokens(models, level):
    baseline = _baseline()
    llm = _make(models["a"])
    expected = _tokens(llm)
    awake = _allocated() - baseline
    weight_bytes, kv_bytes = _engine_bytes(llm)
    # The pool is capped at what max_num_seqs full-length sequences need (worker/sizing.py):
    # 64 x 1024 / 16 blocks + the null block, ~537 MB of the 1 GiB allowed; on a GPU it is
    # allocated whole at start-up (only the CPU's pool grows with the work).
    per_block = 8 * 2 * 16 * 4 * 64 * 2  # layers x (K, V) x block size x KV heads x head_dim x bf16
    assert kv_bytes == min(KV_BYTES // per_block, 64 * 1024 // 16 + 1) * per_block
    assert awake >= weight_bytes + kv_bytes  # and the graphs' pools
    free_awake = torch.cuda.mem_get_info()[0]
    llm.sleep(level=level)
    asleep = _allocated() - baseline
    assert asleep < 16 * MiB, f"sleep(level={level}) left {asleep / MiB:.1f} MiB of the engine's {awake / MiB:.0f} MiB"
    assert torch.cuda.mem_get_info()[0] - free_awake > 0.9 * awake  # given back to the device, not only to the cache
    if level == 1:
        llm.wake_up()
    else:
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
    assert llm.llm_engine.executor.runner.graphs is not None  # decode graphs captured again
    assert _tokens(llm) == expected


def test_update_weights_on_the_gpu_gives_the_other_models_tokens(models):
    from safetensors.torch import load_file

    expected = _tokens(_make(models["b"]))
    llm = _make(models["a"])
    assert _tokens(llm) != expected
    tensors = {name: t.cuda() for name, t in load_file(f"{models['b']}/model.safetensors").items()}
    llm.update_weights({"update_info": {"names": list(tensors), "tensors": list(tensors.values())}})
    assert _tokens(llm) == expected


def test_cpu_offload_of_half_the_layers_gives_the_same_tokens_with_less_gpu_memory(models):
    baseline = _baseline()
    full = _make(models["a"], enforce_eager=True)
    expected = _tokens(full)
    full_bytes = _allocated() - baseline
    layer_bytes = sum(p.numel() * p.element_size() for p in full.llm_engine.executor.runner.model.model.layers[0].parameters())
    del full
    gc.collect()
    torch.cuda.empty_cache()
    baseline = _baseline()
    half = 4 * layer_bytes  # 4 of the 8 decoder layers
    offloaded = _make(models["a"], enforce_eager=True, cpu_offload_gb=half / 2**30)
    offloader = offloaded.llm_engine.executor.driver.offloader
    assert len(offloader.layers) == 4 and offloader.offloaded_bytes == half
    assert all(p.is_pinned() for layer in offloader.layers for p in layer.parameters())
    used = _allocated() - baseline
    # The offloaded layers are gone from the GPU; two one-layer staging buffers come instead.
    assert used <= full_bytes - half + 2 * layer_bytes + 8 * MiB
    assert _tokens(offloaded) == expected
    offloaded.sleep(level=1)
    assert _allocated() - baseline < 16 * MiB
    offloaded.wake_up()
    assert _tokens(offloaded) == expected


def test_a_profile_trace_holds_cuda_kernels(models, tmp_path):
    llm = _make(models["a"], profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    llm.start_profile(profile_prefix="gpu")
    _tokens(llm)
    llm.stop_profile()
    (trace_file,) = tmp_path.glob("gpu_tp0.*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the trainer on the second)")
def test_update_weights_over_nccl_from_a_trainer_on_another_gpu(models):
    from safetensors.torch import load_file

    from tokenmill.weight_transfer import WeightSender

    expected = _tokens(_make(models["b"]))
    llm = _make(models["a"])
    sender = WeightSender("127.0.0.1", 0, world_size=2, device="cuda:1")
    engine_side = threading.Thread(target=llm.init_weight_transfer_engine, args=({"init_info": sender.init_info()},))
    engine_side.start()
    sender.connect()
    engine_side.join()
    pairs = [(name, t.to("cuda:1")) for name, t in load_file(f"{models['b']}/model.safetensors").items()]
    engine_side = threading.Thread(target=llm.update_weights, args=({"update_info": WeightSender.update_info(pairs)},))
    engine_side.start()
    sender.send(pairs)
    engine_side.join()
    assert _tokens(llm) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sleep_and_update_reach_both_ranks_under_tensor_parallelism(models):
    from safetensors.torch import load_file

    expected_b = _tokens(_make(models["b"], tensor_parallel_size=2))
    llm = _make(models["a"], tensor_parallel_size=2)
    expected_a = _tokens(llm)
    llm.sleep(level=1)
    assert all(used < 64 * MiB for used in llm.collective_rpc(lambda w: torch.cuda.memory_allocated(w.device)))
    llm.wake_up()
    assert _tokens(llm) == expected_a
    tensors = load_file(f"{models['b']}/model.safetensors")
    llm.update_weights({"update_info": {"names": list(tensors), "tensors": list(tensors.values())}})
    assert _tokens(llm) == expected_b
