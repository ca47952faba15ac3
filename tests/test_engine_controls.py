"""The engine controls on the CPU: sleep / wake_up, the torch.profiler trace, weight transfer (same
process and over a gloo group, checked against Hugging Face's greedy tokens of the other model),
layer offloading (against Hugging Face's logits), and the same controls reaching both ranks under
tensor parallelism. get_metrics: tests/test_metrics.py."""

from __future__ import annotations

import functools
import gzip
import json
import threading

import pytest
import torch

from reference import hf_greedy, hf_model, hf_next_logprobs
from tokenmill import LLM, SamplingParams

pytest.importorskip("prometheus_client")

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=8, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 70, 91, 13, 8], [200, 4], list(range(3, 40)))]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@functools.lru_cache(maxsize=4)
def _hf_tokens(path: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_greedy(hf_model(path), p["prompt_token_ids"], GREEDY.max_tokens)[0]) for p in PROMPTS)


def hf_tokens(path) -> list[list[int]]:
    """Hugging Face's greedy tokens for PROMPTS (computed once per model)."""
    return [list(tokens) for tokens in _hf_tokens(str(path))]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), disable_log_stats=False, **OPTIONS)


# ---- start-up ------------------------------------------------------------------------------------------
def test_llm_start_ends_with_a_full_garbage_collection(tiny_llama_dir):
    """The objects start-up leaves are walked once inside LLM(), not by a full collection that would
    stop the host early in the first long call (llm.py, docs/perf.md 49): the last collection LLM()
    runs is a full one, and no younger collection has been counted toward the next full one since."""
    import gc

    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "stop":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        LLM(str(tiny_llama_dir), **OPTIONS)
        after = gc.get_count()
    finally:
        gc.callbacks.remove(record)
    assert generations and generations[-1] == 2, generations[-5:]
    assert after[2] == 0, after


