"""IBM Granite (3.x dense): the Llama block with four scalars from the config, applied where
transformers applies them: the token embeddings times ``embedding_multiplier``; each block's
attention and MLP outputs times ``residual_multiplier`` before their residual add; attention scores
scaled by ``attention_multiplier`` instead of 1/sqrt(head_dim); the logits divided by
``logits_scaling``. They are applied at run time (not folded into weights), so tied embeddings,
quantized checkpoints and tensor parallelism need nothing of their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenmill.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.quantization.config import QuantizationConfig


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        super().__init__(config, tp_rank, tp_size, tp_group, quant_config)
        self.model.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        for layer in self.model.layers:
            layer.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))
            layer.self_attn.attn.scale = float(getattr(config, "attention_multiplier", layer.self_attn.attn.scale))
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits
