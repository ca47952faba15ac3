"""Token classifiers: Hugging Face's ``*ForTokenClassification`` (NER, part-of-speech tagging), a
label per prompt token. Served through ``LLM.encode(prompts, pooling_task="token_classify")``, whose
output is [num_prompt_tokens, num_labels] (vLLM's NER example takes the argmax of each row and looks
it up in ``config.id2label``).

Not to be confused with ``token_classifier.py``: that one makes a *sequence* classifier from a causal
LM's logits of a few tokens (vLLM's ``classifier_from_token``, e.g. Qwen3-Reranker).

Each class is its encoder or decoder with one linear layer on every token's final hidden state,
as in transformers (dropout aside, which inference skips):

    BertForTokenClassification      bert.* (no pooler) + classifier            bidirectional
    RobertaForTokenClassification   roberta.* (no pooler) + classifier         bidirectional
      (XLMRobertaForTokenClassification too: the same layout)
    DecoderForTokenClassification   model.* + score (bias unless the config    causal
      (Llama, Mistral, Qwen2, Qwen3)  sets token_classification_bias=False)

The runner's token path (`pooling/runner.py`) calls ``classify_tokens`` on the packed hidden states
of the whole step: one matmul for every token of every prompt, no per-request work.

What the tasks do follows vLLM 0.26: an encoder token classifier serves ``token_classify`` only (its
head is on every token, there is no sequence head); a decoder one is vLLM's causal LM converted to a
classifier, whose ``score`` head also classifies the last token (``classify``) when the model is
started with ``PoolerConfig(task="classify")`` (`pooling/config.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.models.bert import STACKED, BertModel, hf_name
from tokenmill.models.decoder_pooling import DecoderEmbeddingModel
from tokenmill.models.layers.pooling_head import HeadLinear
from tokenmill.models.roberta import RobertaModel
from tokenmill.models.weights import load_hf_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.quantization.config import QuantizationConfig


class _EncoderForTokenClassification(nn.Module):
    """An encoder (``BertModel`` or ``RobertaModel``) under the checkpoint's prefix, plus ``classifier``."""

    default_pooling_type = "CLS"  # no sequence task reads it; PoolingRunner needs one decided
    takes_token_type_ids = True
    encoder_cls: type[BertModel] = BertModel
    prefix = "bert"

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None):
        super().__init__()
        self.config = config
        self.num_labels: int = config.num_labels
        # Registered under HF's attribute name, so checkpoint names map one to one.
        self.add_module(self.prefix, self.encoder_cls(config, tp_rank, tp_size, tp_group))
        self.classifier = HeadLinear(config.hidden_size, self.num_labels, True, config)

    @property
    def encoder(self) -> BertModel:
        return getattr(self, self.prefix)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions (, token_type_ids): [T] -> final hidden states [T, hidden_size]."""
        return self.encoder(input_ids, positions, ctx, token_type_ids)

    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_labels] logits, one row per token."""
        return self.classifier(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        pooler = f"{self.prefix}.pooler."

        def rename(name: str) -> str | None:
            # transformers builds these models without the pooler; a checkpoint converted from a
            # pre-trained encoder may still carry one, which no token's logits use.
            return None if name.endswith("position_ids") or name.startswith(pooler) else hf_name(name)

        load_hf_weights(self, weights, STACKED, rename)


class BertForTokenClassification(_EncoderForTokenClassification):
    """BERT: segment ids are read (a prompt given with ``token_type_ids``)."""


class RobertaForTokenClassification(_EncoderForTokenClassification):
    """RoBERTa / XLM-RoBERTa: BERT's encoder with positions after the padding id (models/roberta.py)."""

    takes_token_type_ids = False
    encoder_cls = RobertaModel
    prefix = "roberta"


class DecoderForTokenClassification(DecoderEmbeddingModel):
    """A Llama-family decoder plus HF's ``score`` head on every token (causal: a token's label sees
    only the tokens before it)."""

    def __init__(self, config: "PretrainedConfig", tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None,
                 quant_config: "QuantizationConfig | None" = None):
        super().__init__(config, tp_rank, tp_size, tp_group, quant_config)
        self.num_labels: int = config.num_labels
        # transformers' GenericForTokenClassification: a bias unless the config turns it off.
        bias = bool(getattr(config, "token_classification_bias", True))
        self.score = HeadLinear(config.hidden_size, self.num_labels, bias, config)

    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_labels] logits, one row per token (token_classify)."""
        return self.score(hidden)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] (each prompt's last token) -> [B, num_labels]: vLLM's classify task of a
        converted causal LM, served under PoolerConfig(task="classify")."""
        return self.score(pooled)

    def _checkpoint_name(self, name: str) -> str | None:
        return name if name.startswith("score.") else super()._checkpoint_name(name)
