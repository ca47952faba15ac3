"""The Llama decoder family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

All four are the same pre-norm block (RMSNorm -> GQA attention with RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual); they differ only in a few switches, set as class
attributes on the subclasses at the bottom. Parameter names mirror Hugging Face's except
that q/k/v and gate/up are stacked (``qkv_proj``, ``gate_up_proj``) so each is one matmul;
``load_weights`` maps the HF names onto the stacked parameters.

Input is a flat batch: ``input_ids`` and ``positions`` are [T] over all scheduled tokens of all
sequences; the attention metadata in ``ctx`` says which tokens belong to which sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.models.layers.activation import SiluAndMul
from tokenmill.models.layers.attention import Attention
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, partial_rotary_permutation
from tokenmill.models.weights import each_weight, hf_weight_names, load_hf_weights
from tokenmill.quantization import linear_method

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.models.checkpoint_tensor import CheckpointTensor
    from tokenmill.quantization.fp8 import QuantizedActivation
    from tokenmill.quantization.config import QuantizationConfig


# (stacked parameter, HF name part, shard id): HF stores these projections separately.
STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# The q and k projections' rows (reordered per head for partial rotary).
_QK_ROWS = (".q_proj.weight", ".k_proj.weight", ".q_proj.bias", ".k_proj.bias")
# Checkpoint entries that are not weights (old HF checkpoints saved the rope buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class TensorParallel:
    """The rank's place in the tensor-parallel group, handed to every layer it builds."""

    rank: int
    size: int
    group: Any

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank={self.rank} must be in [0, tp_size={self.size})")

    def kwargs(self) -> dict[str, Any]:
        return {"tp_rank": self.rank, "tp_size": self.size, "tp_group": self.group}


class LlamaAttention(nn.Module):
    def __init__(self, config: "PretrainedConfig", layer_idx: int, tp: TensorParallel, qkv_bias: bool, qk_norm: bool,
                 quant: "QuantizationConfig | None" = None, prefix: str = "", rotary: RotaryEmbedding | None = None):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = attention_head_dim(config)
        o_bias = bool(getattr(config, "attention_bias", False))
        qkv_method = linear_method(quant, [f"{prefix}.{p}_proj" for p in "qkv"])
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, qkv_bias, **tp.kwargs(),
                                          quant_method=qkv_method)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, o_bias, **tp.kwargs(),
                                        quant_method=linear_method(quant, [f"{prefix}.o_proj"]))
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        # Qwen3 normalises every head of q and k (over head_dim) before rotating them.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # One table shared by the model's layers (LlamaModel's): it covers every position
        # (e.g. 131,072 x 128 float32, 67 MB, for Llama-3.1), which a copy a layer would multiply.
        self.rotary_emb = rotary if rotary is not None else RotaryEmbedding.from_config(config, self.head_dim)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: "torch.Tensor | QuantizedActivation", ctx: ForwardContext) -> torch.Tensor:
        # q/k norms (Qwen3), rotary and the cache store happen in the attention layer: the Triton
        # backend does them in one kernel straight from the qkv output (see Attention.forward_qkv).
        qkv = self.qkv_proj(hidden)
        return self.o_proj(self.attn.forward_qkv(positions, qkv, ctx, self.rotary_emb, self.q_norm, self.k_norm))


def attention_head_dim(config: "PretrainedConfig") -> int:
    """The config's head_dim, or hidden_size / num_attention_heads where it has none."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def require_silu(config: "PretrainedConfig") -> None:
    """The SwiGLU MLPs (dense and experts) run SiLU only."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; supported: ['silu']")


class LlamaMLP(nn.Module):
    """``intermediate_size``: the config's unless given (Qwen2-MoE's shared expert has its own);
    ``reduce_results=False``: the ranks' partial sums are left for the caller to all-reduce."""

    def __init__(self, config: "PretrainedConfig", tp: TensorParallel, quant: "QuantizationConfig | None" = None,
                 prefix: str = "", intermediate_size: int | None = None, reduce_results: bool = True):
        super().__init__()
        require_silu(config)
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate_size or config.intermediate_size
        gate_up_method = linear_method(quant, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, **tp.kwargs(),
                                                       quant_method=gate_up_method)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, **tp.kwargs(), reduce_results=reduce_results,
                                           quant_method=linear_method(quant, [f"{prefix}.down_proj"]))
        self.act_fn = SiluAndMul()

    def forward(self, x: "torch.Tensor | QuantizedActivation") -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x), feeds=self.down_proj))


# Builds a layer's MLP: (config, layer index, tp, quantization, the MLP's checkpoint prefix) -> module.
MakeMLP = Callable[["PretrainedConfig", int, TensorParallel, "QuantizationConfig | None", str], nn.Module]


