"""Tiny quantized checkpoints made without tokenmill, and the full-precision weights they stand for.

- compressed-tensors: the package's own scheme presets, its qparam computation and its compressors
  write the folder; its decompressors, run on the tensors read back from the file, give the
  reference weights.
- Block-wise fp8 (HF's ``quant_method: "fp8"``, ``weight_block_size: [128, 128]``): transformers'
  own FineGrainedFP8 quantizer op (``Fp8Quantize``, plain torch) writes each projection's codes and
  ``weight_scale_inv``; a weight whose sides are not multiples of 128, which that op leaves
  unquantized, gets random fp8 codes and block scales drawn instead. The reference weight is
  transformers' own dequantization (``_dequantize_fp8_weight``: code * scale over each block, the
  last ones partial) of the tensors written.
- GPTQ and AWQ: random 4-bit codes, zero points and fp16 scales are drawn first; the reference
  weight is ``(code - zero) * scale`` of those integers. Activation order (GPTQ ``desc_act``,
  compressed-tensors ``actorder: "group"``, which compressed-tensors itself no longer writes) also
  draws each feature's group first, ``g_idx = randperm(K) // group_size`` (what act-order
  quantization gives: groups of consecutive features in a permuted order), shared by the
  projections of one input as in a real checkpoint; the reference is then
  ``(code - zero[g_idx[k]]) * scale[g_idx[k]]``. The folder holds them packed per each
  format's documented layout (GPTQ: codes packed along the input features, zeros stored minus one;
  AWQ: packed along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7), packed by compressed-tensors'
  ``pack_to_int32`` (8 codes a word, lowest index in the lowest bits).

Each builder returns (quantized folder, reference folder): the reference is the same HF model in
fp32 with the reference weights, for transformers to run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from support.tiny_models import build_tiny_tokenizer, randomize_weights, tiny_config_kwargs

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def tiny_config(family: str = "llama", **overrides: Any) -> Any:
    """Large enough for 128-feature groups: hidden 256 (2 groups), intermediate 384 (3 groups)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = tiny_config_kwargs(**{**dict(hidden_size=256, intermediate_size=384, num_attention_heads=4,
                                          num_key_value_heads=2, tie_word_embeddings=False), **overrides})
    if family == "qwen2":
        return Qwen2Config(**kwargs, architectures=["Qwen2ForCausalLM"])
    if family == "qwen3":
        return Qwen3Config(**kwargs, architectures=["Qwen3ForCausalLM"])
    return LlamaConfig(**kwargs, architectures=["LlamaForCausalLM"])


