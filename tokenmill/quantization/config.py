"""Which quantization a model runs with: from ``LLM(quantization=...)`` and config.json's ``quantization_config``.

The weights supported, each with the checkpoint layouts that carry it:
- FP8 (float8 e4m3 weights, activations quantized to fp8 per token or with a static per-tensor
  scale): compressed-tensors ``float-quantized`` W8A8 (per-tensor or per-channel weight scales),
  checkpoints with ``quant_method: "fp8"`` (per-tensor scales), and ``quantization="fp8"`` on a
  bf16/fp16/fp32 checkpoint (per-channel scales computed while loading).
- Block-wise FP8 (a weight scale per 128 x 128 block, activations quantized per token and
  128-feature group, dynamically): ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]``
  (Qwen3-*-FP8, DeepSeek-style; transformers' FineGrainedFP8) and compressed-tensors'
  ``strategy: "block"`` (llm-compressor's FP8_BLOCK).
- W4A16 (4-bit integer weights in groups along the input features, 16-bit activations):
  compressed-tensors ``pack-quantized`` (``actorder`` null, "weight" or "group"), GPTQ (``desc_act``
  true or false) and AWQ (GEMM layout). Activation-order checkpoints (GPTQ ``desc_act=True``,
  compressed-tensors ``actorder: "group"``) store a ``g_idx`` per layer, the group of each input
  feature; w4a16.py reads it.

Everything else is refused here with the field, the value and what is supported, before any
weight is read. ``QuantizationConfig`` is frozen and plain data: it travels to tensor-parallel
worker processes inside the EngineConfig.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenmill.param_checks import is_int

# vLLM's names for the methods we run; vLLM's kernel-specific spellings load the same checkpoints.
SUPPORTED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}
# The only weight block the block-wise fp8 kernels take (every such checkpoint we know of uses it):
# a K step of the GEMM is one block, so one scale pair a step.
WEIGHT_BLOCK = 128


@dataclass(frozen=True)
class Fp8Scheme:
    """float8 e4m3 weights with fp32 scales; activations quantized to fp8 before each GEMM."""

    # "block": a scale per WEIGHT_BLOCK x WEIGHT_BLOCK block of the weight, activations per token and group
    weight_scales: Literal["tensor", "channel", "block"]
    activations: Literal["dynamic", "static"]  # dynamic: a scale per token; static: the checkpoint's input_scale
    quantize_at_load: bool = False  # the checkpoint holds full-precision weights (quantization="fp8")
    # The checkpoint's name of the block scales: "weight_scale_inv" (HF's, despite the name a
    # multiplier: weight = code * scale) or compressed-tensors' "weight_scale".
    block_scale_name: str = "weight_scale"


@dataclass(frozen=True)
class Int4Scheme:
    """4-bit integer weights, a scale (and a zero point when asymmetric) per group of input features."""

    layout: Literal["compressed-tensors", "gptq", "awq"]
    group_size: int  # -1: one group over all input features (per-channel)
    symmetric: bool
    gptq_zeros_minus_one: bool = False  # GPTQ's original ("v1") format stores each zero point minus 1
    # The checkpoint's g_idx (GPTQ's g_idx, compressed-tensors' weight_g_idx) gives each input feature's
    # group, which need not be feature // group_size (activation order); off: that plain order.
    act_order: bool = False


Scheme = Fp8Scheme | Int4Scheme


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # one of SUPPORTED_METHODS
    # (targets, scheme) in config order. A layer takes the group whose target is its full name, else
    # the one whose "re:" regex matches it, else the one targeting "Linear" (all layers): compressed-
    # tensors' precedence, so a mixed-precision checkpoint's specific groups win over its catch-all.
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]
    ignore: tuple[str, ...] = ()  # module names, "re:<regex>" patterns or suffixes kept in full precision

    @property
    def from_checkpoint(self) -> bool:
        """Whether the checkpoint itself is quantized (its own scales and packed weights), rather
        than full precision quantized while loading (``quantization="fp8"``)."""
        return not all(getattr(scheme, "quantize_at_load", False) for _, scheme in self.groups)

    def scheme_for(self, module_names: Sequence[str]) -> Scheme | None:
        """The scheme of a layer whose checkpoint modules are ``module_names`` (several for stacked
        q/k/v or gate/up, which must agree), or None when the layer stays in full precision."""
        found = {name: self._scheme_of(name) for name in module_names}
        schemes = set(found.values())
        if len(schemes) > 1:
            raise ValueError(
                f"quantization_config gives the projections stacked into one matmul different schemes: {found}; "
                "tokenmill needs q/k/v (and gate/up) quantized alike"
            )
        return schemes.pop()

    def _scheme_of(self, name: str) -> Scheme | None:
        if any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for matches in (lambda t: t == name, lambda t: t.startswith("re:") and _matches(t, name), lambda t: t == "Linear"):
            for targets, scheme in self.groups:
                if any(matches(target) for target in targets):
                    return scheme
        return None

    def describe(self) -> str:
        return f"{self.method} ({', '.join(sorted({_describe(s) for _, s in self.groups}))})"


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _describe(scheme: Scheme) -> str:
    if isinstance(scheme, Fp8Scheme):
        if scheme.weight_scales == "block":
            return f"fp8 weights per {WEIGHT_BLOCK}x{WEIGHT_BLOCK} block, dynamic activation scales per {WEIGHT_BLOCK}-group"
        return f"fp8 weights per {scheme.weight_scales}, {scheme.activations} activation scales"
    group = "per channel" if scheme.group_size == -1 else f"group {scheme.group_size}"
    order = " act-order" if scheme.act_order else ""
    return f"{scheme.layout} int4 {group} {'symmetric' if scheme.symmetric else 'asymmetric'}{order}"


def refuse_modelopt_file(folder: Path, hf_config: Any) -> None:
    """NVIDIA ModelOpt before 0.29 writes a checkpoint's quantization to ``hf_quant_config.json``,
    beside a config.json without quantization_config; vLLM takes that file as the quantization
    config. tokenmill does not run ModelOpt checkpoints: refused here by the file's name, where read
    as full precision its quantized weights met only a loader error naming their scale tensors."""
    path = folder / "hf_quant_config.json"
    if getattr(hf_config, "quantization_config", None) is not None or not path.is_file():
        return
    try:
        section = json.loads(path.read_text()).get("quantization") or {}
    except (OSError, ValueError, AttributeError):
        section = {}
    algo = section.get("quant_algo") if isinstance(section, dict) else None
    raise ValueError(
        f"{path}: an NVIDIA ModelOpt checkpoint, whose quantization.quant_algo={algo!r} is not supported; supported: "
        f"config.json's quantization_config with quant_method {', '.join(map(repr, SUPPORTED_METHODS))}"
    )


def resolve_quantization(quantization: str | None, hf_config: Any) -> QuantizationConfig | None:
    """What the model runs with: the checkpoint's own quantization_config, or ``quantization="fp8"``
    applied at load time to a full-precision checkpoint. ValueError for anything we do not run."""
    if quantization is not None:
        if not isinstance(quantization, str) or _ALIASES.get(quantization, quantization) not in SUPPORTED_METHODS:
            raise ValueError(
                f"LLM(quantization={quantization!r}) is not supported; supported: None, {', '.join(map(repr, SUPPORTED_METHODS))} "
                "(pre-quantized checkpoints are detected from config.json, so None is enough for them)"
            )
        quantization = _ALIASES.get(quantization, quantization)
    stored = getattr(hf_config, "quantization_config", None)
    if stored is None:
        # Older compressed-tensors (sparseml) checkpoints write the same section under this name;
        # vLLM reads it too. Unread, their packed tensors would only meet a loader error.
        stored = getattr(hf_config, "compression_config", None)
    if stored is not None and not isinstance(stored, dict):
        stored = stored.to_dict()  # a transformers QuantizationConfigMixin
    if not stored:
        if quantization in (None, "fp8"):
            return None if quantization is None else QuantizationConfig(
                "fp8", ((("Linear",), Fp8Scheme("channel", "dynamic", quantize_at_load=True)),)
            )
        raise ValueError(
            f"LLM(quantization={quantization!r}) needs a checkpoint quantized that way, but config.json has no "
            "quantization_config; for weights quantized while loading use quantization='fp8'"
        )
    method = stored.get("quant_method")
    method = _ALIASES.get(method, method)
    if method not in SUPPORTED_METHODS:
        raise ValueError(
            f"config.json's quantization_config.quant_method={method!r} is not supported; "
            f"supported: {', '.join(map(repr, SUPPORTED_METHODS))}"
        )
    if quantization is not None and quantization != method:
        raise ValueError(
            f"LLM(quantization={quantization!r}) does not match the checkpoint, whose config.json says "
            f"quant_method={method!r}; pass quantization=None (or {method!r})"
        )
    parse = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8_checkpoint}[method]
    return parse(stored)


def _refuse(where: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{where}={value!r} is not supported; supported: {supported}")


def _compressed_tensors(cfg: dict) -> QuantizationConfig:
    if cfg.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme", cfg["kv_cache_scheme"], "null (use LLM(kv_cache_dtype='fp8') for an fp8 cache)")
    if cfg.get("sparsity_config"):
        raise _refuse("sparsity_config", cfg["sparsity_config"], "empty (dense weights)")
    groups = []
    for name, group in (cfg.get("config_groups") or {}).items():
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise _refuse(f"config_groups.{name}.targets", group.get("targets"), "a list of module names")
        groups.append((targets, _compressed_tensors_scheme(f"config_groups.{name}", group, cfg.get("format"))))
    if not groups:
        raise _refuse("config_groups", cfg.get("config_groups"), "at least one group")
    return QuantizationConfig("compressed-tensors", tuple(groups), tuple(cfg.get("ignore") or ()))


def _compressed_tensors_scheme(where: str, group: dict, default_format: str | None) -> Scheme:
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or default_format
    supported = ("FP8 W8A8 (float-quantized, 8-bit float weights per tensor, channel or 128x128 block, activations "
                 "per token, per tensor or per 128-group) and W4A16 (pack-quantized, 4-bit int weights per group or channel)")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "null")
    if weights.get("type") == "float" and weights.get("num_bits") == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"{where}.format", fmt, "'float-quantized' for fp8 weights")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise _refuse(f"{where}.weights.strategy", weights.get("strategy"), "'tensor', 'channel' or 'block' for fp8 weights")
        if not inputs or inputs.get("type") != "float" or inputs.get("num_bits") != 8:
            raise _refuse(f"{where}.input_activations", inputs, f"8-bit float activations; schemes we run: {supported}")
        if weights["strategy"] == "block":
            return _compressed_tensors_block(where, weights, inputs)
        dynamic, strategy = bool(inputs.get("dynamic")), inputs.get("strategy")
        if (dynamic and strategy != "token") or (not dynamic and strategy != "tensor"):
            raise _refuse(f"{where}.input_activations", inputs, "dynamic per-token or static per-tensor fp8 scales")
        return Fp8Scheme(weights["strategy"], "dynamic" if dynamic else "static")
    if weights.get("type") == "int" and weights.get("num_bits") == 4 and not inputs:
        if fmt != "pack-quantized":
            raise _refuse(f"{where}.format", fmt, "'pack-quantized' for 4-bit weights")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise _refuse(f"{where}.weights.strategy", strategy, "'group' or 'channel' for 4-bit weights")
        # "weight" (alias "static") reordered features only while quantizing: the stored order is plain.
        # "group" (alias "dynamic"; True in older releases) stores weight_g_idx, each feature's group.
        actorder = weights.get("actorder")
        if actorder not in (None, False, True, "weight", "static", "group", "dynamic"):
            raise _refuse(f"{where}.weights.actorder", actorder, "null, 'weight' (or 'static') or 'group' (or 'dynamic')")
        group_size = weights.get("group_size") if strategy == "group" else -1
        return Int4Scheme("compressed-tensors", _check_group(f"{where}.weights.group_size", group_size),
                          bool(weights.get("symmetric", True)), act_order=actorder in (True, "group", "dynamic"))
    raise _refuse(f"{where}.weights", weights, supported)


def _compressed_tensors_block(where: str, weights: dict, inputs: dict) -> Fp8Scheme:
    """llm-compressor's FP8_BLOCK: weights in 128 x 128 blocks, activations dynamic per token and 128-group."""
    block = weights.get("block_structure")
    if block != [WEIGHT_BLOCK, WEIGHT_BLOCK]:
        raise _refuse(f"{where}.weights.block_structure", block, f"[{WEIGHT_BLOCK}, {WEIGHT_BLOCK}]")
    if weights.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", weights["dynamic"], "false (the checkpoint's own block scales)")
    if not weights.get("symmetric", True):
        raise _refuse(f"{where}.weights.symmetric", weights["symmetric"], "true")
    if not inputs.get("dynamic") or inputs.get("strategy") != "group" or inputs.get("group_size") != WEIGHT_BLOCK:
        raise _refuse(f"{where}.input_activations", inputs, f"dynamic fp8 scales per token and group of {WEIGHT_BLOCK} "
                      "features (strategy 'group') with block weights")
    return Fp8Scheme("block", "dynamic")


def _check_group(where: str, group_size: Any) -> int:
    # The W4A16 kernel walks K in tiles of 32-128 features that must stay inside one group. The value
    # is the config's as written: null or a string is refused by name, not a TypeError from int().
    if not is_int(group_size) or (group_size != -1 and (group_size <= 0 or group_size % 32 != 0)):
        raise _refuse(where, group_size, "-1 (per channel) or a multiple of 32 (128 is usual)")
    return group_size


def _gptq(cfg: dict) -> QuantizationConfig:
    if cfg.get("bits", 4) != 4:
        raise _refuse("bits", cfg.get("bits"), "4")
    # desc_act=True (activation order): each feature's group is its g_idx entry. With static_groups the
    # groups were fixed before the reordering, so g_idx is the plain order, which w4a16.py runs as such.
    desc_act = cfg.get("desc_act")
    if desc_act not in (None, False, True):
        raise _refuse("desc_act", desc_act, "true or false")
    if cfg.get("dynamic"):
        raise _refuse("dynamic", cfg["dynamic"], "empty (one scheme for every layer)")
    if cfg.get("lm_head"):  # GPTQModel saved the LM head packed too; ours loads only full-precision weights
        raise _refuse("lm_head", cfg["lm_head"], "false (the LM head in full precision)")
    fmt = cfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "'gptq' or 'gptq_v2'")
    scheme = Int4Scheme("gptq", _check_group("group_size", cfg.get("group_size", 128)), bool(cfg.get("sym", True)),
                        gptq_zeros_minus_one=fmt == "gptq", act_order=bool(desc_act))
    # GPTQ's own list names what was quantized (vLLM reads it; transformers' GPTQConfig writes it as
    # lists of a block's modules run together): every other layer keeps full-precision weights.
    quantized = _module_names("modules_in_block_to_quantize", cfg.get("modules_in_block_to_quantize"), nested=True)
    targets = _anywhere_in_the_name(quantized) if quantized else ("Linear",)
    return QuantizationConfig("gptq", ((targets, scheme),), _not_converted(cfg))


