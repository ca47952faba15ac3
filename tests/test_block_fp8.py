"""Block-wise fp8 checkpoints on the CPU (weights dequantized at load): HF's ``quant_method: "fp8"``
with ``weight_block_size: [128, 128]`` (Qwen3-*-FP8's layout) and compressed-tensors' FP8_BLOCK,
against Hugging Face transformers in fp32 on the reference weights (tests/quant_checkpoints.py:
transformers' and compressed-tensors' own quantizers write them, their dequantizers give the
reference): greedy tokens identical, logprobs within 1e-4. Also partial blocks, ignored modules,
tensor-parallel slices (and cuts inside a block refused), stacked projections off a block
boundary refused, and the config fields we do not run refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quant_checkpoints import block_fp8_checkpoint, compressed_tensors_checkpoint, tiny_config
from reference import hf_greedy, hf_model
from test_quantization import PROMPTS, _check_against_hf, _check_dummy_weights
from tokenmill import LLM, SamplingParams

pytest.importorskip("compressed_tensors")

# Partial blocks: hidden 320 (K of qkv / gate_up and N of o / down: 2.5 blocks); heads of 128.
PARTIAL = dict(hidden_size=320, head_dim=128)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("block-fp8")


def test_hf_block_fp8_checkpoint_matches_hf_on_transformers_dequantized_weights(root):
    folder, reference = block_fp8_checkpoint(root, "qwen3")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [128, 128] and config["quant_method"] == "fp8"
    llm = _check_against_hf(folder, reference)
    assert "128x128 block" in llm.llm_engine.config.quantization.describe()


def test_partial_blocks_and_modules_to_not_convert(root):
    """Sides that are not multiples of 128 (the block grid is cdiv, the last blocks partial) and two
    projections kept in full precision by modules_to_not_convert."""
    kept = ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj")
    folder, reference = block_fp8_checkpoint(root, "llama", seed=1, full_precision=kept, tag="-partial", **PARTIAL)
    llm = _check_against_hf(folder, reference)
    layers = llm.llm_engine.executor.driver.model.model.layers
    assert layers[0].mlp.down_proj.weight.dtype == torch.float32


def test_compressed_tensors_fp8_block_matches_hf_on_its_decompressed_weights(root):
    folder, reference = compressed_tensors_checkpoint(root, "FP8_BLOCK", "qwen2", ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.up_proj$",
                                                                                         "re:.*layers\\.1\\.mlp\\.gate_proj$"))
    llm = _check_against_hf(folder, reference)
    assert llm.llm_engine.config.quantization.method == "compressed-tensors"


def test_tensor_parallel_ranks_hold_their_block_slices(root):
    """Each of two ranks dequantizes exactly its rows (q/k/v, gate/up: 256 and 128 a rank) or columns
    (down_proj: 256 of 512) of the reference weights, the scales sliced with them."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.quantization.config import resolve_quantization

    folder, reference = block_fp8_checkpoint(root, "llama", seed=2, intermediate_size=512, head_dim=128, tag="-tp")
    source = resolve_model(str(folder))
    quant = resolve_quantization(None, source.hf_config)
    full = hf_model(str(reference)).model.layers[1]
    for rank in (0, 1):
        layer = load_model(source, torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=2, quantization=quant).model.layers[1]
        rows = lambda w: w[rank * (w.shape[0] // 2) : (rank + 1) * (w.shape[0] // 2)]  # noqa: E731
        qkv = torch.cat([rows(full.self_attn.q_proj.weight), rows(full.self_attn.k_proj.weight), rows(full.self_attn.v_proj.weight)])
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
        gate_up = torch.cat([rows(full.mlp.gate_proj.weight), rows(full.mlp.up_proj.weight)])
        torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.down_proj.weight, full.mlp.down_proj.weight[:, rank * 256 : (rank + 1) * 256],
                                   rtol=0, atol=0)


@pytest.mark.slow
def test_tensor_parallel_generation_over_gloo_matches_hf(root):
    folder, reference = block_fp8_checkpoint(root, "qwen3", seed=3, intermediate_size=512, head_dim=128, tag="-tp-gen")
    llm = LLM(str(folder), tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        model = hf_model(str(reference))
        for prompt, output in zip(PROMPTS, outputs):
            assert list(output.outputs[0].token_ids) == hf_greedy(model, prompt, 6)[0]
    finally:
        llm.llm_engine.executor.shutdown()


def test_a_tensor_parallel_split_inside_a_block_is_refused(root):
    """intermediate 384 over two ranks: 192 rows (gate/up) and columns (down) a rank, inside a block
    (vLLM refuses it too)."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.quantization.config import resolve_quantization

    folder, _ = block_fp8_checkpoint(root, "llama", seed=4, head_dim=128, tag="-tp-cut")
    source = resolve_model(str(folder))
    with pytest.raises(ValueError, match=r"(output rows|input columns) \[0, 192\) of 384, which cut a 128x128 fp8 weight block; "
                                         r"choose a tensor_parallel_size"):
        load_model(source, torch.float32, torch.device("cpu"), tp_rank=0, tp_size=2,
                   quantization=resolve_quantization(None, source.hf_config))


def test_stacked_projections_off_a_block_boundary_are_refused(root):
    """gate and up of 320 rows each: up's blocks would start at row 320 of gate_up, inside gate's last
    block row, which one scale grid cannot hold."""
    folder, _ = block_fp8_checkpoint(root, "llama", seed=5, intermediate_size=320, tag="-unaligned")
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv.*stacked at row 320 .* not start on a 128-row "
                                         r"block boundary"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)


def test_a_missing_block_scale_is_refused(root):
    from safetensors.torch import load_file, save_file

    built, _ = block_fp8_checkpoint(root, "qwen3", seed=6, tag="-missing")
    folder = root / "block-fp8-missing-scale"
    shutil.copytree(built, folder)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors = {n: t for n, t in load_file(folder / "model.safetensors").items() if n != name}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"missing tensors \(1\) {name}"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)


_HF = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_CT_BLOCK = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True,
                "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}}}}


def _ct_block(weights: dict | None = None, inputs: dict | None = None) -> dict:
    group = _CT_BLOCK["config_groups"]["group_0"]
    changed = {**group, "weights": {**group["weights"], **(weights or {})},
               "input_activations": {**group["input_activations"], **(inputs or {})}}
    return {**_CT_BLOCK, "config_groups": {"group_0": changed}}


@pytest.mark.parametrize("quant, message", [
    ({**_HF, "weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\] is not supported; supported: null .* or \[128, 128\]"),
    ({**_HF, "weight_block_size": [128]}, r"weight_block_size=\[128\] is not supported"),
    ({**_HF, "activation_scheme": "static"}, r"activation_scheme='static' is not supported; supported: 'dynamic' with weight_block_size"),
    ({**_HF, "fmt": "e5m2"}, r"fmt='e5m2' is not supported; supported: 'e4m3'"),
    ({**_HF, "modules_to_convert": ["q_proj"]}, r"modules_to_convert=\['q_proj'\] is not supported; supported: null"),
    ({**_HF, "expert_dtype": "fp4"}, r"expert_dtype='fp4' is not supported; supported: 'fp8'"),
    ({**_HF, "ignored_layers": "lm_head"}, r"ignored_layers='lm_head' is not supported; supported: a list of module names"),
    (_ct_block({"block_structure": [128, 64]}), r"group_0.weights.block_structure=\[128, 64\] is not supported; supported: \[128, 128\]"),
    (_ct_block(inputs={"strategy": "token", "group_size": None}),
     r"group_0.input_activations=.*'token'.* is not supported; supported: dynamic fp8 scales per token and group of 128"),
    (_ct_block(inputs={"dynamic": False, "strategy": "tensor", "group_size": None}),
     r"group_0.input_activations=.* is not supported; supported: dynamic fp8 scales per token and group of 128"),
    (_ct_block({"strategy": "tensor-group"}), r"group_0.weights.strategy='tensor-group' is not supported; supported: 'tensor', 'channel' or 'block'"),
])
def test_block_fp8_configs_we_do_not_run_are_refused_by_field(quant, message):
    from tokenmill.quantization.config import resolve_quantization

    config = tiny_config()
    config.quantization_config = quant
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, config)


def test_block_fp8_configs_resolve_to_block_schemes_with_their_ignore_lists():
    from tokenmill.quantization.config import resolve_quantization

    config = tiny_config()
    config.quantization_config = {**_HF, "modules_to_not_convert": ["lm_head"], "ignored_layers": ["model.layers.0.mlp.down_proj"]}
    quant = resolve_quantization(None, config)
    scheme = quant.scheme_for(["model.layers.1.mlp.down_proj"])
    assert (scheme.weight_scales, scheme.block_scale_name) == ("block", "weight_scale_inv")
    assert quant.scheme_for(["model.layers.0.mlp.down_proj"]) is None and quant.scheme_for(["lm_head"]) is None
    config.quantization_config = _CT_BLOCK
    scheme = resolve_quantization(None, config).scheme_for(["model.layers.0.self_attn.q_proj"])
    assert (scheme.weight_scales, scheme.block_scale_name) == ("block", "weight_scale")


def test_dummy_weights_for_a_block_fp8_config(root):
    """load_format="dummy" with a block fp8 config (the GPU benchmarks' models without a checkpoint):
    on the CPU the weights dequantize to finite values of the usual magnitude and the engine generates."""
    folder = root / "dummy-block-fp8"
    config = tiny_config("qwen3")
    config.quantization_config = dict(_HF)
    _check_dummy_weights(folder, config)


def test_block_fp8_mixture_of_experts_checkpoint_matches_hf(root):
    """A Qwen3-MoE checkpoint in Qwen3-30B-A3B-FP8's layout: attention through the block method, each
    expert's blocks dequantized after loading (on the CPU kept so; on a GPU quantized again per row)."""
    from quant_checkpoints import block_fp8_moe_checkpoint
    from tokenmill.models.layers.moe import Experts

    folder, reference = block_fp8_moe_checkpoint(root)
    llm = _check_against_hf(folder, reference)
    experts = [m for m in llm.llm_engine.executor.driver.model.modules() if isinstance(m, Experts)]
    assert experts and all(not e.fp8 and e.w13.dtype == torch.float32 and not hasattr(e, "w13_scale_inv") for e in experts)


def test_block_fp8_experts_are_quantized_again_per_row_for_the_gpu_kernels(root, monkeypatch):
    """What a GPU keeps of block-wise fp8 experts (the kernel path forced on the CPU): fp8 codes with a
    scale per output row, within one e4m3 rounding (1/16 of a row's largest weight) of HF's reference."""
    from quant_checkpoints import block_fp8_moe_checkpoint
    from tokenmill import quantization
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.quantization.config import resolve_quantization

    folder, reference = block_fp8_moe_checkpoint(root, seed=1)
    source = resolve_model(str(folder))
    monkeypatch.setattr(quantization, "runs_kernels", lambda device: True)
    experts = load_model(source, torch.float32, torch.device("cpu"), quantization=resolve_quantization(None, source.hf_config)
                         ).model.layers[1].mlp.experts
    assert experts.fp8 and experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale.shape == (4, 256)
    hf = hf_model(str(reference)).model.layers[1].mlp.experts
    for name, ours, scales in (("gate_up_proj", experts.w13, experts.w13_scale), ("down_proj", experts.w2, experts.w2_scale)):
        got = ours.float() * scales[..., None]
        expected = getattr(hf, name).detach()
        step = expected.abs().amax(dim=-1, keepdim=True) / 16
        assert bool(((got - expected).abs() <= step).all()), name
