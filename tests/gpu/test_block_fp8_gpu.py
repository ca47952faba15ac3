"""Block-wise fp8 on a CUDA GPU: the per-group activation quantization and the block-scaled GEMM
against their plain-torch twins over Qwen3-8B's projections and odd shapes (M from 1 to 4096,
partial blocks, forced configs, split K under CUDA-graph replays), block fp8 checkpoints (HF's
weight_block_size and compressed-tensors' FP8_BLOCK) end to end against HF fp32 on their reference
weights, a block fp8 mixture-of-experts checkpoint (its experts requantized per row), and the KV
cache gaining the bytes fp8 weights free. The CPU interpreter's checks:
tests/kernel_checks_block_fp8.py."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from support.hf_reference import assert_within, hf_logprobs, teacher_forced_positions
from support.kv_pool import kv_bytes_gained

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES_QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K): qkv, o, gate_up, down
ODD = [(1000, 4000), (72, 200), (4104, 1032)]  # partial block rows and columns
M_VALUES = [1, 2, 3, 8, 16, 17, 32, 33, 64, 65, 128, 192, 256, 257, 300, 1024, 4096]


def _block_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = (torch.randn(n, k, device="cuda", generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    # Block scales across two orders of magnitude: a scale applied to the wrong block shows.
    shape = (-(-n // 128), -(-k // 128))
    scales = torch.rand(shape, device="cuda", generator=gen) * 10.0 ** torch.randint(-5, -3, shape, device="cuda", generator=gen)
    return codes, scales


@pytest.mark.parametrize("n, k", SHAPES_QWEN3_8B + ODD)
def test_block_fp8_quantize_and_gemm_match_twins(n, k):
    from tokenmill.kernels.reference import block_fp8_linear_ref, quantize_fp8_groups_ref
    from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm, quantize_fp8_groups
    from tokenmill.kernels.triton.fp8_gemm import counters_needed

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    wq, w_scale = _block_weight(n, k, gen)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if n % 2 == 0 else None
    for m in M_VALUES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
        xq, x_scale = quantize_fp8_groups(x)
        want_q, want_s = quantize_fp8_groups_ref(x)
        assert torch.equal(x_scale, want_s) and torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)), f"M={m}"
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = block_fp8_gemm(xq, x_scale, wq, w_scale, bias, torch.bfloat16, counters, out=out)
        want = block_fp8_linear_ref(xq, x_scale, wq, w_scale, bias, torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * float(want.float().abs().max()), rtol=1e-2,
                                   msg=f"M={m}")
        assert int(counters.abs().sum()) == 0, f"M={m}: split-K counters not reset"


# (N, K, out dtype, Ms, config overrides on choose_swapped_config): deep and uneven K splits, half-group
# K steps, narrow weight tiles, fp16 output.
_VARIANTS = [
    (4096, 12288, torch.bfloat16, (1, 16, 33), dict(split_k=16)),
    (4096, 12288, torch.bfloat16, (4, 64), dict(split_k=7)),
    (6144, 4096, torch.bfloat16, (8, 96), dict(BLOCK_N=64, BLOCK_K=64, num_stages=3)),
    (1000, 4000, torch.float16, (3, 65, 256), {}),
    (4104, 1032, torch.float16, (1, 130), dict(split_k=2)),
]


@pytest.mark.parametrize("case", range(len(_VARIANTS)))
def test_block_fp8_gemm_variants_match_twin(case):
    from tokenmill.kernels.reference import block_fp8_linear_ref
    from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm
    from tokenmill.kernels.triton.fp8_gemm import choose_swapped_config, counters_needed

    n, k, dtype, ms, overrides = _VARIANTS[case]
    gen = torch.Generator(device="cuda").manual_seed(case)
    wq, w_scale = _block_weight(n, k, gen)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in ms:
        config = dict(choose_swapped_config(m, n, k, sms), **overrides)
        xq = (torch.randn(m, k, device="cuda", generator=gen) * 40).to(torch.float8_e4m3fn)
        x_scale = torch.rand(m, -(-k // 128), device="cuda", generator=gen) * 0.01
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        got = block_fp8_gemm(xq, x_scale, wq, w_scale, None, dtype, counters, config, out=out)
        want = block_fp8_linear_ref(xq, x_scale, wq, w_scale, None, dtype)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * float(want.float().abs().max()), rtol=1e-2,
                                   msg=f"M={m} {config}")
        assert int(counters.abs().sum()) == 0, f"M={m}: split-K counters not reset"


def test_block_fp8_split_k_replays_in_a_cuda_graph():
    from tokenmill.kernels.reference import block_fp8_linear_ref
    from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm, quantize_fp8_groups
    from tokenmill.kernels.triton.fp8_gemm import choose_swapped_config, counters_needed

    n, k, m = 4096, 12288, 8
    assert choose_swapped_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)["split_k"] > 1
    wq, w_scale = _block_weight(n, k, torch.Generator(device="cuda").manual_seed(0))
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    block_fp8_gemm(*quantize_fp8_groups(x), wq, w_scale, None, torch.bfloat16, counters)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xq, x_scale = quantize_fp8_groups(x)
        y = block_fp8_gemm(xq, x_scale, wq, w_scale, None, torch.bfloat16, counters)
    for _ in range(3):
        x.normal_()
        graph.replay()
        want = block_fp8_linear_ref(xq, x_scale, wq, w_scale, None, torch.bfloat16)
        torch.testing.assert_close(y.float(), want.float(), atol=1e-2 * float(want.float().abs().max()), rtol=1e-2)
    assert int(counters.abs().sum()) == 0


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 280) for _ in range(rng.choice([1, 7, 33, 150]))] for _ in range(count)]


@pytest.mark.parametrize("kind", ["hf-qwen3", "ct-fp8-block"])
def test_block_fp8_checkpoint_matches_hf_on_reference_weights_on_gpu(tmp_path, kind):
    """Through the kernels (bf16 activations, quantized to fp8 per token and 128-group before each
    GEMM) and CUDA graphs, teacher-forced against HF fp32 on the checkpoint's reference weights
    (transformers' / compressed-tensors' own dequantization): each greedy token's logprob within the
    slack of HF's on the same prefix, HF's argmax picked where its top two are further apart.

    Slack: fp8 activation rounding emulated in fp32 on the CPU (HF on the reference weights, each
    projection's input fake-quantized per token and 128-group by quantize_fp8_groups_ref) moves these
    fixtures' greedy-token logprobs by up to 0.56 (hf-qwen3) and 0.47 (ct-fp8-block) over the same
    6 prompts x 8 tokens; 1.35x that, as test_quant_engine_gpu's static fp8 fixture, plus bf16."""
    from quant_checkpoints import block_fp8_checkpoint, compressed_tensors_checkpoint

    from tokenmill import LLM

    if kind == "hf-qwen3":
        folder, reference = block_fp8_checkpoint(tmp_path, "qwen3")
    else:
        folder, reference = compressed_tensors_checkpoint(tmp_path, "FP8_BLOCK", "llama")
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=256, gpu_memory_utilization=0.3, dtype="bfloat16")
    layer = llm.llm_engine.executor.driver.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_blocks.shape == (2, 3)  # kept quantized
    rows = teacher_forced_positions(llm, functools.partial(hf_logprobs, str(reference), torch.float32), _prompts(6), 8)
    assert_within(rows, {"hf-qwen3": 0.75, "ct-fp8-block": 0.65}[kind], clear_needed=6)


