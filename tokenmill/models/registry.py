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
    "Phi3ForCausalLM": ("tokenmill.models.llama", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("tokenmill.models.granite", "GraniteForCausalLM"),
    "SmolLM3ForCausalLM": ("tokenmill.models.smollm3", "SmolLM3ForCausalLM"),
    "MixtralForCausalLM": ("tokenmill.models.mixture_of_experts", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("tokenmill.models.mixture_of_experts", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenmill.models.mixture_of_experts", "Qwen3MoeForCausalLM"),
}

_TOKEN_CLASSIFIERS = "tokenmill.models.for_token_classification"
# Pooling models: HF ``architectures[0]`` -> (module, class name, the pooling task its head serves).
_POOLING_MODELS: dict[str, tuple[str, str, str]] = {
    "BertModel": ("tokenmill.models.bert", "BertModel", "embed"),
    "BertForSequenceClassification": ("tokenmill.models.bert", "BertForSequenceClassification", "classify"),
    "RobertaModel": ("tokenmill.models.roberta", "RobertaModel", "embed"),
    "XLMRobertaModel": ("tokenmill.models.roberta", "RobertaModel", "embed"),
    "RobertaForSequenceClassification": ("tokenmill.models.roberta", "RobertaForSequenceClassification", "classify"),
    "XLMRobertaForSequenceClassification": ("tokenmill.models.roberta", "RobertaForSequenceClassification", "classify"),
    "LlamaModel": ("tokenmill.models.decoder_pooling", "DecoderEmbeddingModel", "embed"),
    "MistralModel": ("tokenmill.models.decoder_pooling", "DecoderEmbeddingModel", "embed"),
    "Qwen2Model": ("tokenmill.models.decoder_pooling", "DecoderEmbeddingModel", "embed"),
    "Qwen3Model": ("tokenmill.models.decoder_pooling", "DecoderEmbeddingModel", "embed"),
    "LlamaForSequenceClassification": ("tokenmill.models.decoder_pooling", "DecoderForSequenceClassification", "classify"),
    "MistralForSequenceClassification": ("tokenmill.models.decoder_pooling", "DecoderForSequenceClassification", "classify"),
    "Qwen2ForSequenceClassification": ("tokenmill.models.decoder_pooling", "DecoderForSequenceClassification", "classify"),
    "Qwen3ForSequenceClassification": ("tokenmill.models.decoder_pooling", "DecoderForSequenceClassification", "classify"),
    # Token classifiers (NER): a label per prompt token, LLM.encode(pooling_task="token_classify").
    "BertForTokenClassification": (_TOKEN_CLASSIFIERS, "BertForTokenClassification", "token_classify"),
    "RobertaForTokenClassification": (_TOKEN_CLASSIFIERS, "RobertaForTokenClassification", "token_classify"),
    "XLMRobertaForTokenClassification": (_TOKEN_CLASSIFIERS, "RobertaForTokenClassification", "token_classify"),
    "LlamaForTokenClassification": (_TOKEN_CLASSIFIERS, "DecoderForTokenClassification", "token_classify"),
    "MistralForTokenClassification": (_TOKEN_CLASSIFIERS, "DecoderForTokenClassification", "token_classify"),
    "Qwen2ForTokenClassification": (_TOKEN_CLASSIFIERS, "DecoderForTokenClassification", "token_classify"),
    "Qwen3ForTokenClassification": (_TOKEN_CLASSIFIERS, "DecoderForTokenClassification", "token_classify"),
}

# A causal LM run as an embedder (runner="pooling") is its base model without the LM head.
_BASE_MODEL_OF: dict[str, str] = {
    "LlamaForCausalLM": "LlamaModel",
    "MistralForCausalLM": "MistralModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}

# Configs made from GGUF metadata carry a model_type but no architectures list.
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted({*_MODELS, *_POOLING_MODELS})


def is_supported(arch: str) -> bool:
    return arch in _MODELS or arch in _POOLING_MODELS


def pooling_task_of(arch: str) -> str | None:
    """"embed", "classify" or "token_classify" for a pooling architecture; None for a generative one."""
    entry = _POOLING_MODELS.get(arch)
    return entry[2] if entry else None


def embedding_architecture_of(arch: str) -> str | None:
    """The embedding architecture that serves a causal LM run as a pooling model, if there is one."""
    return _BASE_MODEL_OF.get(arch)


def architecture_of(config: "PretrainedConfig") -> str:
    """``architectures[0]``, or the architecture implied by ``model_type`` when the list is absent."""
    archs = getattr(config, "architectures", None) or []
    if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
        # A bare string would give its first letter as the architecture.
        raise ValueError(f"config field architectures={archs!r} is invalid: must be a list of names, e.g. "
                         f"[\"LlamaForCausalLM\"]; supported architectures: {supported_architectures()}")
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
    if arch in _MODELS:
        module_name, class_name = _MODELS[arch]
    elif arch in _POOLING_MODELS:
        module_name, class_name, _ = _POOLING_MODELS[arch]
    else:
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {supported_architectures()}")
    return getattr(importlib.import_module(module_name), class_name)
