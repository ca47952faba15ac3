"""LoRA adapters on a CUDA GPU: the engine with adapters (CUDA graphs on) against Hugging Face +
PEFT in fp32 on the same GPU, graph replays against eager steps with adapters mixed in one batch,
and one layer's update against a per-token plain-torch twin in bf16. CPU tests: tests/test_lora.py."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from support.hf_reference import assert_within, bf16_slack, hf_logprobs, teacher_forced_positions
from support.lora_adapters import save_adapter
from support.tiny_models import save_redrawn_bf16_model
from tokenmill import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("peft")

FIRST_TOKENS = 4  # bf16 greedy paths diverge eventually; the first tokens must agree


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("lora_gpu")
    config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    base = save_redrawn_bf16_model(root / "base", config)
    every = save_adapter(Path(base), root / "every", seed=1, r=16, lora_alpha=32, std=0.05)
    some = save_adapter(Path(base), root / "some", seed=2, r=8, lora_alpha=8, std=0.08,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    return base, LoRARequest("every", 1, str(every)), LoRARequest("some", 2, str(some))


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(rng.choice([1, 7, 16, 33, 150, 600]))] for _ in range(count)]


@pytest.mark.parametrize("adapter", ["every", "some", None])
def test_lora_greedy_matches_hf_peft_on_gpu(lora_model, adapter):
    """bf16 with CUDA graphs and two adapter slots, teacher-forced against HF + PEFT fp32 along our
    greedy tokens, within the slack HF + PEFT's own bf16 forward measures on the same positions."""
    base, *requests = lora_model
    request = next((r for r in requests if r.lora_name == adapter), None)
    folder = request.lora_path if request is not None else None
    llm = LLM(base, skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.3, enable_lora=True,
              max_loras=2)
    assert llm.llm_engine.executor.runner.graphs is not None
    llm.llm_engine.add_lora(requests[0])  # the other adapter holds a slot too
    prompts = _prompts(6)
    rows = teacher_forced_positions(llm, functools.partial(hf_logprobs, base, torch.float32, adapter=folder), prompts,
                                    FIRST_TOKENS, yardstick=functools.partial(hf_logprobs, base, torch.bfloat16,
                                                                              adapter=folder), lora_request=request)
    assert_within(rows, bf16_slack(noise for *_, noise in rows), clear_needed=len(prompts))


def test_lora_cuda_graphs_equal_eager_with_mixed_adapters(lora_model):
    """Decode steps replayed from graphs (each row's adapter slot a static buffer, padding rows on the
    base model) give the eager engine's tokens, with two adapters and the base model in every batch
    and max_loras=1 (the scheduler then runs the adapters in turns: slots are reloaded mid-run); fp32,
    so the two paths' batch shapes cannot flip near ties."""
    base, every, some = lora_model
    prompts = [{"prompt_token_ids": p} for p in _prompts(37, seed=3)]  # 37: a padded bucket
    adapters = [(every, some, None)[i % 3] for i in range(len(prompts))]
    for max_loras in (2, 1):
        options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3,
                       dtype="float32", enable_lora=True, max_loras=max_loras)
        graphed, eager = LLM(base, **options), LLM(base, enforce_eager=True, **options)
        for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False),
                       SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True,
                                      detokenize=False)):
            a = graphed.generate(prompts, params, use_tqdm=False, lora_request=adapters)
            b = eager.generate(prompts, params, use_tqdm=False, lora_request=adapters)
            assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        del graphed, eager


def test_lora_prompt_step_graphs_equal_eager(lora_model):
    """Steps with prompt tokens replay the piecewise graphs with the adapters' updates (each token's
    slot a static buffer, padding tokens on the base model) and without them (steps no adapter
    touches): with more requests than max_num_seqs (prompts admitted beside running decodes every
    step), chunked prompts and both adapters and the base model mixed, the tokens equal the eager
    engine's, greedy and seeded (fp32, so the padded GEMMs cannot flip near ties)."""
    base, every, some = lora_model
    rng = random.Random(8)
    prompts = [{"prompt_token_ids": p} for p in _prompts(60, seed=8)]
    options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=12, max_num_batched_tokens=400,
                   gpu_memory_utilization=0.3, dtype="float32", enable_lora=True, max_loras=2)
    graphed = LLM(base, **options)
    graphs = graphed.llm_engine.executor.runner.prompt_graphs
    assert graphs is not None and {adapters for _, adapters in graphs.graphs} == {True, False}
    replays = []
    run = graphs.run
    graphs.run = lambda ids, positions, meta, slots=None: replays.append(slots is not None) or run(ids, positions, meta, slots)
    eager = LLM(base, enforce_eager=True, **options)
    for adapters in ([(every, some, None)[i % 3] for i in range(len(prompts))], None):
        for params in (SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 5, 30]), ignore_eos=True, detokenize=False),
                       SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, detokenize=False)):
            a = graphed.generate(prompts, params, use_tqdm=False, lora_request=adapters)
            b = eager.generate(prompts, params, use_tqdm=False, lora_request=adapters)
            assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert True in replays and False in replays  # steps with adapters and steps without went through the graphs