def dense_mlp(config: "PretrainedConfig", layer_idx: int, tp: TensorParallel, quant: "QuantizationConfig | None",
              prefix: str) -> nn.Module:
    return LlamaMLP(config, tp, quant, prefix)


class LlamaDecoderLayer(nn.Module):
    # Granite scales each block's attention and MLP output before the residual add (models/granite.py).
    residual_multiplier: float = 1.0

    def __init__(self, config: "PretrainedConfig", layer_idx: int, tp: TensorParallel, qkv_bias: bool, qk_norm: bool,
                 quant: "QuantizationConfig | None" = None, prefix: str = "", make_mlp: MakeMLP = dense_mlp,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp, qkv_bias, qk_norm, quant, f"{prefix}.self_attn", rotary)
        self.mlp = make_mlp(config, layer_idx, tp, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the preceding add. Each
        # norm is told the linear it feeds: for an fp8 one it also quantizes (RMSNorm.forward).
        # A mixture-of-experts MLP starts with its router, not a linear a norm could quantize for.
        qkv_proj, gate_up_proj = self.self_attn.qkv_proj, getattr(self.mlp, "gate_up_proj", None)
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden, feeds=qkv_proj)
        else:
            normed, residual = self.input_layernorm(hidden, residual, feeds=qkv_proj)
        hidden = self.self_attn(positions, normed, ctx)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        normed, residual = self.post_attention_layernorm(hidden, residual, feeds=gate_up_proj)
        out = self.mlp(normed)
        return (out * self.residual_multiplier if self.residual_multiplier != 1.0 else out), residual


