"""RoBERTa and XLM-RoBERTa encoders (multilingual-e5 and bge-m3's dense vectors as embedders,
bge-reranker and other cross-encoders as classifiers): BERT's encoder (models/bert.py) with two
differences. Positions start after the padding id: transformers numbers a sequence's tokens
``pad_token_id + 1, + 2, ...`` (counting only non-padding tokens, and a prompt here holds none), so
the positions table has ``pad_token_id + 1`` rows more than the longest sequence
(``max_model_len.py`` leaves them out). The classification head is dense + tanh + out_proj on the
``<s>`` state, without BERT's pooler. One segment type: pairs are told apart by separators alone."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.models.bert import STACKED, BertModel, hf_name
from tokenmill.models.layers.pooling_head import HeadLinear
from tokenmill.models.weights import load_hf_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RobertaModel(BertModel):
    """The encoder alone, for embedders (sentence-transformers folders)."""

    takes_token_type_ids = False
    checkpoint_prefix = "roberta."

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 add_pooling_layer: bool = False):
        super().__init__(config, tp_rank, tp_size, tp_group, add_pooling_layer)
        self.position_offset = int(config.pad_token_id) + 1

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return super().forward(input_ids, positions + self.position_offset, ctx, token_type_ids)


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: "PretrainedConfig"):
        super().__init__()
        self.dense = HeadLinear(config.hidden_size, config.hidden_size, True, config)
        self.out_proj = HeadLinear(config.hidden_size, config.num_labels, True, config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(hidden)))


class RobertaForSequenceClassification(nn.Module):
    """RoBERTa with its classification head on the <s> state; a cross-encoder (reranker) is this model
    on a (query, document) pair with one label."""

    default_pooling_type = "CLS"
    takes_token_type_ids = False

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None):
        super().__init__()
        self.config = config
        self.roberta = RobertaModel(config, tp_rank, tp_size, tp_group)
        self.num_labels: int = config.num_labels
        self.classifier = RobertaClassificationHead(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.roberta(input_ids, positions, ctx, token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] (each sequence's <s> state) -> [B, num_labels] logits."""
        return self.classifier(pooled)

    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_labels]: the head on every token's state (token_classify)."""
        return self.classifier(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            return None if name.endswith("position_ids") or name.startswith("roberta.pooler.") else hf_name(name)

        load_hf_weights(self, weights, STACKED, rename)
