"""Llama-family decoders as pooling models: embedders (last-token or mean pooling of the final hidden
state) and sequence classifiers (HF's ``*ForSequenceClassification``: a ``score`` head on the last token).

The backbone is `LlamaModel` from llama.py with the switches of its family, found from the
config's ``model_type`` (Qwen2's q/k/v biases, Qwen3's q/k norms); there is no LM head. Prompts are computed whole in one step with causal
attention and no KV cache (the runner supplies `PrefillAttentionBackend`).

Checkpoints come in three layouts, all accepted: a causal LM (``model.*`` plus ``lm_head``, which
is not used), a bare base model saved with ``AutoModel`` (names without the ``model.`` prefix), and
a sequence classifier (``model.*`` plus ``score.weight``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.models.layers.pooling_head import HeadLinear
from tokenmill.models.llama import (
    IGNORED_SUFFIXES,
    STACKED,
    LlamaForCausalLM,
    LlamaModel,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    TensorParallel,
    qk_rows_for_rotary,
)
from tokenmill.models.weights import load_hf_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.quantization.config import QuantizationConfig


# The causal LM of each model_type, whose architecture switches (q/k/v bias, q/k norm) the backbone takes.
_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


class DecoderEmbeddingModel(nn.Module):
    """A decoder without its LM head: final (normed) hidden states for an embedding pooler."""

    default_pooling_type = "LAST"
    takes_token_type_ids = False

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        super().__init__()
        self.config = config
        family = _FAMILIES.get(getattr(config, "model_type", None))  # type: ignore[arg-type]
        if family is None:
            raise ValueError(f"model_type={getattr(config, 'model_type', None)!r} is not supported as a pooling decoder; "
                             f"supported: {sorted(_FAMILIES)}")
        qkv_bias = bool(getattr(config, "attention_bias", False)) if family.qkv_bias is None else family.qkv_bias
        self.model = LlamaModel(config, TensorParallel(tp_rank, tp_size, tp_group), qkv_bias, family.qk_norm, quant_config)
        self.num_layers: int = config.num_hidden_layers  # the runner passes one (absent) cache per layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, qk_rows_for_rotary(weights, self.model), STACKED, self._checkpoint_name)

    def _checkpoint_name(self, name: str) -> str | None:
        """The name of a checkpoint tensor in this model, or None when it is not used (the LM head)."""
        if name.startswith("lm_head.") or name.endswith(IGNORED_SUFFIXES):
            return None
        return name if name.startswith("model.") else f"model.{name}"  # a bare base-model checkpoint


class DecoderForSequenceClassification(DecoderEmbeddingModel):
    """The decoder plus HF's ``score`` head: last token's hidden state -> one logit per label."""

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        super().__init__(config, tp_rank, tp_size, tp_group, quant_config)
        self.num_labels: int = config.num_labels
        self.score = HeadLinear(config.hidden_size, self.num_labels, False, config)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, num_labels] logits."""
        return self.score(pooled)

    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_labels]: the score head on every token (token_classify)."""
        return self.score(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        ids = getattr(self.config, "classifier_token_ids", None)
        if ids is not None:  # vLLM's classifier_from_token: the score head from the LM head's rows
            from tokenmill.models.token_classifier import classifier_tokens, with_score_weight

            _, method = classifier_tokens(self.config)  # type: ignore[misc]
            weights = with_score_weight(weights, ids, method, ("lm_head.weight", "model.embed_tokens.weight"))
        super().load_weights(weights)

    def _checkpoint_name(self, name: str) -> str | None:
        return name if name.startswith("score.") else super()._checkpoint_name(name)
