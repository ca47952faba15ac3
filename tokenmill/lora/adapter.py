"""A PEFT LoRA folder read and checked against the model before any request uses it.

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``), whose
tensors are named ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]) for each adapted linear module. Intake checks everything a step could trip on (rank,
modules the engine can adapt, shapes, features we do not run) from the config and the tensors'
headers, so a bad adapter fails its own request with a message, never a step of others. The ranks
read the tensors themselves when they load the adapter (`read_adapter`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.param_checks import is_int, is_number

if TYPE_CHECKING:
    import torch

    from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# vLLM's choices for max_lora_rank.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: where its tensors are and, per adapted module (the model's Hugging Face
    module name), its rank and scaling (lora_alpha / r, or / sqrt(r) with rsLoRA). ``uid`` tells
    apart every adapter the engine has read, a reloaded id (``load_inplace``) included: the device
    slots, the scheduler's count of adapters and the prefix cache's keys go by it, so requests still
    running with the old weights keep them and cached prefixes of old weights are never reused."""

    lora_int_id: int
    name: str
    path: str
    weights_file: str
    modules: dict[str, tuple[int, float]] = field(hash=False)
    uid: int = 1

    @property
    def cache_key(self) -> str:
        """What the prefix cache salts this adapter's blocks with."""
        return f"lora\0{self.lora_int_id}\0{self.name}\0{self.path}\0{self.uid}"


def inspect_adapter(request: "LoRARequest", targets: dict[str, tuple[int, int]], max_rank: int,
                    uid: int = 1, excluded: frozenset[str] = frozenset()) -> AdapterSpec:
    """Check the adapter folder against ``targets`` (module name -> (in, out) features of the full
    model) and ``max_rank``; a ValueError names the adapter, the field or tensor, and what is allowed.
    Modules in ``excluded`` (left out by lora_target_modules) are skipped, with a warning."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{where}: lora_path={request.lora_path!r} is not a folder (adapters are read from local "
                         "PEFT folders: adapter_config.json and adapter_model.safetensors)")
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json in lora_path={request.lora_path!r} (a PEFT LoRA folder "
                         "holds adapter_config.json and adapter_model.safetensors; adapters are read from local folders)")
    config = _read_config(config_file, where)
    _check_config(config, where)
    weights_file = _weights_file(folder, where)
    shapes = _tensor_shapes(weights_file, where)
    modules: dict[str, tuple[int, float]] = {}
    skipped: list[str] = []
    for key, shape in shapes.items():
        module, part = _split_key(key, where)
        if part == _B:
            continue
        if module in excluded:
            skipped.append(module)
            continue
        if module not in targets:
            raise ValueError(f"{where}: tensor {key!r} adapts {module!r}, which tokenmill cannot adapt; adaptable: "
                             f"{_kinds(targets)} of every decoder layer (not embeddings, the LM head, routers or experts)")
        b_key = key[: -len(_A)] + _B
        if b_key not in shapes:
            raise ValueError(f"{where}: tensor {key!r} has no {b_key!r} beside it")
        in_features, out_features = targets[module]
        rank = shape[0] if len(shape) == 2 else -1
        if tuple(shape) != (rank, in_features) or tuple(shapes[b_key]) != (out_features, rank):
            raise ValueError(f"{where}: {key!r} has shape {list(shape)} and {b_key!r} {list(shapes[b_key])}; "
                             f"{module!r} of this model needs [r, {in_features}] and [{out_features}, r] "
                             "(was the adapter made for another base model?)")
        # PEFT sizes a module's tensors by its r (rank_pattern, else r: 8 if missing) and scales by
        # lora_alpha / that r, as vLLM does: tensors of another rank are an adapter PEFT cannot load,
        # whose scaling would be anyone's guess.
        config_rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
        if rank != config_rank:
            raise ValueError(f"{where}: {key!r} has rank {rank}, but adapter_config.json gives {module!r} "
                             f"r={config_rank} (r, or its rank_pattern entry); the file and the tensors disagree")
        if rank > max_rank:
            raise ValueError(f"{where}: {module!r} has rank {rank}, above max_lora_rank={max_rank}; "
                             f"start the LLM with max_lora_rank >= {rank} (one of {list(MAX_LORA_RANKS)})")
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[module] = (rank, scaling)
    orphans = [key for key in shapes if key.endswith(_B) and _split_key(key, where)[0] not in {*modules, *skipped}]
    if orphans:
        raise ValueError(f"{where}: tensor {orphans[0]!r} has no lora_A beside it")
    if skipped:
        logger.warning("%s: %d module(s) left out by lora_target_modules, e.g. %s", where, len(skipped), skipped[0])
    if not modules:
        raise ValueError(f"{where}: {weights_file.name} holds no lora_A / lora_B tensors"
                         + (" of the modules lora_target_modules allows" if skipped else ""))
    return AdapterSpec(request.lora_int_id, request.lora_name, str(folder), str(weights_file), modules, uid)


def read_adapter(spec: AdapterSpec, dtype: "torch.dtype") -> dict[str, tuple["torch.Tensor", "torch.Tensor"]]:
    """Per module: (A [r, in], B [out, r] times the scaling), in ``dtype`` on the CPU. A ValueError
    names a tensor with NaN or infinite values (as read, or once scaled and cast to ``dtype``): in a
    device slot it would make every token of a step NaN, whatever its adapter (the expand GEMM
    multiplies every token's zeroed columns by B: 0 * NaN is NaN), so the adapter fails its own
    requests instead (`AdapterLoadError`). Finite weights whose products overflow the dtype stay with
    their own requests (`LoRAUpdate` selects each token's columns)."""
    import torch

    tensors = _load_tensors(Path(spec.weights_file))
    out = {}
    for module, (_rank, scaling) in spec.modules.items():
        a = tensors[_PREFIX + module + _A].to(dtype)
        b = (tensors[_PREFIX + module + _B].to(torch.float32) * scaling).to(dtype)
        for key, tensor in ((_PREFIX + module + _A, a), (_PREFIX + module + _B, b)):
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"LoRA adapter {spec.name!r} ({spec.path}): tensor {key!r} of "
                                 f"{Path(spec.weights_file).name} holds NaN or infinite values (in "
                                 f"{str(dtype).removeprefix('torch.')}, lora_B scaled by {scaling:g}); LoRA weights "
                                 "must be finite")
        out[module] = (a, b)
    return out


def _read_config(config_file: Path, where: str) -> dict[str, Any]:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:  # a ValueError, but its own message names no file
        raise ValueError(f"{where}: adapter_config.json is not UTF-8 text ({exc})") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{where}: adapter_config.json holds a JSON {type(config).__name__}; it must be a JSON object "
                         "of PEFT LoraConfig fields")
    return config