def _awq(cfg: dict) -> QuantizationConfig:
    bits = cfg.get("bits", cfg.get("w_bit", 4))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", cfg.get("version"), "'gemm' (the layout AutoAWQ writes by default)")
    group_size = cfg.get("group_size", cfg.get("q_group_size", 128))
    scheme = Int4Scheme("awq", _check_group("group_size", group_size), not cfg.get("zero_point", True))
    return QuantizationConfig("awq", ((("Linear",), scheme),), _not_converted(cfg))


def _not_converted(cfg: dict) -> tuple[str, ...]:
    """GPTQ's / AWQ's modules_to_not_convert as ignore patterns."""
    return _anywhere_in_the_name(_module_names("modules_to_not_convert", cfg.get("modules_to_not_convert")))


def _module_names(where: str, value: Any, nested: bool = False) -> list[str]:
    """A list of module names (or, ``nested``, of such lists, flattened); None stands for none."""
    if value is None:
        return []
    names = value
    if nested and isinstance(value, list):
        names = [name for item in value for name in (item if isinstance(item, list) else [item])]
    if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
        raise _refuse(where, value, "a list of module names" + (" (or of lists of them)" if nested else ""))
    return names


def _anywhere_in_the_name(names: list[str]) -> tuple[str, ...]:
    # vLLM matches GPTQ's and AWQ's module lists anywhere in a layer's name (is_layer_skipped's "substring"
    # mode; AutoAWQ skipped modules by the same test): "mlp.gate" names the MoE router and gate_proj
    # alike, "model.layers.1" layers 10-19 too, "lm_head" only the head. As "re:" patterns here.
    return tuple(f"re:.*{re.escape(name)}" for name in names)


