"""Tiny random token classifiers (``*ForTokenClassification``, NER-style labels) saved with
transformers: BERT and XLM-RoBERTa (the tiny WordPiece vocabulary) and the dense decoders (the tiny
byte-level BPE tokenizer). Every weight is redrawn (tests/support/tiny_models.py), so a head or bias
left out, or a wrong name mapping, changes the logits."""

from __future__ import annotations

from pathlib import Path

import torch

from support.tiny_models import (
    build_tiny_bert_tokenizer,
    build_tiny_tokenizer,
    randomize_bert_weights,
    randomize_weights,
    save_tiny_bert,
    tiny_bert_config,
    tiny_config_kwargs,
)

NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-ORG", 4: "I-ORG", 5: "B-LOC", 6: "I-LOC"}
DECODER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
XLMR_POSITIONS = 66  # XLM-R's table: max_model_len 64 plus the padding id's 2 rows


def _label_kwargs(labels: dict[int, str]) -> dict:
    return dict(num_labels=len(labels), id2label=labels, label2id={v: k for k, v in labels.items()})


def save_bert_token_classifier(root: Path, seed: int, labels: dict[int, str] = NER_LABELS) -> Path:
    """BertForTokenClassification (max_model_len 64, two segment types)."""
    return save_tiny_bert(root, "bert_ner", "BertForTokenClassification", tiny_bert_config(**_label_kwargs(labels)), seed)


def save_xlmr_token_classifier(root: Path, seed: int, labels: dict[int, str] = NER_LABELS) -> Path:
    """XLMRobertaForTokenClassification: padding id 1 (positions start at 2), one segment type and a
    tokenizer that returns no segment ids, as XLM-R's."""
    from transformers import BertTokenizer, XLMRobertaConfig, XLMRobertaForTokenClassification

    vocab = build_tiny_bert_tokenizer().get_vocab()
    config = XLMRobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=XLMR_POSITIONS, type_vocab_size=1,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, **_label_kwargs(labels))
    torch.manual_seed(seed)
    model = XLMRobertaForTokenClassification(config)
    randomize_bert_weights(model, seed)
    out = root / "xlmr_ner"
    model.save_pretrained(out)
    BertTokenizer(vocab=vocab, model_input_names=["input_ids", "attention_mask"]).save_pretrained(out)
    return out


def save_decoder_token_classifier(root: Path, family: str, seed: int, labels: dict[int, str] = NER_LABELS,
                                  **config_overrides) -> Path:
    """``{Llama,Mistral,Qwen2,Qwen3}ForTokenClassification`` (transformers' score head, with its bias
    unless ``token_classification_bias=False``)."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    name = names[family]
    extra = dict(head_dim=32) if family == "qwen3" else {}
    config = getattr(transformers, f"{name}Config")(
        **tiny_config_kwargs(**extra), **_label_kwargs(labels), architectures=[f"{name}ForTokenClassification"],
        **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForTokenClassification")(config)
    randomize_weights(model, seed)
    out = root / f"{family}_ner"
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out