# ---- sleep / wake_up --------------------------------------------------------------------------------
def test_sleep_level_1_frees_the_kv_cache_and_waking_gives_the_same_outputs(llm, tiny_llama_dir):
    expected = hf_tokens(tiny_llama_dir)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    runner = llm.llm_engine.executor.runner
    weights = [p.data_ptr() for p in runner.model.parameters()]
    llm.sleep(level=1)
    assert llm.llm_engine.is_sleeping() and runner.kv_caches == []
    assert [p.data_ptr() for p in runner.model.parameters()] == weights  # CPU weights stay where they are
    with pytest.raises(RuntimeError, match="asleep.*wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])
    assert llm.llm_engine.is_sleeping()  # the KV cache is still away
    llm.wake_up(tags=["kv_cache"])
    assert not llm.llm_engine.is_sleeping()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    state = {m.labels["sleep_state"]: m.value for m in llm.get_metrics() if m.name == "vllm:engine_sleep_state"}
    assert state == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


def test_reset_prefix_cache_refuses_flags_that_are_not_bools(llm):
    with pytest.raises(ValueError, match=r"reset_prefix_cache\(reset_running_requests='yes'\).*True or False"):
        llm.reset_prefix_cache(reset_running_requests="yes")
    with pytest.raises(ValueError, match=r"reset_connector=1\b"):
        llm.reset_prefix_cache(reset_connector=1)
    assert llm.reset_prefix_cache() is True


def test_sleep_forgets_the_prefix_cache(llm):
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep(level=1)
    llm.wake_up()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0  # the cache's contents are gone


def test_sleep_shrinks_the_sampling_state_tables_back_to_one_row(llm):
    """The per-sequence penalty and logit-bias tables grow to the busiest batch ([slots, vocab]:
    hundreds of MB on a GPU with a large vocabulary); sleep, with every sequence gone, lets them go."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3, logit_bias={7: 2.0})
    before = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    runner = llm.llm_engine.executor.runner
    tables = lambda: [runner.penalties.counts, runner.penalties.prompt_bits, runner.logit_bias.bias]  # noqa: E731
    assert all(t.shape[0] > len(PROMPTS) - 1 for t in tables())
    llm.sleep(level=1)
    assert [t.shape[0] for t in tables()] == [1, 1, 1]
    llm.wake_up()
    assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == before


def test_sleep_level_2_discards_the_weights_until_reloaded_or_updated(llm, tiny_llama_dir):
    from safetensors.torch import load_file

    expected = hf_tokens(tiny_llama_dir)
    model = llm.llm_engine.executor.runner.model
    llm.sleep(level=2)
    assert all(p.numel() == 0 for p in model.parameters())
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    llm.sleep(level=2)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    with pytest.raises(RuntimeError, match="wake_up\\(tags=\\['weights'\\]\\) first"):
        llm.update_weights({"update_info": {"names": list(tensors), "tensors": list(tensors.values())}})
    llm.wake_up()
    llm.update_weights({"update_info": {"names": list(tensors), "tensors": list(tensors.values())}})
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_sleep_waits_for_enqueued_requests_or_aborts_them(llm):
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.enqueue(PROMPTS, GREEDY)
    llm.sleep(level=1, mode="wait")
    llm.wake_up()
    assert token_ids(llm.wait_for_completion(use_tqdm=False)) == expected
    llm.enqueue(PROMPTS, GREEDY)
    llm.sleep(level=1)  # mode="abort"
    llm.wake_up()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.wait_for_completion(use_tqdm=False) == []  # aborted requests have no outputs (vLLM: left out)
    with pytest.raises(ValueError, match="sleep\\(level=3\\) is invalid"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="mode='keep'.*not supported"):
        llm.sleep(level=1, mode="keep")
    with pytest.raises(ValueError, match="unknown tags \\['weight'\\]"):
        llm.wake_up(tags=["weight"])
    with pytest.raises(ValueError, match="sleep\\(level=True\\) is invalid"):
        llm.sleep(level=True)
    with pytest.raises(ValueError, match=r"wake_up\(tags=5\) is invalid: must be None \(everything\) or a list of"):
        llm.wake_up(tags=5)
    llm.sleep(level=1)
    llm.wake_up(tags="weights")  # one tag as a string: vLLM's allocator reads it so too
    assert llm.llm_engine.asleep == {"kv_cache"}
    llm.wake_up()
    llm.sleep(level=1)
    llm.wake_up(tags=["weights", "scheduling"])  # vLLM's third tag: scheduling is never paused here
    llm.wake_up(tags=["kv_cache"])
    assert not llm.llm_engine.is_sleeping()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


# ---- profiling --------------------------------------------------------------------------------------
def test_start_and_stop_profile_write_a_chrome_trace(tiny_llama_dir, tmp_path, monkeypatch, llm):
    with pytest.raises(ValueError, match="profiler_config=.*VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "from_env"))
    profiled = LLM(str(tiny_llama_dir), **OPTIONS)
    profiled.start_profile(profile_prefix="run1")
    profiled.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    profiled.stop_profile()
    traces = list((tmp_path / "from_env").glob("run1_tp0.*.pt.trace.json.gz"))
    assert len(traces) == 1
    trace = json.loads(gzip.decompress(traces[0].read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert any(str(n).startswith("aten::") for n in names)

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    folder = tmp_path / "from_config"
    configured = LLM(str(tiny_llama_dir), profiler_config={"profiler": "torch", "torch_profiler_dir": str(folder),
                                                            "torch_profiler_use_gzip": False}, **OPTIONS)
    configured.start_profile()
    configured.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    configured.stop_profile()
    assert len(list(folder.glob("tokenmill_tp0.*.pt.trace.json"))) == 1
    with pytest.raises(RuntimeError, match="without start_profile"):
        configured.stop_profile()


# ---- weight transfer --------------------------------------------------------------------------------
def _llama_like(root, tiny_llama_dir, name: str, seed: int, **fields):
    """The tiny Llama's config (rope scaling included), with ``fields`` changed and weights drawn from ``seed``."""
    from transformers import AutoConfig

    from support.tiny_models import save_tiny_model

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    for key, value in fields.items():
        setattr(config, key, value)
    return save_tiny_model(root, name, config, seed=seed)


@pytest.fixture(scope="module")
def other_llama_dir(tiny_models_root, tiny_llama_dir):
    """The tiny Llama with other weights: the 'trained' model."""
    return _llama_like(tiny_models_root, tiny_llama_dir, "llama_other", seed=11)


def _checkpoint(path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).items())