class LlamaModel(nn.Module):
    """``quant``: the checkpoint's quantization (linear layers only: embeddings, norms and the LM head stay
    in the model's dtype); ``prefix``: this module's name in the checkpoint, which the quantization
    config's ignore lists and targets refer to."""

    # Granite scales the token embeddings (models/granite.py).
    embedding_multiplier: float = 1.0

    def __init__(self, config: "PretrainedConfig", tp: TensorParallel, qkv_bias: bool, qk_norm: bool,
                 quant: "QuantizationConfig | None" = None, prefix: str = "model", make_mlp: MakeMLP = dense_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **tp.kwargs())
        rotary = RotaryEmbedding.from_config(config, attention_head_dim(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, qkv_bias, qk_norm, quant, f"{prefix}.layers.{i}", make_mlp, rotary)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        attn = self.layers[0].self_attn
        if quant is not None and quant.from_checkpoint and partial_rotary_permutation(attn.head_dim, attn.rotary_emb.rope) is not None:
            raise ValueError("partial rotary with a pre-quantized checkpoint is not supported (its q/k scales would "
                             "need the reordering its q/k rows get at load)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def qk_rows_for_rotary(weights: Iterable[tuple[str, Any]], model: LlamaModel) -> Iterable[tuple[str, Any]]:
    """The checkpoint's tensors, with each q/k head's rows reordered when the model's rotary is
    partial (``rotary.partial_rotary_permutation``: a full-head rotation then does it)."""
    from tokenmill.models.checkpoint_tensor import HeadPermuted

    attn = model.layers[0].self_attn
    perm = partial_rotary_permutation(attn.head_dim, attn.rotary_emb.rope)
    if perm is None:
        return weights

    def reordered(name: str, tensor: Any) -> list[tuple[str, Any]]:
        return [(name, HeadPermuted(tensor, attn.head_dim, perm) if name.endswith(_QK_ROWS) else tensor)]

    return each_weight(weights, reordered)


class LlamaForCausalLM(nn.Module):
    """A causal LM over the paged KV cache. See the module docstring for the batch layout."""

    # Architecture switches; None means "read config.attention_bias".
    qkv_bias: bool | None = None
    qk_norm: bool = False
    # The checkpoint's separate tensors that fill one stacked parameter (weights.py).
    stacked: tuple[tuple[str, str, Any], ...] = STACKED
    # load_weights hands every tensor to a weight_loader, which reads only this rank's slice.
    supports_lazy_weights: bool = True

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        super().__init__()
        self.config = config
        tp = TensorParallel(tp_rank, tp_size, tp_group)
        self.model = LlamaModel(config, tp, self.has_qkv_bias(config), self.qk_norm, quant_config, make_mlp=self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, **tp.kwargs())
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        first = self.model.layers[0].self_attn
        # What the engine needs to size the KV cache and pick attention kernels (per rank).
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = first.num_heads
        self.num_kv_heads: int = first.num_kv_heads
        self.head_dim: int = first.head_dim

    def fused_lora_modules(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Checkpoint modules holding several of this model's parts in one tensor (Phi-3's ``qkv_proj``,
        ``gate_up_proj``): name -> (part, full rows) in order; an adapter's tensors for them are cut the
        same way (tokenmill/lora/model.py). None here."""
        return {}

    def has_qkv_bias(self, config: "PretrainedConfig") -> bool:
        return bool(getattr(config, "attention_bias", False)) if self.qkv_bias is None else self.qkv_bias

    def make_mlp(self, config: "PretrainedConfig", layer_idx: int, tp: TensorParallel,
                 quant: "QuantizationConfig | None", prefix: str) -> nn.Module:
        """Layer ``layer_idx``'s MLP (the mixture-of-experts models override this)."""
        return dense_mlp(config, layer_idx, tp, quant, prefix)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] in the model's dtype (the runner passes only rows it samples from)."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor | CheckpointTensor"]], partial: bool = False,
                     check_only: bool = False) -> None:
        """Copy Hugging Face-named tensors into this rank's parameters; every weight must be covered
        once, unless ``partial`` (update_weights replaces some of them). ``check_only``: replace
        nothing, only refuse an update that would not load (``weights.check_update``)."""

        def rename(name: str) -> str | None:
            if name.endswith(IGNORED_SUFFIXES):
                return None
            if self.tie_word_embeddings and name == "lm_head.weight":
                return None  # tied: the embedding is the head; HF ignores this copy too
            return self.local_name(name)

        load_hf_weights(self, qk_rows_for_rotary(weights, self.model), self.stacked, rename, partial, check_only)

    def local_name(self, name: str) -> str | None:
        """The Hugging Face name this model gives a checkpoint tensor (Mixtral calls its MLP otherwise),
        or None for a tensor it does not load. Renamed here, not before `load_hf_weights`, so its
        errors name the tensor as it was given."""
        return name

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face tensor names this model loads (the loaders use it to read only those)."""
        return hf_weight_names(self, self.stacked)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama block without biases (a sliding window limits max_model_len: config.py)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: biases on q, k and v (not on o_proj)."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm over each head of q and k before RoPE; head_dim set explicitly in the config."""

    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4: the Llama block, with q/k/v and gate/up already fused in the
    checkpoint (``qkv_proj``, ``gate_up_proj``); they are cut into their parts at load, so tensor
    parallelism slices each part as for Llama. LongRoPE and partial rotary (Phi-3.5, the 128K
    variants, Phi-4-mini) are refused by the rotary layer."""

    _FUSED = {".qkv_proj.weight": (".q_proj.weight", ".k_proj.weight", ".v_proj.weight"),
              ".gate_up_proj.weight": (".gate_proj.weight", ".up_proj.weight")}

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        if quant_config is not None and quant_config.from_checkpoint:
            raise ValueError("Phi3ForCausalLM: pre-quantized checkpoints are not supported (their fused qkv/gate_up "
                             "scales are not split); load the full-precision model, optionally with quantization='fp8'")
        super().__init__(config, tp_rank, tp_size, tp_group, quant_config)
        attn = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or attn
        head_dim = attention_head_dim(config)
        inter = config.intermediate_size
        self._part_rows = {".qkv_proj.weight": (attn * head_dim, kv * head_dim, kv * head_dim),
                           ".gate_up_proj.weight": (inter, inter)}

    def fused_lora_modules(self) -> dict[str, tuple[tuple[str, int], ...]]:
        return {fused.split(".")[1]: tuple((part.split(".")[1], rows) for part, rows in zip(parts, self._part_rows[fused]))
                for fused, parts in self._FUSED.items()}

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor | CheckpointTensor"]], partial: bool = False,
                     check_only: bool = False) -> None:
        from tokenmill.models.checkpoint_tensor import rows_of

        def unfused(name: str, tensor: Any) -> list[tuple[str, Any]]:
            fused = next((f for f in self._FUSED if name.endswith(f)), None)
            if fused is None:
                return [(name, tensor)]
            # Checked whole, by the name it was given: the parts' own checks would not see rows left over.
            expected = (sum(self._part_rows[fused]), self.config.hidden_size)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"cannot load checkpoint tensor {name!r}: shape mismatch: checkpoint tensor has shape "
                                 f"{tuple(tensor.shape)}, expected {expected} (rows: {' + '.join(map(str, self._part_rows[fused]))})")
            starts = [sum(self._part_rows[fused][:i]) for i in range(len(self._part_rows[fused]))]
            return [(name[: -len(fused)] + part, rows_of(tensor, start, rows))
                    for part, start, rows in zip(self._FUSED[fused], starts, self._part_rows[fused])]

        super().load_weights(each_weight(weights, unfused), partial, check_only)

    def expected_weight_names(self) -> set[str]:
        names = set()
        for name in super().expected_weight_names():
            fused = next((f for f, parts in self._FUSED.items() for part in parts if name.endswith(part)), None)
            part = next((p for p in self._FUSED.get(fused, ()) if name.endswith(p)), None)
            names.add(name[: -len(part)] + fused if part else name)
        return names