def _fp8_checkpoint(cfg: dict) -> QuantizationConfig:
    activations = cfg.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _refuse("activation_scheme", activations, "'dynamic' or 'static'")
    if cfg.get("fmt", "e4m3") != "e4m3":  # DeepSeek's configs name the float8 format
        raise _refuse("fmt", cfg["fmt"], "'e4m3' (float8_e4m3fn weights)")
    if cfg.get("modules_to_convert"):  # transformers' FineGrainedFP8Config: only these quantized
        raise _refuse("modules_to_convert", cfg["modules_to_convert"], "null (every Linear not in modules_to_not_convert)")
    if cfg.get("expert_dtype", "fp8") not in ("fp8", None):  # transformers' FineGrainedFP8Config: fp4 experts
        raise _refuse("expert_dtype", cfg["expert_dtype"], "'fp8'")
    # vLLM reads both lists; transformers' FineGrainedFP8Config writes modules_to_not_convert.
    ignore = tuple(_module_names("ignored_layers", cfg.get("ignored_layers"))
                   + _module_names("modules_to_not_convert", cfg.get("modules_to_not_convert")))
    block = cfg.get("weight_block_size")
    if block is None:
        return QuantizationConfig("fp8", ((("Linear",), Fp8Scheme("tensor", activations)),), ignore)
    if block != [WEIGHT_BLOCK, WEIGHT_BLOCK]:
        raise _refuse("weight_block_size", block, f"null (per-tensor weight scales) or [{WEIGHT_BLOCK}, {WEIGHT_BLOCK}]")
    if activations != "dynamic":
        raise _refuse("activation_scheme", activations, "'dynamic' with weight_block_size (activations are quantized "
                      f"per token and {WEIGHT_BLOCK}-feature group as they come)")
    scheme = Fp8Scheme("block", "dynamic", block_scale_name="weight_scale_inv")
    return QuantizationConfig("fp8", ((("Linear",), scheme),), ignore)