def test_update_weights_from_this_process_gives_the_other_models_tokens(tiny_llama_dir, other_llama_dir):
    from tokenmill.weight_transfer import WeightTransferUpdateRequest

    engine = LLM(str(tiny_llama_dir), **OPTIONS)
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_tokens(tiny_llama_dir)
    target = hf_tokens(other_llama_dir)
    assert target != hf_tokens(tiny_llama_dir)
    cached = engine.generate(PROMPTS[2:], GREEDY, use_tqdm=False)  # leaves its blocks in the prefix cache
    assert engine.get_weight_version() == 0
    pairs = _checkpoint(other_llama_dir)
    engine.start_weight_update()
    half = len(pairs) // 2  # two chunks, as a trainer sends them
    engine.update_weights({"update_info": {"names": [n for n, _ in pairs[:half]], "tensors": [t for _, t in pairs[:half]]}})
    engine.update_weights(WeightTransferUpdateRequest({"names": [n for n, _ in pairs[half:]], "tensors": [t for _, t in pairs[half:]]}))
    engine.finish_weight_update()
    assert engine.get_weight_version() == 2
    outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == target
    assert outputs[2].num_cached_tokens == 0 and cached  # the old weights' blocks were forgotten
    engine.update_weight_version(40)
    assert engine.get_weight_version() == 40
    # An unknown name (here the engine's fused qkv_proj) is refused before any tensor is replaced.
    first = _checkpoint(tiny_llama_dir)[0]
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(ValueError, match=r"has no tensors \(2\) model.layers.0.self_attn.qkv_proj.weight, model.no_such.weight.*nothing"):
        engine.update_weights({"update_info": {"names": [first[0], "model.no_such.weight", fused],
                                               "tensors": [first[1], torch.zeros(1), torch.zeros(1)]}})
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == target
    # A tensor that is not floating point is refused by name before any is replaced (it was cast in).
    lm_head = dict(_checkpoint(tiny_llama_dir))["lm_head.weight"]
    with pytest.raises(ValueError, match=r"'lm_head.weight' has dtype torch.int64: must be a floating-point dtype.*nothing"):
        engine.update_weights({"update_info": {"names": [first[0], "lm_head.weight"], "tensors": [first[1], lm_head.long()]}})
    assert engine.get_weight_version() == 40
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == target
    # A wrong shape too (tests/test_weight_transfer.py: every kind of refusal, every family, over the group).
    with pytest.raises(ValueError, match=r"shape mismatch: checkpoint tensor has shape \(1,\).*nothing was replaced"):
        engine.update_weights({"update_info": {"names": [first[0], "lm_head.weight"], "tensors": [first[1], torch.zeros(1)]}})
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == target
    with pytest.raises(ValueError, match="call init_weight_transfer_engine first"):
        engine.update_weights({"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[1]]}})
    # Back to the checkpoint through collective_rpc: the blocks cached under the other weights must go too.
    engine.generate(PROMPTS[2:], GREEDY, use_tqdm=False)
    assert engine.generate(PROMPTS[2:], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    engine.collective_rpc("reload_weights")
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_tokens(tiny_llama_dir)
    for method in ("sleep", "wake_up"):  # the engine keeps the books on sleep: only its own methods may
        with pytest.raises(ValueError, match=rf"collective_rpc\(method='{method}'\).*call LLM.{method}\(\)"):
            engine.collective_rpc(method, args=(1,))
    # The engine's own step and start-up methods would leave its block tables wrong (a KV cache of 3 blocks).
    with pytest.raises(ValueError, match=r"collective_rpc\(method='initialize_cache'\).*the engine calls it itself"):
        engine.collective_rpc("initialize_cache", args=(3,))
    with pytest.raises(ValueError, match=r"args=5 is invalid: must be a tuple"):
        engine.collective_rpc("reload_weights", args=5)
    with pytest.raises(ValueError, match=r"kwargs=\[1\] is invalid: must be a dict"):
        engine.collective_rpc(lambda worker: 1, kwargs=[1])
    for timeout in ("x", 0, -1.5, True):  # one rank never waits: a bad timeout would pass unseen until TP > 1
        with pytest.raises(ValueError, match=rf"timeout={timeout!r} is invalid: must be None or a number of seconds > 0"):
            engine.collective_rpc(lambda worker: 1, timeout=timeout)
    assert engine.collective_rpc(lambda worker: 1, timeout=2.5) == [1]
    with pytest.raises(ValueError, match=r"apply_model\(func=5\) is invalid: must be a function"):
        engine.apply_model(5)
    with pytest.raises(ZeroDivisionError):  # a function that raises: the caller sees its error, the engine runs on
        engine.apply_model(lambda model: 1 / 0)
    with pytest.raises(ValueError, match=r"update_weight_version\(version='3'\) is invalid: must be an int"):
        engine.update_weight_version("3")
    with pytest.raises(ValueError, match=r"init_info\['master_port'\]='x' is invalid: must be an int"):
        engine.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": "x",
                                                          "rank_offset": 1, "world_size": 2}})
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_tokens(tiny_llama_dir)


