"""Which model class implements which Hugging Face architecture.

Classes are imported only when asked for, so ``import tokenmill`` does not pay for torch model
code it will not use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

# HF ``architectures[0]`` -> (module, class name).
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.llama", "Qwen3ForCausalLM"),
}

# Configs made from GGUF metadata carry a model_type but no architectures list.
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_supported(arch: str) -> bool:
    return arch in _MODELS


def architecture_of(config: "PretrainedConfig") -> str:
    """``architectures[0]``, or the architecture implied by ``model_type`` when the list is absent."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", None)
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(
        f"config has no 'architectures' and model_type={model_type!r} is not one we can map; "
        f"supported architectures: {supported_architectures()}"
    )


def get_model_class(arch: str) -> type["nn.Module"]:
    if arch not in _MODELS:
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {supported_architectures()}")
    module_name, class_name = _MODELS[arch]
    return getattr(importlib.import_module(module_name), class_name)
