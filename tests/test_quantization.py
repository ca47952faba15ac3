"""Quantized checkpoints and quantization="fp8" on the CPU (weights dequantized at load), against
Hugging Face transformers in fp32 on the reference weights (see tests/quant_checkpoints.py for how
each checkpoint and its reference are made without tokenmill): greedy tokens identical, logprobs
within 1e-4. Also: tensor-parallel slices of packed weights, dummy quantized weights, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quant_checkpoints import compressed_tensors_checkpoint, fp8_fake_quantized_reference, gptq_awq_checkpoint, tiny_config
from reference import hf_greedy, hf_model
from tokenmill import LLM, SamplingParams

pytest.importorskip("compressed_tensors")

PROMPTS = [[5, 80, 123, 44, 9], [200, 17], [33, 34, 35, 36, 37, 38, 39, 40, 41]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quantized")


def _check_against_hf(folder: Path, reference: Path, **llm_kwargs) -> LLM:
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = hf_model(str(reference))
    for prompt, output in zip(PROMPTS, outputs):
        tokens, logprobs = hf_greedy(model, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert ours == pytest.approx(logprobs, abs=1e-4)
    return llm


@pytest.mark.parametrize("preset, family, group_size", [
    ("W4A16", "llama", None), ("W4A16_ASYM", "qwen2", None), ("FP8", "llama", None), ("FP8_DYNAMIC", "qwen2", None),
    ("W4A16", "llama", -1), ("W4A16_ASYM", "qwen2", 32),  # per-channel and small groups
])
def test_compressed_tensors_checkpoint_matches_hf_on_its_decompressed_weights(root, preset, family, group_size):
    folder, reference = compressed_tensors_checkpoint(root, preset, family, group_size=group_size)
    llm = _check_against_hf(folder, reference)
    assert llm.llm_engine.config.quantization.method == "compressed-tensors"


@pytest.mark.parametrize("ignore, more_groups", [
    (("lm_head", r"re:.*layers\.0\.mlp\.down_proj$"), ()),  # one layer kept in full precision
    (("lm_head",), (("FP8_DYNAMIC", ["re:.*down_proj$"]),)),  # a regex group wins over "Linear" (mixed-precision)
])
def test_compressed_tensors_ignore_lists_and_target_precedence(root, ignore, more_groups):
    """compressed-tensors gives a module the group whose target names it exactly, else by regex, else by
    class ("Linear"), whatever their order in config_groups; ignored modules keep full-precision weights."""
    folder, reference = compressed_tensors_checkpoint(root, "W4A16_ASYM", "llama", seed=7, ignore=ignore,
                                                      more_groups=more_groups)
    _check_against_hf(folder, reference)


def test_compressed_tensors_targets_name_modules_exactly():
    """A bare name target matches the full module name only (compressed-tensors' match_name), not a suffix."""
    from tokenmill.quantization.config import Fp8Scheme, Int4Scheme, QuantizationConfig

    int4, fp8 = Int4Scheme("compressed-tensors", 128, True), Fp8Scheme("channel", "dynamic")
    config = QuantizationConfig("compressed-tensors", ((("Linear",), int4), (("o_proj", "model.layers.1.mlp.up_proj"), fp8)))
    assert config.scheme_for(["model.layers.0.self_attn.o_proj"]) == int4
    assert config.scheme_for(["model.layers.1.mlp.up_proj"]) == fp8


def test_compressed_tensors_config_under_its_older_compression_config_key(root):
    """Older compressed-tensors (sparseml) checkpoints name the section compression_config; vLLM reads it
    when quantization_config is absent. Without it the packed tensors would only meet a loader error."""
    built, reference = compressed_tensors_checkpoint(root, "W4A16", "llama", seed=9)
    folder = root / "ct-compression-config"
    shutil.copytree(built, folder)
    config = json.loads((folder / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    assert _check_against_hf(folder, reference).llm_engine.config.quantization.method == "compressed-tensors"


@pytest.mark.parametrize("fmt, symmetric", [("gptq", True), ("gptq", False), ("awq", False)])
def test_gptq_and_awq_checkpoints_match_hf_on_the_dequantized_integers(root, fmt, symmetric):
    folder, reference = gptq_awq_checkpoint(root, fmt, symmetric)
    llm = _check_against_hf(folder, reference)
    assert llm.llm_engine.config.quantization.method == fmt


@pytest.mark.parametrize("fmt, symmetric, group_size, scale_dtype, gptq_format", [
    ("gptq", False, -1, torch.float16, "gptq"), ("gptq", True, 32, torch.bfloat16, "gptq"),
    ("gptq", False, 64, torch.float32, "gptq_v2"), ("awq", False, 64, torch.bfloat16, "gptq"),
])
def test_gptq_and_awq_group_sizes_scale_dtypes_and_v2_format(root, fmt, symmetric, group_size, scale_dtype, gptq_format):
    """Per-channel (-1) and small groups, bf16 / fp32 scales, GPTQ's v2 format (zero points stored as they are)."""
    folder, reference = gptq_awq_checkpoint(root, fmt, symmetric, group_size=group_size, seed=2, scale_dtype=scale_dtype,
                                            gptq_format=gptq_format)
    _check_against_hf(folder, reference)


@pytest.mark.parametrize("fmt, symmetric, group_size", [("gptq", False, 128), ("gptq", True, 64), ("ct", False, 64),
                                                      ("ct", True, 128)])
def test_act_order_checkpoints_match_hf_on_the_integers_and_groups_drawn(root, fmt, symmetric, group_size):
    """GPTQ desc_act=True and compressed-tensors actorder "group": each feature's group is its g_idx
    entry (drawn as a permuted plain order), not feature // group_size."""
    folder, reference = gptq_awq_checkpoint(root, fmt, symmetric, group_size=group_size, seed=11, act_order=True)
    llm = _check_against_hf(folder, reference)
    assert "act-order" in llm.llm_engine.config.quantization.describe()


def test_compressed_tensors_actorder_weight_needs_no_g_idx(root):
    """actorder "weight" (alias "static") reorders features only while quantizing: compressed-tensors
    writes the plain layout and no g_idx, and the folder loads as a plain one."""
    folder, reference = compressed_tensors_checkpoint(root, "W4A16", "llama", seed=12, actorder="weight")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    _check_against_hf(folder, reference)


def test_gptq_act_order_with_static_groups_loads_and_a_permuted_g_idx_without_desc_act_is_refused(root):
    """desc_act=True with static_groups=True: groups were fixed before the reordering, so g_idx is the
    plain order (AutoGPTQ / GPTQModel write perm // g then un-permute it) and the weights load as usual.
    A g_idx that is really permuted while desc_act=False is refused, by name."""
    from safetensors.torch import load_file, save_file

    built, reference = gptq_awq_checkpoint(root, "gptq", False, seed=4)
    folder = root / "gptq-static-groups"
    shutil.copytree(built, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update({"desc_act": True, "static_groups": True})
    (folder / "config.json").write_text(json.dumps(config))
    _check_against_hf(folder, reference)
    config["quantization_config"].update({"desc_act": False, "static_groups": False})
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.*not the plain group order.*desc_act=false"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)


@pytest.mark.parametrize("change, message", [
    ("stacked", r"up_proj.g_idx.*differs from the g_idx of a projection stacked with it"),
    ("range", r"down_proj.g_idx.*groups outside 0..2"),
    ("missing", r"missing tensors.*down_proj.g_idx"),
])
def test_act_order_g_idx_that_cannot_run_is_refused_by_name(root, change, message):
    """Stacked projections (one layer, one reordering of its input) with different g_idx, a group past
    the scales, or no g_idx at all for a desc_act checkpoint."""
    from safetensors.torch import load_file, save_file

    built, _ = gptq_awq_checkpoint(root / change, "gptq", True, seed=13, act_order=True)
    folder = root / f"gptq-act-order-bad-{change}"
    shutil.copytree(built, folder)
    tensors = load_file(folder / "model.safetensors")
    if change == "stacked":
        name = "model.layers.1.mlp.up_proj.g_idx"
        tensors[name] = tensors[name].flip(0).contiguous()
    elif change == "range":
        tensors["model.layers.1.mlp.down_proj.g_idx"][5] = 3  # 384 features: groups 0..2
    else:
        del tensors["model.layers.1.mlp.down_proj.g_idx"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)


def test_gptq_checkpoint_without_g_idx_loads(root):
    """g_idx only matters for act-order; desc_act=False exports that leave it out load in the plain order
    (vLLM's GPTQ layers do not require it either)."""
    from safetensors.torch import load_file, save_file

    built, reference = gptq_awq_checkpoint(root, "gptq", True, seed=6)
    folder = root / "gptq-no-g-idx"
    shutil.copytree(built, folder)
    tensors = {n: t for n, t in load_file(folder / "model.safetensors").items() if not n.endswith(".g_idx")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _check_against_hf(folder, reference)


def test_quantization_fp8_quantizes_a_full_precision_checkpoint_while_loading(root, tiny_llama_dir):
    reference = fp8_fake_quantized_reference(root, tiny_llama_dir)
    _check_against_hf(tiny_llama_dir, reference, quantization="fp8")


@pytest.mark.parametrize("fixture", ["tiny_qwen2_moe_dir", "tiny_mixtral_dir"])
def test_quantization_fp8_quantizes_a_mixture_of_experts_model_while_loading(root, fixture, request):
    """The experts' weights to fp8 per output channel (stacked, weight-only), the attention and the shared
    expert as in a dense model, the router and the LM head left alone: HF on the same weights quantized
    and dequantized by compressed-tensors."""
    from tokenmill.models.layers.moe import Experts

    folder = request.getfixturevalue(fixture)
    llm = _check_against_hf(folder, fp8_fake_quantized_reference(root, folder), quantization="fp8")
    model = llm.llm_engine.executor.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(not e.fp8 and e.w13.dtype == torch.float32 for e in experts)  # dequantized on the CPU


def test_fp8_checkpoint_with_quant_method_fp8(root):
    """quant_method "fp8" (per-tensor scales, static activations): the compressed-tensors FP8 tensors
    under the other config, which names the same weight / weight_scale / input_scale tensors."""
    ct_folder, reference = compressed_tensors_checkpoint(root, "FP8", "llama", seed=3)
    folder = root / "fp8-method"
    shutil.copytree(ct_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (folder / "config.json").write_text(json.dumps(config))
    assert _check_against_hf(folder, reference).llm_engine.config.quantization.method == "fp8"


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_fp8_checkpoint_scales_in_half_precision_dequantize_exactly(root, scale_dtype):
    """weight_scale / input_scale stored in bf16 or fp16 (the model dtype of the export): weight = fp8 * scale."""
    from safetensors.torch import load_file, save_file

    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.quantization.config import resolve_quantization

    built, _ = compressed_tensors_checkpoint(root, "FP8", "llama", seed=3)
    folder = root / f"fp8-scales-{scale_dtype}"
    shutil.copytree(built, folder)
    tensors = {n: t.to(scale_dtype) if n.endswith("_scale") else t for n, t in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    source = resolve_model(str(folder))
    model = load_model(source, torch.float32, torch.device("cpu"), quantization=resolve_quantization(None, source.hf_config))
    name = "model.layers.0.mlp.down_proj"
    expected = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"].float()
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight, expected, rtol=0, atol=0)


def test_fp8_checkpoint_weight_that_is_not_float8_is_refused(root):
    """A full-precision weight under an fp8 quantization_config (its scales kept, or a dequantized export)
    would be cast to fp8 and multiplied by the scale again: silent wrong weights. Refused by name and dtype."""
    from safetensors.torch import load_file, save_file

    ct_folder, _ = compressed_tensors_checkpoint(root, "FP8", "llama", seed=3)
    folder = root / "fp8-bf16-weight"
    shutil.copytree(ct_folder, folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj"
    tensors[f"{name}.weight"] = (tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"].float()).bfloat16()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.weight.*torch.bfloat16.*float8_e4m3fn"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)


@pytest.mark.parametrize("kind", ["ct-asym", "gptq", "gptq-act-order", "ct-act-order"])
def test_tensor_parallel_ranks_hold_their_slices_of_packed_weights(root, kind):
    """Each of two ranks dequantizes exactly its rows (column parallel) or columns (row parallel)
    of the reference weights; group 64 so the 384 inputs of down_proj split at a group edge. With
    act-order a row-parallel rank's features belong to any group: it keeps every group's scales."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.quantization.config import resolve_quantization

    if kind in ("gptq", "gptq-act-order", "ct-act-order"):
        folder, reference = gptq_awq_checkpoint(root / "tp", kind.split("-")[0], False, group_size=64,
                                                act_order=kind.endswith("act-order"))
    else:
        folder, reference = compressed_tensors_checkpoint(root / "tp", "W4A16_ASYM", "llama", seed=5, group_size=64)
    source = resolve_model(str(folder))
    quant = resolve_quantization(None, source.hf_config)
    full = hf_model(str(reference)).model.layers[1]
    for rank in (0, 1):
        layer = load_model(source, torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=2, quantization=quant).model.layers[1]
        q, k = full.self_attn.q_proj.weight, full.self_attn.k_proj.weight
        half_q, half_k = q.shape[0] // 2, k.shape[0] // 2
        qkv = torch.cat([q[rank * half_q : (rank + 1) * half_q], k[rank * half_k : (rank + 1) * half_k],
                         full.self_attn.v_proj.weight[rank * half_k : (rank + 1) * half_k]])
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
        down = full.mlp.down_proj.weight
        torch.testing.assert_close(layer.mlp.down_proj.weight, down[:, rank * 192 : (rank + 1) * 192], rtol=0, atol=0)


def test_dummy_weights_for_a_w4a16_config(root):
    """load_format="dummy" with a quantization_config makes random packed weights (the GPU benchmarks'
    8B W4A16 model); on the CPU they dequantize to finite weights of the usual magnitude."""
    folder = root / "dummy-w4a16"
    config = tiny_config()
    config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    _check_dummy_weights(folder, config)


def _check_dummy_weights(folder: Path, config) -> None:
    """``config`` saved to ``folder`` and loaded with load_format="dummy": the weights (dequantized on
    the CPU) are finite and of the usual magnitude, and the engine generates."""
    config.save_pretrained(folder)
    llm = LLM(str(folder), device="cpu", load_format="dummy", skip_tokenizer_init=True, max_model_len=32,
              kv_cache_memory_bytes=2**22)
    weight = llm.llm_engine.executor.driver.model.model.layers[0].mlp.down_proj.weight
    assert torch.isfinite(weight).all() and 0.005 < float(weight.std()) < 0.05
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_unsupported_quantization_is_refused_with_what_is_supported(tiny_llama_dir, root):
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes'.*supported: None, 'fp8', 'compressed-tensors', 'gptq', 'awq'"):
        LLM(str(tiny_llama_dir), device="cpu", quantization="bitsandbytes")
    with pytest.raises(ValueError, match="needs a checkpoint quantized that way"):
        LLM(str(tiny_llama_dir), device="cpu", quantization="gptq")
    folder, _ = gptq_awq_checkpoint(root / "refuse", "gptq", True)
    with pytest.raises(ValueError, match=r"quantization='awq'\) does not match the checkpoint.*'gptq'"):
        LLM(str(folder), device="cpu", quantization="awq")
    for change, message in (({"desc_act": "yes"}, "desc_act='yes' is not supported; supported: true or false"),
                            ({"bits": 8}, "bits=8 is not supported; supported: 4"),
                            ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported")):
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(change)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), device="cpu")
        config["quantization_config"] = {k: v for k, v in config["quantization_config"].items() if k not in change}
        config["quantization_config"].update({"bits": 4, "desc_act": False, "quant_method": "gptq"})
        (folder / "config.json").write_text(json.dumps(config))


def test_modelopt_checkpoint_with_hf_quant_config_json_is_refused_by_name(tiny_llama_dir, tmp_path):
    """NVIDIA ModelOpt (< 0.29) writes its quantization beside config.json, which then has no
    quantization_config; vLLM reads that file as the checkpoint's quantization. Unread, LLM() loaded
    such a folder as full precision: its fp8 weights met only "unexpected tensors ... weight_scale"."""
    folder = tmp_path / "modelopt"
    shutil.copytree(tiny_llama_dir, folder)
    # nvidia/Llama-3.1-70B-Instruct-FP8's hf_quant_config.json, as vendored by ai-dynamo/aiconfigurator
    # (model_configs/nvidia--Llama-3.1-70B-Instruct-FP8_hf_quant_config.json).
    (folder / "hf_quant_config.json").write_text("""{
  "producer": {
      "name": "modelopt",
      "version": "0.23.0"
  },
  "quantization": {
      "quant_algo": "FP8",
      "kv_cache_quant_algo": "FP8",
      "exclude_modules": [
          "lm_head"
      ]
  }
}""")
    with pytest.raises(ValueError, match=r"hf_quant_config\.json: .*ModelOpt.*quant_algo='FP8' is not supported; "
                                         r"supported: .*'fp8', 'compressed-tensors', 'gptq', 'awq'"):
        LLM(str(folder), device="cpu")


def test_unsupported_compressed_tensors_scheme_is_refused(root):
    from tokenmill.quantization.config import resolve_quantization

    config = tiny_config()
    config.quantization_config = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                                      "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}},
    }
    with pytest.raises(ValueError, match=r"config_groups.group_0.weights=.*not supported; supported: FP8 W8A8"):
        resolve_quantization(None, config)


def test_a_quantized_lm_head_is_refused(root):
    """The LM head stays in the model's dtype. GPTQ's lm_head=true is refused by the field; a compressed-tensors
    checkpoint whose lm_head was quantized (not in ignore) by the loader, naming its packed tensors (vLLM loads
    its LM head unquantized whatever the config says, so the config alone does not prove the tensors packed)."""
    from tokenmill.quantization.config import resolve_quantization

    config = tiny_config()
    config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "lm_head": True}
    with pytest.raises(ValueError, match=r"quantization_config.lm_head=True is not supported; supported: false"):
        resolve_quantization(None, config)
    folder, _ = compressed_tensors_checkpoint(root, "W4A16", "llama", seed=8, ignore=())
    with pytest.raises(ValueError, match=r"missing tensors \(1\) lm_head.weight; unexpected tensors .*lm_head.weight_packed"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**22)


def _projections(layers: tuple[int, ...], names: str) -> tuple[str, ...]:
    """Full module names of the projections ``names`` ("qkvo" attention, "gud" MLP) in ``layers``."""
    full = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "g": "mlp.gate_proj", "u": "mlp.up_proj", "d": "mlp.down_proj"}
    return tuple(f"model.layers.{i}.{full[p]}" for i in layers for p in names)


@pytest.mark.parametrize("fmt, fields, full_precision", [
    ("awq", {"modules_to_not_convert": ["model.layers.0"]}, _projections((0,), "qkvogud")),  # a layer prefix
    ("gptq", {"modules_to_not_convert": ["self_attn"]}, _projections((0, 1), "qkvo")),  # a module inside each layer
    ("awq", {"modules_to_not_convert": ["lm_head", "layers.1.mlp"]}, _projections((1,), "gud")),
    ("gptq", {"modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                                               ["self_attn.o_proj"]]}, _projections((0, 1), "gud")),
])
def test_gptq_awq_module_lists_keep_the_modules_vllm_keeps_in_full_precision(root, fmt, fields, full_precision):
    """vLLM matches AWQ's modules_to_not_convert and GPTQ's modules_in_block_to_quantize anywhere in a
    layer's name (is_layer_skipped's "substring" mode, is_layer_gptq_quantized), as AutoAWQ skipped
    modules when it wrote them: a layer prefix or a module inside each layer names them too, not a
    suffix only. The checkpoints keep exactly those projections as plain weights; against HF."""
    folder, reference = gptq_awq_checkpoint(root, fmt, False, seed=5, full_precision=full_precision, quant_fields=fields,
                                            tag=f"-{len(full_precision)}-{sorted(fields)[0]}")
    _check_against_hf(folder, reference)


def test_gptq_awq_module_lists_match_as_vllm_matches_them():
    """vLLM's substring rule, module by module: "model.layers.1" names layers 10-19 too, "mlp.gate" the MoE
    router and gate_proj; stacked gate/up named apart are refused (vLLM: "some but not all shards");
    a list that is not of module names is refused by its field."""
    from tokenmill.quantization.config import resolve_quantization

    config = tiny_config()
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    config.quantization_config = {**awq, "modules_to_not_convert": ["model.layers.1", "mlp.gate", "lm_head"]}
    quant = resolve_quantization(None, config)
    kept = [name for name in ("model.layers.1.self_attn.q_proj", "model.layers.10.mlp.down_proj", "model.layers.3.mlp.gate",
                              "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj", "model.layers.2.self_attn.o_proj")
            if quant.scheme_for([name]) is None]
    assert kept == ["model.layers.1.self_attn.q_proj", "model.layers.10.mlp.down_proj", "model.layers.3.mlp.gate",
                    "model.layers.3.mlp.gate_proj"]
    with pytest.raises(ValueError, match="projections stacked into one matmul different schemes"):
        quant.scheme_for(["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"])
    for field, value in (("modules_to_not_convert", "lm_head"), ("modules_in_block_to_quantize", [["q_proj", 3]])):
        config.quantization_config = {**awq, "quant_method": "gptq", field: value}
        with pytest.raises(ValueError, match=rf"quantization_config.{field}=.* is not supported; supported: a list of module names"):
            resolve_quantization(None, config)


def test_a_missing_or_non_integer_group_size_is_refused_by_name():
    from tokenmill.quantization.config import resolve_quantization

    config = tiny_config()
    w4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": None}
    for quant, where in (({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"g": {"targets": ["Linear"], "weights": w4}}}, "config_groups.g.weights.group_size"),
                         ({"quant_method": "gptq", "bits": 4, "group_size": None}, "group_size"),
                         ({"quant_method": "awq", "bits": 4, "group_size": "128"}, "group_size")):
        config.quantization_config = quant
        with pytest.raises(ValueError, match=rf"quantization_config.{where}=.* is not supported; supported: -1"):
            resolve_quantization(None, config)


def test_w4a16_tiles_follow_the_measured_rule():
    """choose_config on Llama-3-8B's projections at 132 SMs (the H200): two warpgroups with 256 outputs a
    program only for the wide gate_up from 32 tokens, where the sweep measured it 6-24% faster
    (docs/perf.md entry 27), one warpgroup with 128 elsewhere; past SWAPPED_MAX_M the prefill tile."""
    from tokenmill.kernels.triton.w4a16_gemm import SWAPPED_MAX_M, choose_config

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (n, k) in shapes.items():
        for m in (1, 16, 32, 48, 64, 96, 128):
            cfg = choose_config(m, n, k, 128, 132)
            wide = name == "gate_up" and m >= 32
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == ((256, 8) if wide else (128, 4)), (name, m, cfg)
            if wide:  # the splits the sweep's winners ran with
                assert cfg["split_k"] == {32: 2, 48: 2, 64: 2, 96: 1, 128: 1}[m], (m, cfg)
    assert choose_config(SWAPPED_MAX_M + 1, 28672, 4096, 128, 132)["BLOCK_M"] == 128



@pytest.mark.slow  # 12 s (two rank processes); test_tensor_parallel_ranks_hold_their_slices_... checks the slices fast
def test_act_order_checkpoint_under_tensor_parallelism_matches_hf(root):
    """Two ranks over gloo: the row-parallel layers' g_idx split with their input features, every
    group's scales on both ranks."""
    folder, reference = gptq_awq_checkpoint(root / "tp-act-order", "gptq", False, group_size=64, seed=14, act_order=True)
    _check_against_hf(folder, reference, tensor_parallel_size=2)
