"""BERT encoders: BertModel (embeddings, e.g. sentence-transformers) and BertForSequenceClassification
(classifiers and cross-encoders).

A post-norm transformer with bidirectional attention: every token sees its whole sequence, so a
prompt is computed in one step and nothing is cached (attention comes from the runner's whole-prompt
backend: `tokenmill/attention/prefill.py` on the CPU, `varlen_backend.py` on the GPU).
Input is the runner's flat batch: ``input_ids``, ``positions`` and ``token_type_ids`` are [T] over
the tokens of all sequences, and ``ctx.attn`` says which tokens belong to which sequence.

Parameter names are Hugging Face's, except that query/key/value are stacked into ``qkv_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.models.layers.embedding import VocabParallelEmbedding
from tokenmill.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.models.layers.norm import LayerNorm
from tokenmill.models.layers.pooling_head import HeadLinear
from tokenmill.models.llama import TensorParallel
from tokenmill.models.weights import load_hf_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

STACKED = (
    (".qkv_proj.", ".query.", "q"),
    (".qkv_proj.", ".key.", "k"),
    (".qkv_proj.", ".value.", "v"),
)
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, config: "PretrainedConfig", tp: TensorParallel):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **tp.kwargs())
        self.position_embeddings = VocabParallelEmbedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = VocabParallelEmbedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]  # every token in segment 0
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden, self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, config: "PretrainedConfig", tp: TensorParallel):
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias=True, **tp.kwargs())
        self.num_heads = self.qkv_proj.num_heads
        self.q_size = self.qkv_proj.q_size

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert ctx.attn is not None, "the encoder needs the batch's sequence boundaries"
        tokens = hidden.shape[0]
        q, k, v = (x.reshape(tokens, self.num_heads, self.head_dim)
                   for x in self.qkv_proj(hidden).split([self.q_size] * 3, dim=-1))
        # The runner's whole-prompt backend: torch on the CPU, the Triton varlen kernel on the GPU.
        out = ctx.backend.attend(q, k, v, ctx.attn, self.head_dim**-0.5, causal=False)  # type: ignore[attr-defined]
        return out.reshape(tokens, self.q_size)


class BertSelfOutput(nn.Module):
    """Projection back to the hidden size, then LayerNorm of it plus the block's input (post-norm)."""

    def __init__(self, config: "PretrainedConfig", in_features: int, tp: TensorParallel):
        super().__init__()
        self.dense = RowParallelLinear(in_features, config.hidden_size, bias=True, **tp.kwargs())
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden), residual)


class BertAttention(nn.Module):
    def __init__(self, config: "PretrainedConfig", tp: TensorParallel):
        super().__init__()
        self.self = BertSelfAttention(config, tp)  # HF's name, kept so checkpoint names map one to one
        self.output = BertSelfOutput(config, config.hidden_size, tp)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.output(self.self(hidden, ctx), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: "PretrainedConfig", tp: TensorParallel):
        super().__init__()
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True, **tp.kwargs())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: "PretrainedConfig", tp: TensorParallel):
        super().__init__()
        self.attention = BertAttention(config, tp)
        self.intermediate = BertIntermediate(config, tp)
        self.output = BertSelfOutput(config, config.intermediate_size, tp)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attended = self.attention(hidden, ctx)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: "PretrainedConfig", tp: TensorParallel):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, tp) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, ctx)
        return hidden


class BertPooler(nn.Module):
    """BERT's pooler: the [CLS] state through dense + tanh (the classification head's input)."""

    def __init__(self, config: "PretrainedConfig"):
        super().__init__()
        self.dense = HeadLinear(config.hidden_size, config.hidden_size, True, config)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


def _check_config(config: "PretrainedConfig") -> None:
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"position_embedding_type={kind!r} is not supported; supported: ['absolute']")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size={config.hidden_size} is not divisible by num_attention_heads={config.num_attention_heads}")


def hf_name(name: str) -> str:
    # Checkpoints converted from TensorFlow name LayerNorm parameters gamma and beta.
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


class BertModel(nn.Module):
    """The encoder alone: hidden states for an embedding pooler (sentence-transformers models)."""

    default_pooling_type = "CLS"
    takes_token_type_ids = True
    checkpoint_prefix = "bert."  # the encoder's name inside a checkpoint of a model with a head

    def __init__(
        self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
        add_pooling_layer: bool = False,
    ):
        super().__init__()
        _check_config(config)
        tp = TensorParallel(tp_rank, tp_size, tp_group)
        self.config = config
        self.embeddings = BertEmbeddings(config, tp)
        self.encoder = BertEncoder(config, tp)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions, token_type_ids: [T] int64 -> hidden states [T, hidden_size]."""
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids), ctx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            name = hf_name(name.removeprefix(self.checkpoint_prefix))
            if name.endswith("position_ids"):
                return None
            if name.startswith(("embeddings.", "encoder.")) or (self.pooler is not None and name.startswith("pooler.")):
                return name
            return None  # BERT's pooler, the pre-training heads and buffers are not part of the embedder

        load_hf_weights(self, weights, STACKED, rename)


class BertForSequenceClassification(nn.Module):
    """BERT with its classification head: [CLS] -> dense + tanh (BERT's pooler) -> one logit per label.

    A cross-encoder is this model on a (query, document) pair with one label.
    """

    default_pooling_type = "CLS"
    takes_token_type_ids = True

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, tp_rank, tp_size, tp_group, add_pooling_layer=True)
        self.num_labels: int = config.num_labels
        self.classifier = HeadLinear(config.hidden_size, self.num_labels, True, config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.bert(input_ids, positions, ctx, token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] (each sequence's [CLS] state) -> [B, num_labels] logits."""
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(pooled))

    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_labels]: the classifier on every token's state (vLLM's token_classify
        for BERT, which skips the [CLS]-only dense + tanh pooler)."""
        return self.classifier(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            return None if name.endswith("position_ids") else hf_name(name)

        load_hf_weights(self, weights, STACKED, rename)