def _is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def _is_rank(value: Any) -> bool:
    return is_int(value) and value >= 1


def _pattern_problem(value: Any, valid: Any) -> str | None:
    """What is wrong with a PEFT pattern field (``alpha_pattern``, ``rank_pattern``), None if nothing."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "not an object"
    for key, item in value.items():
        try:
            re.compile(key)
        except re.error as exc:
            return f"its key {key!r} is not a regular expression ({exc})"
        if not valid(item):
            return f"its value {item!r} for {key!r} is not allowed"
    return None


# The fields that set the update's scaling (lora_alpha / r): checked, since a wrong type would
# fail a step, or worse run (use_rslora="false" is truthy). Missing fields take PEFT's defaults.
_FIELDS: dict[str, tuple[Any, str]] = {
    "r": (_is_rank, "an integer >= 1"),
    "lora_alpha": (_is_finite, "a number"),
    "use_rslora": (lambda v: v is None or isinstance(v, bool), "true or false"),
}
_PATTERNS: dict[str, tuple[Any, str]] = {
    "alpha_pattern": (_is_finite, "an object of module-name regular expressions to numbers"),
    "rank_pattern": (_is_rank, "an object of module-name regular expressions to integers >= 1"),
}


def _check_config(config: dict[str, Any], where: str) -> None:
    for key, (valid, allowed) in {**_FIELDS, **_PATTERNS}.items():
        why = _pattern_problem(config.get(key), valid) if key in _PATTERNS else None
        if key in config and (why is not None if key in _PATTERNS else not valid(config[key])):
            raise ValueError(f"{where}: adapter_config.json has {key}={config[key]!r:.200}"
                             + (f" ({why})" if why else "") + f"; it must be {allowed}")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r} is not supported; supported: ['LORA']")
    refused = {
        "use_dora": (config.get("use_dora"), "DoRA adapters are not supported; merge the adapter into the weights"),
        "bias": (config.get("bias", "none") not in (None, "none") and config.get("bias"),
                 "adapters that train biases are not supported; supported: bias='none'"),
        "lora_bias": (config.get("lora_bias"), "lora_B biases are not supported"),
        "modules_to_save": (config.get("modules_to_save"),
                            "fully trained modules (modules_to_save) are not supported; supported: none"),
        "fan_in_fan_out": (config.get("fan_in_fan_out"), "transposed (Conv1D) weights are not supported"),
        # Variants whose tensors look like plain LoRA's but whose forward is not: run as plain LoRA they
        # would give other outputs than PEFT's, silently (VeLoRA changes training only: accepted).
        "alora_invocation_tokens": (config.get("alora_invocation_tokens"), "activated LoRA (aLoRA: the adapter applies "
                                    "only after its invocation tokens) is not supported; supported: plain LoRA"),
        "layer_replication": (config.get("layer_replication"),
                              "adapters that replicate decoder layers are not supported; supported: plain LoRA"),
        **{key: (config.get(key), f"the LoRA variant {key} is not supported; supported: plain LoRA and rsLoRA")
           for key in ("use_bdlora", "arrow_config", "monteclora_config", "kasa_config", "mica", "use_qalora")},
        "target_parameters": (config.get("target_parameters"), "LoRA on parameters (target_parameters) is not "
                              "supported; supported: LoRA on linear modules (target_modules)"),
        "trainable_token_indices": (config.get("trainable_token_indices"),
                                    "trainable token embeddings are not supported"),
    }
    for key, (value, why) in refused.items():
        if value:
            raise ValueError(f"{where}: {key}={config.get(key)!r}: {why}")


def _weights_file(folder: Path, where: str) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"{where}: no adapter_model.safetensors (or adapter_model.bin) in {str(folder)!r}")


def _tensor_shapes(weights_file: Path, where: str) -> dict[str, list[int]]:
    """Each tensor's shape; a tensor not of a floating-point dtype is refused (cast to the model's
    dtype, integer or boolean weights would run as if they were the adapter's values)."""
    try:
        if weights_file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(weights_file), framework="pt") as f:
                slices = {key: f.get_slice(key) for key in f.keys()}
                found = {key: (list(t.get_shape()), t.get_dtype()) for key, t in slices.items()}
        else:
            found = {key: (list(t.shape), str(t.dtype).removeprefix("torch."))
                     for key, t in _load_tensors(weights_file).items()}
    except Exception as exc:  # noqa: BLE001  (any unreadable file: one message naming it)
        raise ValueError(f"{where}: cannot read {weights_file.name} ({exc})") from exc
    for key, (_shape, dtype) in found.items():
        if not dtype.startswith(("F", "BF", "float", "bfloat")):  # safetensors' names, torch's for .bin
            raise ValueError(f"{where}: tensor {key!r} in {weights_file.name} has dtype {dtype}; LoRA weights must be "
                             "floating point (F16, BF16, F32, F64)")
    return {key: shape for key, (shape, _dtype) in found.items()}


def _load_tensors(weights_file: Path) -> dict[str, "torch.Tensor"]:
    import torch

    if weights_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(weights_file))
    return torch.load(str(weights_file), map_location="cpu", weights_only=True)


def _split_key(key: str, where: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (module, ".lora_A.weight")."""
    for part in (_A, _B):
        if key.startswith(_PREFIX) and key.endswith(part):
            return key[len(_PREFIX) : -len(part)], part
    if "lora_embedding" in key:
        raise ValueError(f"{where}: tensor {key!r} adapts an embedding, which tokenmill cannot adapt")
    if any(part in key for part in (".embed_tokens", ".lm_head")):
        raise ValueError(f"{where}: tensor {key!r} replaces or adapts the embeddings or the LM head, which tokenmill "
                         "cannot adapt (adapt q/k/v/o and gate/up/down only)")
    if "lora_magnitude_vector" in key:
        raise ValueError(f"{where}: tensor {key!r} belongs to a DoRA adapter, which is not supported")
    raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight (expected base_model.model.<module>.lora_A.weight "
                     "or .lora_B.weight)")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override (``alpha_pattern``): the first key matching the end of the name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _kinds(targets: dict[str, tuple[int, int]]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in targets})
