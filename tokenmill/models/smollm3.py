"""SmolLM3: the Llama block where some layers attend without positions ("NoPE": ``no_rope_layers[i]
== 0``, every fourth layer in SmolLM3-3B). Such a layer gets a rotary table of cos 1 and sin 0 at
every position, so the kernels that rotate q and k (the fused qkv prologue, the torch path) leave
them exactly as they are, and nothing else changes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.quantization.config import QuantizationConfig


class NoRotation(RotaryEmbedding):
    """A rotary embedding that rotates by angle 0 (cos 1, sin 0) at every position."""

    def build_buffers(self) -> None:
        half = self.head_dim // 2
        table = torch.cat([torch.ones(self.max_position, half), torch.zeros(self.max_position, half)], dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        super().__init__(config, tp_rank, tp_size, tp_group, quant_config)
        uses_rope = list(getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers)
        if len(uses_rope) != config.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(uses_rope)} entries for {config.num_hidden_layers} layers")
        rotary = self.model.layers[0].self_attn.rotary_emb
        no_rotation = NoRotation(rotary.head_dim, rotary.max_position, rotary.rope)  # one table for every such layer
        for layer, rope in zip(self.model.layers, uses_rope):
            if not rope:
                layer.self_attn.rotary_emb = no_rotation
