"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is its dense sibling of the Llama family (models/llama.py: attention, norms, the LM head,
the paged KV cache and CUDA graphs are the same) with the MLP of some or all layers replaced by a
``SparseMoeBlock`` (models/layers/moe.py): a router, E stacked SwiGLU experts and, for Qwen2-MoE,
a shared expert every token also goes through. The checkpoint's per-expert tensors
(``experts.{e}.gate_proj.weight`` ...; Mixtral's ``block_sparse_moe.experts.{e}.w1.weight`` ...)
are stacked at load like q/k/v.

``quantization="fp8"`` quantizes the attention projections (and any dense MLP) as in the dense
models, and the experts' weights to fp8 per output channel (weight-only: layers/moe.py says why);
the router and the LM head stay in the model's dtype. Of pre-quantized MoE checkpoints only block-wise fp8
ones load (HF's ``weight_block_size``, Qwen3-30B-A3B-FP8): their experts' blocks are dequantized after
loading and, on a GPU, quantized again per output row for the same expert kernels (quantization/block_fp8.py);
the rest are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from tokenmill.models.layers.moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, SparseMoeBlock, expert_stacking
from tokenmill.models.llama import STACKED, LlamaForCausalLM, LlamaMLP, TensorParallel, dense_mlp, require_silu
from tokenmill.quantization.config import Fp8Scheme

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.quantization.config import QuantizationConfig


class _MoeForCausalLM(LlamaForCausalLM):
    """The Llama family's causal LM with mixture-of-experts MLPs where ``is_sparse`` says."""

    expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        if quant_config is not None and quant_config.from_checkpoint and not _hf_block_fp8(quant_config):
            raise ValueError(f"quantization={quant_config.describe()} is not supported for {type(self).__name__}: "
                             "pre-quantized mixture-of-experts checkpoints do not load, except block-wise fp8 ones "
                             "(quant_method 'fp8' with weight_block_size); load the full-precision checkpoint, "
                             "optionally with quantization='fp8'")
        require_silu(config)  # the experts' SwiGLU (a model without dense layers builds no LlamaMLP to check it)
        super().__init__(config, tp_rank, tp_size, tp_group, quant_config)
        # Expert stacking first: its fragments (experts.{e}.gate_proj) must win over the dense ones (.gate_proj.).
        self.stacked = (*expert_stacking(self.num_experts(config), self.expert_names), *STACKED)

    @staticmethod
    def num_experts(config: "PretrainedConfig") -> int:
        return config.num_experts

    def is_sparse(self, config: "PretrainedConfig", layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (the Qwen MoE models may keep some layers dense)."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = getattr(config, "mlp_only_layers", None) or []
        return self.num_experts(config) > 0 and layer_idx not in dense and (layer_idx + 1) % step == 0

    def make_mlp(self, config: "PretrainedConfig", layer_idx: int, tp: TensorParallel,
                 quant: "QuantizationConfig | None", prefix: str) -> nn.Module:
        if not self.is_sparse(config, layer_idx):
            return dense_mlp(config, layer_idx, tp, quant, prefix)
        scheme = quant.scheme_for([f"{prefix}.experts"]) if quant is not None else None
        block = isinstance(scheme, Fp8Scheme) and scheme.weight_scales == "block"
        return SparseMoeBlock(self.num_experts(config), config.num_experts_per_tok, config.hidden_size,
                              self.expert_intermediate_size(config), self.renormalize(config), **tp.kwargs(),
                              shared_expert=self.shared_expert(config, tp, quant, f"{prefix}.shared_expert"),
                              fp8_experts=isinstance(scheme, Fp8Scheme) and not block, block_fp8_experts=block)

    def expert_intermediate_size(self, config: "PretrainedConfig") -> int:
        return config.moe_intermediate_size

    def renormalize(self, config: "PretrainedConfig") -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    def shared_expert(self, config: "PretrainedConfig", tp: TensorParallel, quant: "QuantizationConfig | None",
                      prefix: str) -> nn.Module | None:
        return None


def _hf_block_fp8(quant_config: "QuantizationConfig") -> bool:
    """Whether every layer of a checkpoint is HF's block-wise fp8 (``weight_scale_inv``), which the experts load."""
    return all(isinstance(s, Fp8Scheme) and s.weight_scales == "block" and s.block_scale_name == "weight_scale_inv"
               for _, s in quant_config.groups)


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention (per-head q/k norms), 128 experts, 8 a token."""

    qk_norm = True


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), routed experts plus a
    shared expert weighted by its own sigmoid gate."""

    def has_qkv_bias(self, config: "PretrainedConfig") -> bool:
        return bool(getattr(config, "qkv_bias", True))  # transformers' Qwen2MoeConfig field (older ones: always)

    def shared_expert(self, config: "PretrainedConfig", tp: TensorParallel, quant: "QuantizationConfig | None",
                      prefix: str) -> nn.Module | None:
        size = getattr(config, "shared_expert_intermediate_size", 0)
        return LlamaMLP(config, tp, quant, prefix, intermediate_size=size, reduce_results=False) if size else None

    def local_name(self, name: str) -> str | None:
        # Without a shared expert transformers still builds one, zero wide, and saves its empty
        # tensors and its gate: what it adds is 0, so they are not loaded.
        if not getattr(self.config, "shared_expert_intermediate_size", 0) and ".mlp.shared_expert" in name:
            return None
        return name


class MixtralForCausalLM(_MoeForCausalLM):
    """Mixtral: the Mistral block with every MLP a mixture of ``num_local_experts`` experts, the
    router's top k always renormalised. The checkpoint calls the block ``block_sparse_moe`` and the
    projections w1 (gate), w3 (up) and w2 (down)."""

    expert_names = MIXTRAL_EXPERT_NAMES
    _CHECKPOINT_BLOCK, _OUR_BLOCK = ".block_sparse_moe.", ".mlp."

    @staticmethod
    def num_experts(config: "PretrainedConfig") -> int:
        return config.num_local_experts

    def is_sparse(self, config: "PretrainedConfig", layer_idx: int) -> bool:
        return True

    def expert_intermediate_size(self, config: "PretrainedConfig") -> int:
        return config.intermediate_size

    def renormalize(self, config: "PretrainedConfig") -> bool:
        return True

    def local_name(self, name: str) -> str:
        return name.replace(self._CHECKPOINT_BLOCK, self._OUR_BLOCK)

    def expected_weight_names(self) -> set[str]:
        return {name.replace(self._OUR_BLOCK, self._CHECKPOINT_BLOCK) for name in super().expected_weight_names()}