def test_lora_engine_without_adapters_gives_the_base_engine_tokens(lora_model):
    """An engine with enable_lora serving only base-model requests replays the decode graphs captured
    without the updates (eager steps skip them too): its tokens are the plain engine's (fp32)."""
    base, *_ = lora_model
    prompts = [{"prompt_token_ids": p} for p in _prompts(37, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3,
                   dtype="float32")
    with_lora = LLM(base, enable_lora=True, max_loras=2, **options)
    graphs = with_lora.llm_engine.executor.runner.graphs
    assert {adapters for _, adapters in graphs.graphs} == {True, False}
    a = with_lora.generate(prompts, params, use_tqdm=False)
    del with_lora
    b = LLM(base, **options).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_lora_update_matches_per_token_torch(tokens):
    """One layer's update (three parts, four slots, ranks 16 and 5) in bf16 on the GPU against each
    token's own adapter applied part by part in fp32; tokens without an adapter get nothing."""
    from tokenmill.lora.layers import LoRABatch, LoRAUpdate

    gen = torch.Generator().manual_seed(tokens)
    in_features, parts, slots, max_rank = 512, [256, 64, 64], 4, 16
    batch = LoRABatch(slots, torch.device("cuda"))
    update = LoRAUpdate(batch, in_features, sum(parts), len(parts), max_rank, torch.bfloat16, torch.device("cuda"))
    weights = {}
    for slot in range(slots - 1):  # the last slot stays empty
        for part, rows in enumerate(parts):
            rank = (16, 5)[(slot + part) % 2]
            a = torch.randn(rank, in_features, generator=gen) * 0.1
            b = torch.zeros(sum(parts), rank)
            b[sum(parts[:part]) : sum(parts[: part + 1])] = torch.randn(rows, rank, generator=gen) * 0.1
            update.set_slot(slot, part, a.cuda().bfloat16(), b.cuda().bfloat16())
            weights[slot, part] = (a.bfloat16().float(), b.bfloat16().float())
    x = torch.randn(tokens, in_features, generator=gen).bfloat16()
    y = torch.randn(tokens, sum(parts), generator=gen).bfloat16()
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    batch.begin(token_slots.cuda())
    got = update(x.cuda(), y.cuda()).float().cpu()
    want = y.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        for part in range(len(parts)):
            if (slot, part) in weights:
                a, b = weights[slot, part]
                want[t] += b @ (a @ x[t].float())
    assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()


def test_lora_on_fp8_weights_agrees_with_bf16_where_the_margin_is_clear(tmp_path):
    """quantization="fp8" under an adapter: the fp8 layers quantize their own input (the norms hand an
    adapted layer the bf16 activation its update reads), teacher-forced against HF + PEFT bf16 on the
    original weights: top-1 agreement >= 97% where HF's top two are more than 1.0 apart (the dense fp8
    test's rule and margin, tests/gpu/test_quant_engine_gpu.py)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    base = save_redrawn_bf16_model(tmp_path / "base", config, seed=0, matrix_std=0.04, vector_std=0.1)
    adapter = save_adapter(Path(base), tmp_path / "adapter", seed=3, r=16, lora_alpha=16, std=0.03)
    llm = LLM(base, skip_tokenizer_init=True, max_model_len=512, gpu_memory_utilization=0.3, quantization="fp8",
              enable_lora=True)
    request = LoRARequest("adapter", 1, str(adapter))
    prompts = [[random.Random(i).randrange(1, 1024) for _ in range(20 + 30 * (i % 12))] for i in range(64)]
    rows = teacher_forced_positions(llm, functools.partial(hf_logprobs, base, torch.bfloat16, adapter=str(adapter)),
                                    prompts, 16, lora_request=request)
    clear = [agree for gap, agree, _, _ in rows if gap > 1.0]
    assert len(clear) >= 30 and sum(clear) >= 0.97 * len(clear), (len(clear), sum(clear))


def test_sleep_puts_the_adapter_slots_away_and_waking_keeps_them(lora_model):
    """The slots (every adapted layer's A and B) are the layers' buffers: sleep(level=1) frees their
    GPU memory with the weights', and after wake_up the adapters loaded before give the same tokens."""
    base, every, some = lora_model
    llm = LLM(base, skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.3, enable_lora=True,
              max_loras=2, max_lora_rank=64)
    prompts = [{"prompt_token_ids": p} for p in _prompts(8, seed=7)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    adapters = [(every, some, None)[i % 3] for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)]
    slots = [m.lora for m in llm.llm_engine.executor.runner.model.modules() if getattr(m, "lora", None) is not None]
    slot_bytes = sum(u.a.nbytes + u.b.nbytes for u in slots)
    assert slots and slot_bytes > 2**20  # 3 layers x 2 slots x rank 64: ~4.4 MB
    before = torch.cuda.memory_allocated()
    llm.sleep(level=1)
    assert all(u.a.device.type == "cpu" and u.b.device.type == "cpu" for u in slots)
    assert before - torch.cuda.memory_allocated() > slot_bytes
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                         lora_request=adapters)] == expected