def random_model(config: Any, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    return model.eval()


def _save_reference(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in weights:
                param.copy_(weights[name])
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def compressed_tensors_checkpoint(root: Path, preset: str, family: str = "llama", seed: int = 0,
                                  group_size: int | None = None, ignore: tuple[str, ...] = ("lm_head",),
                                  more_groups: tuple[tuple[str, list[str]], ...] = (),
                                  actorder: str | None = None) -> tuple[Path, Path]:
    """A compressed-tensors folder quantized with ``preset`` (W4A16, W4A16_ASYM, FP8, FP8_DYNAMIC, FP8_BLOCK) for
    every Linear not in ``ignore``, its 4-bit groups of ``group_size`` features when given (the presets
    use 128; -1: per channel); ``more_groups``: further (preset, targets) groups after it, which
    compressed-tensors lets win over "Linear" for the modules their names or regexes match."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file

    config = tiny_config(family)
    model = random_model(config, seed)
    input_peaks = _calibrate_input_peaks(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size == -1:  # one scale per output channel
        scheme.weights.strategy, scheme.weights.group_size = "channel", None
    elif group_size is not None:
        scheme.weights.group_size = group_size
    if actorder is not None:
        scheme.weights.actorder = actorder
    groups = {"group_0": scheme}
    groups.update({f"group_{i + 1}": preset_name_to_scheme(p, targets) for i, (p, targets) in enumerate(more_groups)})
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=list(ignore)), show_progress=False)
    schemes = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        schemes[name] = module.quantization_scheme
        weight, args = module.weight.data, module.quantization_scheme.weights
        if args.strategy == "group":
            grouped = weight.unflatten(-1, (-1, args.group_size))
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "block":  # [N / bn, bn, K / bk, bk]: a range per block
            (bn, bk), (n, k) = args.block_structure, weight.shape
            blocks = weight.reshape(n // bn, bn, k // bk, bk)
            low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        elif args.strategy == "channel":
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        else:
            low, high = weight.amin(), weight.amax()
        scale, zero_point = calculate_qparams(low, high, args)  # what llm-compressor's min-max observer does
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale"):
            # A static activation scale as llm-compressor's min-max observer calibrates it: the largest
            # |input| seen on the calibration prompts over the format's largest value (448 for fp8 e4m3).
            fp8_max = torch.finfo(torch.float8_e4m3fn).max
            module.input_scale.data.fill_(input_peaks[name] / fp8_max)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    variant = f"-ignore{len(ignore)}" if ignore != ("lm_head",) else ""
    variant += "".join(f"-{p.lower()}" for p, _ in more_groups) + (f"-actorder-{actorder}" if actorder else "")
    folder = root / f"ct-{preset.lower()}-{family}-seed{seed}-g{group_size}{variant}"
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    build_tiny_tokenizer().save_pretrained(folder)

    # The reference: compressed-tensors' decompression of the tensors as written to the file.
    stored = load_file(folder / "model.safetensors")
    quant_config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    weights: dict[str, torch.Tensor] = {}
    for name, group in schemes.items():  # the ignored modules keep their full-precision weights
        decompressor = BaseCompressor.get_value_from_registry(group.format or quant_config.format)
        local = {n[len(name) + 1 :]: t for n, t in stored.items() if n.startswith(name + ".")}
        weights[f"{name}.weight"] = decompressor.decompress(local, group)["weight"].float()
    return folder, _save_reference(random_model(tiny_config(family), seed), weights, root / f"{folder.name}-reference")


def _calibrate_input_peaks(model: torch.nn.Module, prompts: int = 32, length: int = 160,
                          seed: int = 1234) -> dict[str, float]:
    """The largest |input| of each projection over calibration prompts of random ids 3..279 (as the
    tests' prompts are drawn, with other seeds), run through the full-precision model; llm-compressor
    calibrates on a few hundred samples, 32 of the tests' longest length cover this tiny model's range."""
    import random

    rng = random.Random(seed)
    peaks: dict[str, float] = {}

    def record(name: str):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            peaks[name] = max(peaks.get(name, 0.0), float(args[0].abs().max()))
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in model.named_modules()
               if name.rsplit(".", 1)[-1] in PROJECTIONS]
    with torch.no_grad():
        model(torch.tensor([[rng.randrange(3, 280) for _ in range(length)] for _ in range(prompts)]))
    for handle in handles:
        handle.remove()
    return peaks


def _draw_int4(weight: torch.Tensor, group_size: int, symmetric: bool, gen: torch.Generator,
               scale_dtype: torch.dtype = torch.float16, g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Codes [N, K], zeros [N, G] and scales [N, G] near the weight's magnitude (in ``scale_dtype``,
    fp16 as GPTQ and AWQ write them), and the reference weight; group_size -1: one group per row;
    ``g_idx``: each feature's group (act-order), else feature // group_size."""
    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    groups = k // group_size
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.full((n, groups), 8) if symmetric else torch.randint(1, 16, (n, groups), generator=gen)
    scales = (weight.abs().unflatten(1, (groups, group_size)).amax(-1) / 8 * (0.5 + torch.rand(n, groups, generator=gen)))
    scales = scales.to(scale_dtype)
    if g_idx is None:
        g_idx = torch.arange(k) // group_size
    expanded = lambda t: t[:, g_idx]  # noqa: E731
    reference = (codes - expanded(zeros)).float() * expanded(scales).float()
    return codes, zeros, scales, reference


def _pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    # pack_to_int32 takes signed 4-bit values and stores value + 8: hand it code - 8.
    return pack_to_int32((codes - 8).to(torch.int8), 4, packed_dim=dim)


def gptq_awq_checkpoint(root: Path, fmt: str, symmetric: bool, family: str = "llama", group_size: int = 128,
                        seed: int = 0, scale_dtype: torch.dtype = torch.float16,
                        gptq_format: str = "gptq", full_precision: tuple[str, ...] = (),
                        quant_fields: dict[str, Any] | None = None, tag: str = "",
                        act_order: bool = False) -> tuple[Path, Path]:
    """A GPTQ (``gptq_format`` "gptq" stores zeros minus one, "gptq_v2" as they are), AWQ (GEMM) or
    compressed-tensors ``pack-quantized`` ("ct") folder; see the module docstring. group_size -1: per
    output channel. ``act_order``: GPTQ desc_act=True / compressed-tensors actorder "group", g_idx drawn.
    ``full_precision``: projections (full module names) stored as plain weights, unquantized;
    ``quant_fields``: more quantization_config fields (the lists that name those modules); ``tag``
    tells such folders apart."""
    from safetensors.torch import save_file

    config = tiny_config(family)
    model = random_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    tensors: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    drawn_g_idx: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if module.rsplit(".", 1)[-1] not in PROJECTIONS or kind != "weight" or module in full_precision:
            tensors[name] = param.detach().clone()
            continue
        k = param.shape[1]
        g_idx = torch.arange(k) // (k if group_size == -1 else group_size)
        if act_order:  # one draw per input: q/k/v share theirs, gate/up theirs
            key = module.rsplit(".", 1)[0] + ("." + module.rsplit(".", 1)[1] if module.endswith(("o_proj", "down_proj")) else "")
            g_idx = drawn_g_idx.setdefault(key, g_idx[torch.randperm(k, generator=gen)])
        codes, zeros, scales, weights[name] = _draw_int4(param.detach(), group_size, symmetric, gen, scale_dtype, g_idx)
        if fmt == "gptq":
            tensors[f"{module}.qweight"] = _pack(codes.t(), 0)  # [K/8, N]
            # [G, N/8]; v1 stores them minus one
            tensors[f"{module}.qzeros"] = _pack(zeros.t() - int(gptq_format == "gptq"), 1)
            tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
            tensors[f"{module}.scales"] = scales.t().contiguous()  # [G, N]
        elif fmt == "ct":  # compressed-tensors pack-quantized: packed along K, zero points along N
            tensors[f"{module}.weight_packed"] = _pack(codes, 1)  # [N, K/8]
            tensors[f"{module}.weight_scale"] = scales.contiguous()  # [N, G]
            if not symmetric:
                tensors[f"{module}.weight_zero_point"] = _pack(zeros, 0)  # [N/8, G]
            tensors[f"{module}.weight_shape"] = torch.tensor(list(codes.shape), dtype=torch.int64)
            if act_order:
                tensors[f"{module}.weight_g_idx"] = g_idx.to(torch.int32)
        else:
            order = torch.tensor(AWQ_ORDER)
            in_awq_order = lambda t: t.unflatten(1, (-1, 8))[..., order].flatten(1)  # noqa: E731
            tensors[f"{module}.qweight"] = _pack(in_awq_order(codes.t()), 1)  # [K, N/8]
            tensors[f"{module}.qzeros"] = _pack(in_awq_order(zeros.t()), 1)  # [G, N/8]
            tensors[f"{module}.scales"] = scales.t().contiguous()  # [G, N]
    dtype_name = str(scale_dtype).removeprefix("torch.")
    tag += "-act-order" if act_order else ""
    folder = root / f"{fmt}-{'sym' if symmetric else 'asym'}-{family}-seed{seed}-g{group_size}-{dtype_name}-{gptq_format}{tag}"
    folder.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    if fmt == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
                 "checkpoint_format": gptq_format}
    elif fmt == "ct":
        weight_args = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group" if group_size != -1 else "channel",
                       "group_size": group_size if group_size != -1 else None, "actorder": "group" if act_order else None}
        quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args}}}
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": not symmetric, "version": "gemm"}
    config.quantization_config = {**quant, **(quant_fields or {})}
    config.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder, _save_reference(random_model(tiny_config(family), seed), weights, root / f"{folder.name}-reference")


