"""Deterministic mode on the CPU torch path: every request's token ids and logprobs bit for bit the
same alone, in mixed batches of several sizes, with prefix-cache hits and with chunked prefill.

The references are the same engine's outputs for each request run alone: the property under test
is invariance, which no outside library defines. Default mode is run on the same workload to show
that the workload does move the bits (otherwise the deterministic checks could not fail).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, SamplingParams

MODEL_OPTIONS = dict(dtype="bfloat16", device="cpu", max_model_len=192, kv_cache_memory_bytes=32 * 2**20, seed=0)


def signature(output) -> list[tuple]:
    """Token ids, every logprob (chosen and top) and the prompt logprobs of each sample, as exact floats."""
    samples = []
    for c in output.outputs:
        steps = tuple(tuple(sorted((t, lp.logprob, lp.rank) for t, lp in step.items())) for step in c.logprobs or ())
        samples.append((tuple(c.token_ids), c.cumulative_logprob, steps))
    prompt = tuple(None if d is None else tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in output.prompt_logprobs or ())
    return [tuple(samples), prompt]


def probe_requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampled requests (n=2 too), logprobs of the sampled and top tokens."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (6, 29, 44)]
    shared = prompts[1][:20] + [rng.randrange(3, vocab) for _ in range(9)]  # shares 16+ tokens with prompts[1]
    return [
        (prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)),
        (prompts[1], SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)),
        (prompts[2], SamplingParams(temperature=0.7, top_k=20, seed=6, n=2, max_tokens=6, ignore_eos=True, logprobs=1)),
        (shared, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)),
    ]


def run_mixed(llm: LLM, probes, size: int, trial: int) -> tuple[list, list]:
    """The probes shuffled among ``size`` unseeded filler requests of other lengths; their outputs in probe order."""
    rng = random.Random(trial)
    vocab = llm.llm_engine.config.vocab_size
    fillers = [([rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))],
                SamplingParams(temperature=0.8, max_tokens=rng.randint(2, 10), ignore_eos=True)) for _ in range(size)]
    items = list(enumerate(probes)) + [(None, f) for f in fillers]
    rng.shuffle(items)
    outputs = llm.generate([{"prompt_token_ids": p} for _, (p, _) in items], [sp for _, (_, sp) in items], use_tqdm=False)
    by_probe = {i: out for (i, _), out in zip(items, outputs) if i is not None}
    return [signature(by_probe[i]) for i in range(len(probes))], [by_probe[i].num_cached_tokens for i in range(len(probes))]


@pytest.fixture(scope="module")
def alone_llm(tiny_qwen3_dir):
    """No prefix cache and a large token budget: every request computed from scratch in one prefill."""
    return LLM(str(tiny_qwen3_dir), deterministic=True, enable_prefix_caching=False, **MODEL_OPTIONS)


def test_outputs_do_not_depend_on_the_batch_cache_or_chunking(tiny_qwen3_dir, alone_llm):
    probes = probe_requests(alone_llm.llm_engine.config.vocab_size)
    alone = [signature(alone_llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]) for p, sp in probes]
    # Chunked prefill (16 tokens a step), at most 5 sequences a step, prefix cache on.
    mixed_llm = LLM(str(tiny_qwen3_dir), deterministic=True, max_num_batched_tokens=16, max_num_seqs=5, **MODEL_OPTIONS)
    cached = []
    for trial, size in enumerate((2, 4, 7)):
        got, hits = run_mixed(mixed_llm, probes, size, trial)
        cached.append(hits)
        for i, (want, have) in enumerate(zip(alone, got)):
            assert have == want, f"probe {i} in a batch with {size} others (trial {trial}) differs from its run alone"
    assert any(h > 0 for hits in cached[1:] for h in hits), f"no prefix-cache hit happened: {cached}"
    # And every probe again, alone, on the engine whose cache now holds its prompt.
    for i, (p, sp) in enumerate(probes):
        out = mixed_llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens > 0 or len(p) <= 16  # (one block of 16 must be full to be cached)
        assert signature(out) == alone[i]


def test_prompt_logprobs_do_not_depend_on_chunking(tiny_qwen3_dir, alone_llm):
    prompt = random.Random(3).sample(range(3, alone_llm.llm_engine.config.vocab_size), 40)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1)
    alone = signature(alone_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
    chunked = LLM(str(tiny_qwen3_dir), deterministic=True, max_num_batched_tokens=7, **MODEL_OPTIONS)
    got, _ = run_mixed(chunked, [(prompt, params)], 3, trial=11)
    assert got[0] == alone


def test_default_mode_moves_the_bits_of_this_workload(tiny_qwen3_dir):
    """The control: without deterministic mode the same kind of workload changes some logprob, so the
    checks above would notice a batch-dependent kernel. (The bits that move depend on the CPU's
    kernels; on every machine measured they moved for most requests.)"""
    options = {**MODEL_OPTIONS, "enable_prefix_caching": False}
    solo = LLM(str(tiny_qwen3_dir), **options)
    probes = probe_requests(solo.llm_engine.config.vocab_size)
    alone = [signature(solo.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]) for p, sp in probes]
    batched = LLM(str(tiny_qwen3_dir), max_num_batched_tokens=16, max_num_seqs=5, **MODEL_OPTIONS)
    got, _ = run_mixed(batched, probes, 5, trial=1)
    assert got != alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_rows_do_not_depend_on_the_batch(dtype):
    """The CPU claim of kernels/batch_invariant.py, on the machine the suite runs on: the same row gives
    the same bits at any M and any place, and the values are F.linear's."""
    from tokenmill.kernels.batch_invariant import CPU_CHUNK_ROWS, batch_invariant_linear

    gen = torch.Generator().manual_seed(0)
    for n, k in ((96, 64), (1536, 576)):
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        row = torch.randn(1, k, generator=gen).to(dtype)
        expected = batch_invariant_linear(row, weight, bias)
        torch.testing.assert_close(expected, F.linear(row, weight, bias), atol=1e-2, rtol=1e-2)
        for m in (2, 3, 5, CPU_CHUNK_ROWS - 1, CPU_CHUNK_ROWS, CPU_CHUNK_ROWS + 1, 3 * CPU_CHUNK_ROWS + 7):
            for place in sorted({0, m // 2, m - 1}):
                x = torch.randn(m, k, generator=gen).to(dtype)
                x[place] = row[0]
                assert torch.equal(batch_invariant_linear(x, weight, bias)[place], expected[0]), (n, k, m, place)
    assert batch_invariant_linear(torch.empty(0, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype)).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_each_token_matches_reference_and_is_invariant(dtype):
    """Deterministic CPU attention: the reference's values, and a token's bits the same decoded,
    prefilled whole, in a chunk, beside other sequences."""
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.kernels.reference import paged_attention_ref, store_kv_ref
    from support.kernel_cases import make_paged_batch

    lens = [23, 9]
    batch = make_paged_batch(lens, lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=dtype, seed=4)
    cache = batch.kv_cache.clone()
    store_kv_ref(batch.k, batch.v, cache, batch.slot_mapping)
    backend = TorchAttentionBackend(deterministic=True)
    full = backend.forward(batch.q, batch.k, batch.v, cache.clone(), batch.metadata(), 0.2)
    expected = paged_attention_ref(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.2)
    torch.testing.assert_close(full, expected, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
    first = [0, lens[0]]
    for items in ([(0, 22, 1), (1, 4, 1)], [(1, 8, 1), (0, 3, 12)], [(0, 0, 23)]):  # decodes, chunk + decode, whole
        rows = [first[s] + pos for s, start, count in items for pos in range(start, start + count)]
        starts = [0]
        for _, _, count in items:
            starts.append(starts[-1] + count)
        seq_lens = [start + count for _, start, count in items]
        meta = batch.metadata()
        meta.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        meta.block_tables = batch.block_tables[[s for s, _, _ in items]]
        meta.query_lens_host = [c for _, _, c in items]
        meta.seq_lens_host = seq_lens
        meta.max_query_len, meta.max_seq_len = max(meta.query_lens_host), max(seq_lens)
        meta.slot_mapping = batch.slot_mapping[rows]
        got = backend.forward(batch.q[rows], batch.k[rows], batch.v[rows], cache.clone(), meta, 0.2)
        assert torch.equal(got, full[rows]), items


def test_every_linear_layer_and_the_lm_head_use_the_batch_invariant_matmul(alone_llm):
    from tokenmill.kernels.batch_invariant import batch_invariant_linear

    model = alone_llm.llm_engine.executor.runner.model
    methods = [m.quant_method for m in model.modules() if hasattr(m, "quant_method")]
    assert len(methods) == 4 * model.num_layers  # qkv, o, gate_up, down per layer
    assert all(method.matmul is batch_invariant_linear for method in methods)
    assert model.lm_head.matmul is batch_invariant_linear
    assert alone_llm.llm_engine.executor.runner.backend.deterministic


def test_moe_outputs_do_not_depend_on_the_batch(tiny_qwen2_moe_dir):
    """A mixture-of-experts model (Qwen2-MoE: router, experts, shared expert and its gate) in
    deterministic mode: every product through the batch-invariant matmul, and each probe's bits
    the same alone and in chunked, mixed batches."""
    from tokenmill.kernels.batch_invariant import batch_invariant_linear
    from tokenmill.models.layers.moe import Experts, Router, SharedExpertGate

    alone_llm = LLM(str(tiny_qwen2_moe_dir), deterministic=True, enable_prefix_caching=False, **MODEL_OPTIONS)
    probes = probe_requests(alone_llm.llm_engine.config.vocab_size)
    alone = [signature(alone_llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]) for p, sp in probes]
    mixed_llm = LLM(str(tiny_qwen2_moe_dir), deterministic=True, max_num_batched_tokens=16, max_num_seqs=5, **MODEL_OPTIONS)
    moe_parts = [m for m in mixed_llm.llm_engine.executor.runner.model.modules() if isinstance(m, (Router, Experts, SharedExpertGate))]
    assert len(moe_parts) == 3 * 2 and all(m.matmul is batch_invariant_linear for m in moe_parts)
    for trial, size in enumerate((3, 6)):
        got, _ = run_mixed(mixed_llm, probes, size, trial)
        assert got == alone, f"a probe in a batch with {size} others (trial {trial}) differs from its run alone"


@pytest.mark.parametrize("kwargs, message", [
    ({"deterministic": "yes"}, "deterministic"),
    ({"deterministic": True, "tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
])
def test_bad_deterministic_settings_are_refused(tiny_qwen3_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen3_dir), **MODEL_OPTIONS, **kwargs)


def test_pooling_models_refuse_deterministic(tiny_bert_embedder_dir):
    with pytest.raises(ValueError, match="deterministic=True"):
        LLM(str(tiny_bert_embedder_dir), device="cpu", deterministic=True)


def test_quantized_models_refuse_deterministic(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="deterministic=True"):
        LLM(str(tiny_qwen3_dir), quantization="fp8", **MODEL_OPTIONS, deterministic=True)