def test_block_fp8_mixture_of_experts_checkpoint_matches_hf_on_gpu(tmp_path):
    """A Qwen3-MoE checkpoint in Qwen3-30B-A3B-FP8's layout: attention through block_fp8_gemm, the
    experts' blocks dequantized after loading and quantized again per row for the fused expert
    kernels (weight-only), teacher-forced against HF fp32 on the reference weights. Slack: the same
    emulation on the CPU (attention inputs fake-quantized per 128-group, the experts' weights
    requantized per row by quantize_rows) moves the greedy tokens' logprobs by up to 0.65 over these
    6 prompts x 8 tokens; 1.35x that, plus bf16."""
    from quant_checkpoints import block_fp8_moe_checkpoint

    from tokenmill import LLM
    from tokenmill.models.layers.moe import Experts

    folder, reference = block_fp8_moe_checkpoint(tmp_path)
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=256, gpu_memory_utilization=0.3, dtype="bfloat16")
    experts = [m for m in llm.llm_engine.executor.driver.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.fp8 and e.w13.dtype == torch.float8_e4m3fn for e in experts)
    rows = teacher_forced_positions(llm, functools.partial(hf_logprobs, str(reference), torch.float32), _prompts(6), 8)
    assert_within(rows, 0.9, clear_needed=6)


def test_kv_cache_gets_the_memory_block_fp8_weights_free(tmp_path):
    """The same dummy model in bf16 and block fp8 at the same utilisation: the fp8 pool is larger by at
    least 90% of the weight bytes it saves (one byte a weight instead of two; a scale per 16,384)."""
    shape = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                 rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6, torch_dtype="bfloat16")
    block_fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    gained, blocks = kv_bytes_gained(tmp_path, shape, block_fp8)
    linear = 16 * (2048 * (2048 + 2 * 1024) + 2048 * 2048 + 3 * 2048 * 6144)
    saved = linear * 2 - linear  # bf16 bytes minus fp8 bytes (the fp32 block scales are 1/4096 of that)
    assert gained >= 0.9 * saved, (blocks, saved)