def test_update_weights_over_a_torch_distributed_group(tiny_llama_dir, other_llama_dir):
    from tokenmill.weight_transfer import WeightSender

    engine = LLM(str(tiny_llama_dir), **OPTIONS)
    sender = WeightSender("127.0.0.1", 0, world_size=1 + engine.get_world_size())
    _alongside(lambda: engine.init_weight_transfer_engine({"init_info": sender.init_info()}), sender.connect)
    pairs = [(name, tensor.to(torch.bfloat16)) for name, tensor in _checkpoint(other_llama_dir)]  # a bf16 trainer
    info = WeightSender.update_info(pairs)
    assert info["dtype_names"][0] == "bfloat16"
    _alongside(lambda: engine.update_weights({"update_info": info}), lambda: sender.send(pairs))
    assert engine.get_weight_version() == 1
    rounded = [(n, t.float()) for n, t in pairs]
    reference = _llama_with(other_llama_dir, rounded)
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == [
        hf_greedy(reference, p["prompt_token_ids"], GREEDY.max_tokens)[0] for p in PROMPTS]


def _alongside(engine_side, trainer_side) -> None:
    """Run the engine's blocking call in a thread while this thread plays the trainer."""
    failures = []

    def run():
        try:
            engine_side()
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    trainer_side()
    thread.join(timeout=60)
    if failures:
        raise failures[0]


def _llama_with(path, pairs):
    """Hugging Face's model of ``path`` with these tensors (the bf16-rounded weights the trainer sent)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.load_state_dict(dict(pairs), strict=False)
    return model


# ---- layer offloading (cpu_offload_gb's mechanism, run on the CPU) ----------------------------------
def test_offloaded_layers_stream_through_the_staging_buffers(tiny_models_root, tiny_llama_dir, paged_cache):
    """Four layers, all offloaded, share two staging buffers: each forward must copy every layer
    in before it runs, so logits match Hugging Face even with the buffers poisoned between forwards."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.worker.offload import LayerOffloader

    path = _llama_like(tiny_models_root, tiny_llama_dir, "llama_4layers", seed=5, num_hidden_layers=4)
    offloader = LayerOffloader(2**40, torch.device("cpu"))
    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), place=offloader.place)
    assert len(offloader.layers) == 4 and len(offloader._buffers) == 2
    layer_params = [p for layer in offloader.layers for p in layer.parameters()]
    reference = hf_model(str(path))
    cache = paged_cache(model)
    ids = [5, 9, 30, 200, 7, 8, 41]
    with torch.inference_mode():
        for chunk_start, chunk_end in ((0, 4), (4, 7)):
            for buffer in offloader._buffers:
                buffer.fill_(0xFF)  # NaNs in every staging buffer
            logits = cache.step([(0, ids[chunk_start:chunk_end])])[0]
            expected = torch.stack([hf_next_logprobs(reference, ids[: i + 1]) for i in range(chunk_start, chunk_end)])
            assert torch.allclose(torch.log_softmax(logits.float(), -1), expected, atol=1e-4)
            # Between forwards the parameters are their own CPU tensors again, not buffer views.
            assert all(p.untyped_storage().data_ptr() not in {b.data_ptr() for b in offloader._buffers} for p in layer_params)


def test_choose_layers_spreads_them_and_covers_the_budget():
    from tokenmill.worker.offload import choose_layers

    assert choose_layers([10] * 8, 40) == [1, 3, 5, 7]
    assert choose_layers([10] * 8, 41) == [1, 2, 4, 5, 7] or len(choose_layers([10] * 8, 41)) == 5
    assert choose_layers([10] * 4, 1) == [3]
    assert choose_layers([10] * 4, 10**9) == [0, 1, 2, 3]
    assert choose_layers([10] * 4, 0) == []


# ---- tensor parallelism: the controls reach both ranks ---------------------------------------------
@pytest.mark.slow
def test_sleep_and_update_weights_reach_every_rank(tiny_llama_dir, other_llama_dir):
    engine = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    expected = hf_tokens(tiny_llama_dir)
    engine.sleep(level=2)
    assert engine.collective_rpc(lambda w: sum(p.numel() for p in w.model.parameters())) == [0, 0]
    engine.wake_up()
    engine.collective_rpc("reload_weights")
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    pairs = _checkpoint(other_llama_dir)
    engine.update_weights({"update_info": {"names": [n for n, _ in pairs], "tensors": [t for _, t in pairs]}})
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_tokens(other_llama_dir)
