"""The engine end to end on a CUDA GPU (bf16, Triton kernels, CUDA graphs), against Hugging Face
transformers in bf16 on the same GPU, and CUDA-graph replays against eager execution."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from support.hf_reference import assert_within, bf16_slack, hf_logprobs, teacher_forced_positions
from support.tiny_models import save_redrawn_bf16_model
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # before fixtures build models

FIRST_TOKENS = 4  # bf16 greedy paths diverge eventually; the first tokens must agree


def _save(tmp_path_factory, name: str, config) -> str:
    return save_redrawn_bf16_model(tmp_path_factory.mktemp(name), config)


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from transformers import GraniteConfig, LlamaConfig, Phi3Config, Qwen3Config, SmolLM3Config

    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5)
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # these configs default to Llama 3's ids
    return {
        "qwen3": _save(tmp_path_factory, "qwen3", Qwen3Config(head_dim=128, tie_word_embeddings=True, **common)),
        "llama": _save(tmp_path_factory, "llama", LlamaConfig(head_dim=64, tie_word_embeddings=False,
                                                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                            "original_max_position_embeddings": 512},
                                                              **{**common, "num_attention_heads": 4})),
        # Phi-4-mini's rotary: LongRoPE (short factors, scaled cos/sin) on three quarters of each head,
        # q/k rows reordered at load; the qkv prologue kernel sees a full-head rotation.
        "phi3": _save(tmp_path_factory, "phi3", Phi3Config(
            tie_word_embeddings=True, original_max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_scaling={"type": "longrope", "partial_rotary_factor": 0.75,
                          "short_factor": [1.0 + 0.25 * i for i in range(12)], "long_factor": [4.0 + i for i in range(12)]},
            **{**common, "max_position_embeddings": 8192})),
        # Granite-3's scalars: the attention scale the kernels get is attention_multiplier.
        "granite": _save(tmp_path_factory, "granite", GraniteConfig(
            tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.015625, logits_scaling=8.0, **common, **special)),
        # SmolLM3: the middle layer without rotary (the qkv prologue rotates it by angle 0).
        "smollm3": _save(tmp_path_factory, "smollm3", SmolLM3Config(tie_word_embeddings=True, no_rope_layers=[1, 0, 1],
                                                                   **common, **special)),
    }


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(rng.choice([1, 7, 16, 33, 150, 600]))] for _ in range(count)]


@pytest.mark.parametrize("name", ["qwen3", "llama", "phi3", "granite", "smollm3"])
def test_greedy_matches_hf_on_gpu(gpu_models, name):
    """bf16 through the kernels and CUDA graphs, teacher-forced against HF fp32 on the same GPU
    along our own greedy tokens: each token's logprob within the bf16 slack of HF fp32's (HF's own
    bf16 forward measures the noise on the same positions, support/hf_reference.py), and HF fp32's
    argmax picked wherever its top two are further apart than that."""
    path = gpu_models[name]
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.3)
    assert llm.llm_engine.config.dtype == torch.bfloat16
    prompts = _prompts(6)
    rows = teacher_forced_positions(llm, functools.partial(hf_logprobs, path, torch.float32), prompts, FIRST_TOKENS,
                                    yardstick=functools.partial(hf_logprobs, path, torch.bfloat16))
    assert_within(rows, bf16_slack(noise for *_, noise in rows), clear_needed=len(prompts))


def test_cuda_graphs_equal_eager(gpu_models):
    # fp32: in bf16 a padded graph batch and an unpadded eager batch take different GEMM kernels,
    # and their last-bit differences flip near-tied argmaxes late in a sequence.
    path = gpu_models["qwen3"]
    prompts = [{"prompt_token_ids": p} for p in _prompts(37, seed=3)]  # 37: a padded bucket
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True, detokenize=False)
    graphed = LLM(path, skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3,
                  dtype="float32")
    assert graphed.llm_engine.executor.runner.graphs is not None
    eager = LLM(path, skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3,
                enforce_eager=True, dtype="float32")
    assert eager.llm_engine.executor.runner.graphs is None
    for sp in (params, seeded):
        a = [o.outputs[0].token_ids for o in graphed.generate(prompts, sp, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)]
        assert a == b


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_prompt_step_graphs_equal_eager(gpu_models, name):
    """Steps with prompt tokens replay the piecewise graphs (worker/piecewise_graphs.py): with more
    requests than max_num_seqs (new prompts beside running decodes every step), chunked prompts
    and prefix hits, the tokens equal the eager engine's, greedy and seeded (fp32, so the padded
    GEMMs cannot flip ties). qwen3 has q/k norms in the qkv prologue the pieces hold, llama none."""
    path = gpu_models[name]
    rng = random.Random(21)
    prompts = _prompts(70, seed=21)
    prompts += [prompts[4][:300] + [rng.randrange(1, 1024) for _ in range(5)] for _ in range(6)]  # prefix hits
    inputs = [{"prompt_token_ids": p} for p in prompts]
    options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=400,
                   gpu_memory_utilization=0.3, dtype="float32")
    graphed = LLM(path, **options)
    runner = graphed.llm_engine.executor.runner
    graphs = runner.prompt_graphs
    assert graphs is not None and graphs.max_tokens == 400  # a tiny model's graphs reach the step budget
    replays = []
    run = graphs.run
    graphs.run = lambda ids, *args: replays.append(ids.shape[0]) or run(ids, *args)
    eager = LLM(path, enforce_eager=True, **options)
    assert eager.llm_engine.executor.runner.prompt_graphs is None
    for params in ([SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 5, 40]), ignore_eos=True, detokenize=False)
                    for _ in prompts],
                   [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=rng.choice([1, 5, 40]), ignore_eos=True,
                                   detokenize=False) for i in range(len(prompts))]):
        expected = [o.outputs[0].token_ids for o in eager.generate(inputs, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in graphed.generate(inputs, params, use_tqdm=False)]
        assert got == expected
    # Prompt steps of many sizes went through the graphs, padded ones among them.
    assert len(replays) > 20 and any(n not in graphs.buckets for n in replays)


def test_two_micro_batches_equal_one_batch_on_gpu(gpu_models, monkeypatch):
    """TOKENMILL_OVERLAP (two micro-batches on two streams): decode graphs of >= 64 rows cut in
    halves and mixed steps cut between decodes and prompt chunks give the tokens of the one-batch
    engine (fp32, so the different GEMM shapes cannot flip ties), greedy and seeded."""
    path = gpu_models["llama"]
    inputs = [{"prompt_token_ids": p} for p in _prompts(90, seed=13)]
    options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=96, max_num_batched_tokens=700,
                   gpu_memory_utilization=0.3, dtype="float32")
    one = LLM(path, **options)
    monkeypatch.setenv("TOKENMILL_OVERLAP", "decode,mixed")
    two = LLM(path, **options)
    runner = two.llm_engine.executor.runner
    assert runner.overlap.decode and runner.overlap.mixed and runner.graphs.side_stream is not None
    for params in (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, detokenize=False),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True, detokenize=False)):
        expected = [o.outputs[0].token_ids for o in one.generate(inputs, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in two.generate(inputs, params, use_tqdm=False)]
        assert got == expected


def test_async_scheduling_equals_synchronous_on_gpu(gpu_models):
    """Step N+1 runs on the GPU while the host reads step N back: same tokens as reading every
    step back first (fp32, so batch-shape changes cannot flip ties), with sequences stopping
    mid-batch (their in-flight token dropped), seeded sampling, and penalties, logit bias, allowed
    ids, min_tokens and top-k / top-p / min-p, whose state stays on the GPU."""
    path = gpu_models["qwen3"]
    inputs = [{"prompt_token_ids": p} for p in _prompts(48, seed=11)]
    options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3, dtype="float32")
    sync = LLM(path, async_scheduling=False, **options)
    fast = LLM(path, async_scheduling=True, **options)
    probe = sync.generate(inputs, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False), use_tqdm=False)
    stop_ids = [probe[0].outputs[0].token_ids[3], probe[5].outputs[0].token_ids[8]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=10 + i % 17, stop_token_ids=stop_ids, detokenize=False)
              for i in range(len(inputs))]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=24, ignore_eos=True, detokenize=False)
    controls = [
        dict(temperature=0.0, repetition_penalty=1.3),
        dict(temperature=0.7, seed=3, top_p=0.9, top_k=50, repetition_penalty=1.1, n=2),
        dict(temperature=1.0, seed=4, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05),
        dict(temperature=0.0, min_tokens=12, stop_token_ids=stop_ids[:1], presence_penalty=0.8),
        dict(temperature=0.9, seed=5, logit_bias={stop_ids[0]: 3.0, 7: -100.0}, top_p=0.95),
        dict(temperature=0.0, allowed_token_ids=sorted(set(probe[3].outputs[0].token_ids))[:8], repetition_penalty=1.5),
    ]
    controlled = [SamplingParams(max_tokens=24, ignore_eos=True, detokenize=False, **controls[i % len(controls)])
                  for i in range(len(inputs))]
    for params in (greedy, seeded, controlled):
        before = fast.llm_engine.stats.num_overlapped_steps
        expected = [[c.token_ids for c in o.outputs] for o in sync.generate(inputs, params, use_tqdm=False)]
        got = [[c.token_ids for c in o.outputs] for o in fast.generate(inputs, params, use_tqdm=False)]
        assert got == expected
        assert fast.llm_engine.stats.num_overlapped_steps - before > 15


def test_launching_a_step_never_waits_for_the_gpu(gpu_models, monkeypatch):
    """Asynchronous scheduling is only asynchronous while launching a step never syncs with the
    device: one sync there (a CPU scalar copied in, an ``.item()``, a boolean mask) makes the host
    wait for the step before every launch, which no output shows. So every launch runs under CUDA's
    sync check, with the per-sequence sampling features all at once: penalties, logit bias, allowed
    ids, min_tokens, top-k / top-p / min-p, seeds, n > 1, logprobs, prompt logprobs, listed ids'
    logprobs, a shared prefix, and a pool small enough to preempt."""
    from tokenmill.worker.model_runner import ModelRunner

    def checked(launch):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    path = gpu_models["qwen3"]
    base = LLM(path, skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.3)
    per_block = base.llm_engine.executor.runner.kv_bytes_per_block()
    del base
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=256,
              kv_cache_memory_bytes=120 * per_block)
    shared = list(range(100, 148))  # three whole blocks every third prompt starts with: prefix-cache hits
    inputs = [{"prompt_token_ids": (shared + p if i % 3 == 0 else p)[:700]} for i, p in enumerate(_prompts(40, seed=21))]
    controls = [
        dict(temperature=0.7, seed=3, top_p=0.9, top_k=50, repetition_penalty=1.1, n=2, logprobs=3),
        dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05, prompt_logprobs=2),
        dict(temperature=0.0, min_tokens=12, stop_token_ids=[9], logprob_token_ids=[3, 17, 400]),
        dict(temperature=0.9, logit_bias={11: 3.0, 7: -100.0}, top_p=0.95, logprobs=1),
        dict(temperature=0.0, allowed_token_ids=list(range(20, 60)), repetition_penalty=1.5),
        dict(temperature=0.8),
    ]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False, **controls[i % len(controls)])
              for i in range(len(inputs))]
    monkeypatch.setattr(ModelRunner, "execute", checked(ModelRunner.execute))
    monkeypatch.setattr(ModelRunner, "_draw", checked(ModelRunner._draw))  # a draw that waits for its grammar masks
    before = llm.llm_engine.stats.num_overlapped_steps
    outputs = llm.generate(inputs, params, use_tqdm=False)
    for output, p in zip(outputs, params):
        assert all(len(c.token_ids) == 40 or p.stop_token_ids for c in output.outputs) and output.outputs[0].token_ids
    assert llm.llm_engine.stats.num_overlapped_steps - before > 30
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prefix_hits_chunked_prefill_and_preemption_on_gpu(gpu_models):
    path = gpu_models["llama"]
    prompts = _prompts(12, seed=9)
    shared = prompts[4]
    prompts += [shared[: len(shared) // 2] + p[:5] for p in prompts[:4]]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    base = LLM(path, skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.3, enable_prefix_caching=False,
               dtype="float32")
    expected = [o.outputs[0].token_ids for o in base.generate(inputs, params, use_tqdm=False)]
    per_block = base.llm_engine.executor.runner.kv_bytes_per_block()
    stressed = LLM(path, skip_tokenizer_init=True, max_model_len=1024, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=70 * per_block, dtype="float32")
    got = [o.outputs[0].token_ids for o in stressed.generate(inputs, params, use_tqdm=False)]
    assert stressed.llm_engine.scheduler.num_preemptions > 0
    assert got == expected  # fp32, so batch shape changes cannot flip ties


def test_dummy_qwen3_shape_fits_at_default_utilisation(tmp_path):
    import json

    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  hidden_act="silu", torch_dtype="bfloat16", eos_token_id=151645)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    free, total = torch.cuda.mem_get_info()
    assert llm.llm_engine.kv.num_usable_blocks * 16 > 256 * 2048  # every P1 sequence at its longest, at once
    out = llm.generate([{"prompt_token_ids": list(range(1, 900))}] * 256,
                       SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert total - free <= 0.92 * total


@functools.lru_cache(maxsize=1)
def _hf_fp32_fp8_kv_model(path: str):
    """HF in fp32 whose attention reads keys and values rounded to float8 e4m3, as from an fp8 cache."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):
        key, value = (t.to(torch.float8_e4m3fn).to(t.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("tokenmill_test_fp8_kv", fp8_kv_attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="tokenmill_test_fp8_kv").cuda().eval()


def test_fp8_kv_cache_matches_hf_with_fp8_keys_and_values_on_gpu(gpu_models):
    """kv_cache_dtype="fp8" through the Triton kernels (fused prologue store, attention reading
    fp8, CUDA graphs), fp32 model, teacher-forced against HF with fp8-rounded keys and values."""
    path = gpu_models["qwen3"]
    # A fixed pool: earlier tests' engines may still hold memory that a utilisation budget counts.
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=1024, kv_cache_memory_bytes=2**28, dtype="float32",
              kv_cache_dtype="fp8")
    assert llm.llm_engine.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    reference = _hf_fp32_fp8_kv_model(path)
    prompts = _prompts(6, seed=21)

    @torch.no_grad()
    def reference_logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(reference(torch.tensor([ids], device="cuda")).logits[0, -1].float(), dim=-1)

    # fp32 everywhere else: the only slack is an fp8 rounding flipped by a last-bit difference.
    rows = teacher_forced_positions(llm, reference_logprobs, prompts, FIRST_TOKENS)
    assert_within(rows, 0.02, clear_needed=len(prompts))


@pytest.mark.parametrize("overlap", ["", "decode,mixed"], ids=["one-batch", "micro-batches"])
@pytest.mark.parametrize("enforce_eager, deterministic, kv_cache_dtype",
                         [(False, False, "auto"), (True, False, "auto"), (False, True, "auto"), (False, False, "fp8")])
def test_no_kernel_is_compiled_during_a_run(tmp_path, enforce_eager, deterministic, kv_cache_dtype, overlap, monkeypatch):
    """``LLM()`` compiles every Triton kernel variant a step can launch, and runs the logits GEMM at
    every row count a step can sample: a run of mixed steps
    (chunked prefill, prefix hits, decode at every batch size, greedy, sampled, filtered and
    penalised rows) compiles nothing. The model's shape (6 q heads on 2 kv heads of 32, hidden 192) is used by no
    other test, so no earlier test in this process can have compiled its variants. Qwen3's vocabulary
    size: the sampling kernels split long rows into chunks and send broad top-p rows (random weights
    give broad ones) to the wide-row kernels, variants a 3,000-token vocabulary never reached (the first
    P4 run of a fresh machine at 566e93c ran 28% below the same run on a machine whose sampler tests
    had compiled them first)."""
    import json

    import triton

    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=192, intermediate_size=384,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=151936,
                  tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  hidden_act="silu", torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("TOKENMILL_OVERLAP", overlap)  # micro-batches: B's fresh metadata, halves' split counts
    # The logits GEMM runs eagerly at each step's number of sampling rows, and cuBLAS's first GEMM of a
    # shape blocks (docs/perf.md 99), so LLM() runs it at every count a step can have.
    from tokenmill.models.llama import LlamaForCausalLM

    logits_rows: list[int] = []
    compute_logits = LlamaForCausalLM.compute_logits

    def counted(self, hidden: torch.Tensor) -> torch.Tensor:
        logits_rows.append(hidden.shape[0])
        return compute_logits(self, hidden)

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", counted)
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=40,
              max_num_batched_tokens=512, gpu_memory_utilization=0.3, enforce_eager=enforce_eager, seed=1,
              deterministic=deterministic, kv_cache_dtype=kv_cache_dtype)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 3000) for _ in range(rng.choice([1, 2, 5, 9, 17, 100, 700, 1500]))] for _ in range(60)]
    prompts += [prompts[6][:600] + p[:3] for p in prompts[:5]]  # prefix hits
    # Every variant of the sampling kernels: with and without filters (top-p, top-k, min-p) and
    # per-sequence state (penalties, a logit bias), bans in place (min_tokens).
    params = [SamplingParams(temperature=[0.0, 0.8, 1.0][i % 3], top_p=0.9 if i % 7 == 0 else 1.0, seed=i,
                             top_k=40 if i % 5 == 1 else 0, min_p=0.05 if i % 9 == 4 else 0.0,
                             repetition_penalty=1.1 if i % 4 == 2 else 1.0, logit_bias={5: 2.0} if i % 11 == 3 else None,
                             min_tokens=2 if i % 13 == 6 else 0,
                             max_tokens=rng.choice([3, 30, 200, 500]) if i % 13 == 6 else rng.choice([1, 3, 30, 200, 500]),
                             ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]
    warmed_rows, logits_rows[:] = set(logits_rows), []
    compiled: list[str] = []
    loaded: list[str] = []

    def record(*, repr: str, **_: object) -> None:
        compiled.append(repr)

    def record_load(module: object, function: object, name: str, *_: object) -> None:
        loaded.append(name)

    # A kernel's first launch also builds its launcher (a C compiler run on a cold Triton cache)
    # and loads its binary: ``parallel_compile`` does that too, so nothing is loaded mid-run.
    triton.knobs.runtime.jit_cache_hook = record
    triton.knobs.runtime.kernel_load_start_hook.add(record_load)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
        triton.knobs.runtime.kernel_load_start_hook.remove(record_load)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert compiled == [], "compiled during the run:\n" + "\n".join(compiled)
    assert loaded == [], "first launched (launcher built, binary loaded) during the run:\n" + "\n".join(loaded)
    assert set(logits_rows) <= warmed_rows, f"logits first computed during the run at {set(logits_rows) - warmed_rows} rows"