def fp8_fake_quantized_reference(root: Path, folder: Path, family: str = "llama") -> Path:
    """The full-precision checkpoint in ``folder`` with every projection quantized to fp8 per output
    channel and back by compressed-tensors (what quantization="fp8" should load). A mixture-of-experts
    model's experts too (transformers holds them stacked, [E, out, in]: each expert's rows); its router
    stays as it is."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    args = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).weights
    weights = {}
    for name, param in model.named_parameters():
        stacked_experts = ".experts." in name and param.dim() == 3
        if (name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS) or stacked_experts:  # not biases
            w = param.detach().flatten(0, -2)  # [rows, in]: a scale per output row, of every expert
            scale, zero_point = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), args)
            weights[name] = dequantize(quantize(w, scale, zero_point, args), scale, zero_point, args).float().view(param.shape)
    return _save_reference(model, weights, root / f"{folder.name}-fp8-reference")


def block_fp8_checkpoint(root: Path, family: str = "qwen3", seed: int = 0, full_precision: tuple[str, ...] = (),
                         tag: str = "", **config_overrides: Any) -> tuple[Path, Path]:
    """An HF block-wise fp8 folder (transformers' FineGrainedFP8Config, as Qwen3-*-FP8 ship it; see the
    module docstring); ``full_precision``: projections (full module names) kept as plain weights and
    named in modules_to_not_convert; ``config_overrides``: the tiny config's sizes (partial blocks)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight

    config = tiny_config(family, **config_overrides)
    model = random_model(config, seed)
    quant = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=["lm_head", *full_precision])
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=quant))
    gen = torch.Generator().manual_seed(seed + 100)
    tensors: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        weight = param.detach()
        if module.rsplit(".", 1)[-1] not in PROJECTIONS or kind != "weight" or module in full_precision:
            tensors[name] = weight.clone()
            continue
        scale_name = f"{module}.weight_scale_inv"
        n, k = weight.shape
        if n % 128 == 0 and k % 128 == 0:
            written = quantize.convert({name: weight})
            codes, scales = written[name], written[scale_name]
        else:  # left unquantized by Fp8Quantize: codes and block scales drawn
            codes = (torch.randn(n, k, generator=gen) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
            scales = float(weight.abs().max()) / 448 * (0.5 + torch.rand(-(-n // 128), -(-k // 128), generator=gen))
        tensors[name], tensors[scale_name] = codes, scales.float()
        weights[name] = _dequantize_fp8_weight(codes, scales.float(), [128, 128], torch.float32)
    folder = root / f"block-fp8-{family}-seed{seed}-{len(full_precision)}{tag}"
    folder.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config.quantization_config = json.loads(quant.to_json_string())
    config.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    reference = random_model(tiny_config(family, **config_overrides), seed)
    return folder, _save_reference(reference, weights, root / f"{folder.name}-reference")


def block_fp8_moe_checkpoint(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE (hidden 256, 4 experts of 128, 2 a token) saved by transformers, every attention
    and expert projection (not the router) then quantized by transformers' Fp8Quantize as Qwen3-30B-A3B-FP8
    ships them; the reference: the same folder with each weight replaced by transformers' dequantization."""
    import shutil
    from types import SimpleNamespace

    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config, Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight

    config = Qwen3MoeConfig(**tiny_config_kwargs(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                 tie_word_embeddings=False),
                            moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                            architectures=["Qwen3MoeForCausalLM"])
    full = root / f"qwen3-moe-seed{seed}-full"
    random_model(config, seed).save_pretrained(full)
    build_tiny_tokenizer().save_pretrained(full)
    quant = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=["lm_head"])
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=quant))
    stored, weights = {}, {}
    for name, tensor in load_file(full / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if module.rsplit(".", 1)[-1] in PROJECTIONS and kind == "weight":
            written = quantize.convert({name: tensor})
            stored.update(written)
            weights[name] = _dequantize_fp8_weight(written[name], written[f"{module}.weight_scale_inv"], [128, 128], torch.float32)
        else:
            stored[name] = weights[name] = tensor
    folder, reference = root / f"block-fp8-qwen3-moe-seed{seed}", root / f"block-fp8-qwen3-moe-seed{seed}-reference"
    for target, tensors in ((folder, stored), (reference, weights)):
        shutil.copytree(full, target)
        save_file({n: t.contiguous() for n, t in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    config.quantization_config = json.loads(quant.to_json_string())
    config.save_pretrained(folder)
    return folder, reference
