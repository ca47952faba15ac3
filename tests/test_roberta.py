"""RoBERTa / XLM-RoBERTa encoders against references we did not write: a sentence-transformers
XLM-R embedder (mean pooling, normalised) against sentence-transformers, and XLM-R classifiers (a
one-label cross-encoder and a three-label classifier) against transformers and CrossEncoder. The
tiny models keep XLM-R's padding id 1, so positions start at 2, and one segment type; their
tokenizer returns no segment ids, as XLM-R's does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.tiny_models import build_tiny_bert_tokenizer, randomize_bert_weights
from tokenmill import LLM

ENGINE = dict(dtype="float32", device="cpu", seed=0, max_num_batched_tokens=128)
POSITIONS = 66  # XLM-R's table: max_model_len 64 plus the padding id's 2 rows


def _save(root: Path, name: str, model_cls_name: str, seed: int, **config) -> Path:
    import transformers
    from transformers import BertTokenizer, XLMRobertaConfig

    vocab = build_tiny_bert_tokenizer().get_vocab()
    tokenizer = BertTokenizer(vocab=vocab, model_input_names=["input_ids", "attention_mask"])
    cfg = XLMRobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=POSITIONS, type_vocab_size=1, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(cfg)
    randomize_bert_weights(model, seed)
    out = root / name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def xlmr_embedder(tmp_path_factory) -> Path:
    return save_xlmr_embedder(tmp_path_factory.mktemp("xlmr"))


def save_xlmr_embedder(root: Path) -> Path:
    """A sentence-transformers folder: XLMRobertaModel, mean pooling, Normalize (as multilingual-e5)."""
    out = _save(root, "embedder", "XLMRobertaModel", seed=21)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (out / "2_Normalize").mkdir()
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    return out


def test_xlmr_embedder_matches_sentence_transformers(xlmr_embedder, random_sentences):
    from sentence_transformers import SentenceTransformer

    llm = LLM(str(xlmr_embedder), **ENGINE)
    assert (llm.llm_engine.pooling.pooler.pooling_type, llm.llm_engine.pooling.pooler.normalize) == ("MEAN", True)
    texts = random_sentences(8, seed=5, high=40) + [" ".join(["cat"] * 62)]  # 64 tokens with <s>/</s>: the last position
    outputs = llm.embed(texts, use_tqdm=False)
    expected = SentenceTransformer(str(xlmr_embedder), device="cpu").encode(texts, convert_to_tensor=True)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, rtol=0, atol=1e-5)
    assert len(outputs[-1].prompt_token_ids) == llm.llm_engine.config.max_model_len == 64


@pytest.mark.parametrize("labels", [1, 3])
def test_xlmr_classifier_and_cross_encoder_match_transformers(tmp_path_factory, random_sentences, labels):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _save(tmp_path_factory.mktemp("xlmr_cls"), f"classifier{labels}", "XLMRobertaForSequenceClassification",
                   seed=22 + labels, num_labels=labels)
    llm = LLM(str(folder), **ENGINE)
    assert llm.llm_engine.config.max_model_len == POSITIONS - 2
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    queries, docs = random_sentences(5, seed=6), random_sentences(5, seed=7)
    with torch.no_grad():
        if labels == 1:  # a reranker: pairs, sigmoid scores, as sentence-transformers' CrossEncoder
            from sentence_transformers import CrossEncoder

            scores = [o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)]
            expected = [float(hf(**tok(q, d, return_tensors="pt")).logits[0, 0].sigmoid()) for q, d in zip(queries, docs)]
            assert scores == pytest.approx(expected, abs=1e-5)
            st = CrossEncoder(str(folder), device="cpu").predict(list(zip(queries, docs)))
            assert scores == pytest.approx(st.tolist(), abs=1e-5)
        else:
            outputs = llm.classify(queries, use_tqdm=False)
            for text, out in zip(queries, outputs):
                expected = hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
                torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=0, atol=1e-5)
            assert torch.tensor([o.outputs.probs for o in outputs]).std(0).max() > 1e-2
