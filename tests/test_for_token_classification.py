"""Token classifiers (``*ForTokenClassification``: BERT, XLM-RoBERTa, Llama, Mistral, Qwen2, Qwen3)
through ``LLM.encode(pooling_task="token_classify")`` against Hugging Face transformers in fp32 on the
CPU: per-token probabilities and raw logits of prompts of many lengths, packed several to a step
(small ``max_num_seqs`` and token budget, so packing or offset bugs move rows between prompts),
and what vLLM 0.26 does with the other pooling methods on such a model (refused, with its words).
vLLM's NER example itself runs in tests/test_vllm_pooling_examples.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.tiny_token_classifiers import (
    DECODER_FAMILIES,
    NER_LABELS,
    save_bert_token_classifier,
    save_decoder_token_classifier,
    save_xlmr_token_classifier,
)
from tokenmill import LLM, PoolerConfig, PoolingParams

KINDS = ("bert", "xlmr", *DECODER_FAMILIES)
# Encoders: max_model_len 64; decoders cut to 128 of their 256 positions. Three prompts a step at most.
ENGINES = {"bert": dict(max_num_batched_tokens=96), "xlmr": dict(max_num_batched_tokens=96)}
DECODER_ENGINE = dict(max_model_len=128, max_num_batched_tokens=160)
COMMON = dict(dtype="float32", device="cpu", seed=0, max_num_seqs=3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("token_classifiers")
    made = {"bert": save_bert_token_classifier(root, seed=31), "xlmr": save_xlmr_token_classifier(root, seed=32)}
    for i, family in enumerate(DECODER_FAMILIES):
        made[family] = save_decoder_token_classifier(root, family, seed=33 + i)
    return made


@pytest.fixture(scope="module")
def llms(folders) -> dict[str, LLM]:
    return {kind: LLM(str(folders[kind]), **COMMON, **ENGINES.get(kind, DECODER_ENGINE)) for kind in KINDS}


def _texts(random_sentences, kind: str) -> list[str]:
    # Lengths from 1 word to the model's longest prompt (an XLM-R prompt of 62 words is 64 tokens:
    # its last position row), so prompts of very different lengths share steps.
    longest = {"bert": 62, "xlmr": 62}.get(kind, 24)
    return random_sentences(10, seed=41, low=1, high=longest) + [" ".join(["cat"] * longest), "dog"]


def _hf_logits(folder: Path, texts: list[str]) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids, logits = [], []
    with torch.no_grad():
        for text in texts:  # one at a time: the reference needs no padding or attention mask of ours
            encoded = tokenizer(text, return_tensors="pt")
            ids.append(encoded["input_ids"][0].tolist())
            logits.append(model(**encoded).logits[0])
    return ids, logits


@pytest.mark.parametrize("kind", KINDS)
def test_per_token_probabilities_and_logits_match_transformers(kind, folders, llms, random_sentences):
    llm, texts = llms[kind], _texts(random_sentences, kind)
    ids, expected = _hf_logits(folders[kind], texts)
    assert llm.supported_tasks == (("token_classify",) if kind in ("bert", "xlmr") else ("classify", "token_classify"))
    probs = llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
    raw = llm.encode(texts, PoolingParams(use_activation=False), pooling_task="token_classify", use_tqdm=False)
    for out, logits_out, prompt_ids, logits in zip(probs, raw, ids, expected):
        assert out.prompt_token_ids == prompt_ids
        data = out.outputs.data
        assert data.dtype == torch.float32 and data.shape == (len(prompt_ids), len(NER_LABELS))
        torch.testing.assert_close(data, logits.softmax(-1), rtol=0, atol=1e-4)  # vLLM's default: softmax per token
        torch.testing.assert_close(logits_out.outputs.data, logits, rtol=0, atol=1e-4)
    assert len(probs[-2].prompt_token_ids) >= 26 and len(probs[-1].prompt_token_ids) <= 4
    # Not a constant: a random head gives tokens different labels.
    every_token = torch.cat([out.outputs.data for out in probs])
    assert every_token.std(0).max() > 1e-2 and len(set(every_token.argmax(-1).tolist())) > 1


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_mixed_params_in_one_step_and_token_prompts(kind, folders, llms, random_sentences):
    """Requests with and without the activation share steps (two groups cut from one packed batch),
    and token-id prompts give the same rows as their text."""
    llm, texts = llms[kind], _texts(random_sentences, kind)[:7]
    ids, expected = _hf_logits(folders[kind], texts)
    params = [PoolingParams(use_activation=i % 2 == 0) for i in range(len(texts))]
    prompts = [text if i % 3 else {"prompt_token_ids": prompt_ids} for i, (text, prompt_ids) in enumerate(zip(texts, ids))]
    outputs = llm.encode(prompts, params, pooling_task="token_classify", use_tqdm=False)
    for i, (out, logits) in enumerate(zip(outputs, expected)):
        assert out.prompt_token_ids == ids[i]
        torch.testing.assert_close(out.outputs.data, logits.softmax(-1) if i % 2 == 0 else logits, rtol=0, atol=1e-4)


def test_encode_without_a_task_labels_tokens(llms):
    """vLLM 0.26 wants a pooling_task; tokenmill's encode() without one takes the model's own, here
    token_classify (the NER example of vLLM before 0.26 called encode(prompts) alone)."""
    (out,) = llms["bert"].encode("the cat sat on the mat", use_tqdm=False)
    assert out.outputs.data.shape == (len(out.prompt_token_ids), len(NER_LABELS))


def test_bias_free_score_head(tmp_path, random_sentences):
    folder = save_decoder_token_classifier(tmp_path, "qwen3", seed=39, token_classification_bias=False)
    texts = random_sentences(4, seed=43, high=12)
    _, expected = _hf_logits(folder, texts)
    llm = LLM(str(folder), **COMMON, **DECODER_ENGINE)
    outputs = llm.encode(texts, PoolingParams(use_activation=False), pooling_task="token_classify", use_tqdm=False)
    for out, logits in zip(outputs, expected):
        torch.testing.assert_close(out.outputs.data, logits, rtol=0, atol=1e-4)


# ---- the other pooling methods, as vLLM 0.26 answers them --------------------------------------------


@pytest.mark.parametrize("kind", ["bert", "xlmr", "llama"])
def test_embedding_tasks_are_refused(kind, llms):
    llm = llms[kind]
    with pytest.raises(ValueError, match=r"^Embedding API is not supported by this model: task 'embed' is not served .*"
                                         r"ForTokenClassification, token_classify\); use LLM.encode\(pooling_task='token_classify'\)$"):
        llm.embed("the cat", use_tqdm=False)
    with pytest.raises(ValueError, match="^Embedding API is not supported by this model: task 'token_embed'"):
        llm.encode("the cat", pooling_task="token_embed", use_tqdm=False)


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_encoder_token_classifier_refuses_classify_and_score(kind, llms):
    llm = llms[kind]
    for call in (lambda: llm.classify("the cat", use_tqdm=False),
                 lambda: llm.encode("the cat", pooling_task="classify", use_tqdm=False)):
        with pytest.raises(ValueError, match=r"^Classification API is not supported by this model: task 'classify' is "
                                             r"not served .*use LLM.encode\(pooling_task='token_classify'\)$"):
            call()
    # vLLM's words; checked before the inputs (an empty data_2 would be an error of its own)
    with pytest.raises(ValueError, match=r"^This model does not support the Scoring API: .* labels each prompt token"):
        llm.score("the cat", [], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\['dimensions'\] do not apply to task 'token_classify'"):
        llm.encode("the cat", PoolingParams(dimensions=4), pooling_task="token_classify", use_tqdm=False)


def test_encoder_token_classifier_refuses_other_runners_and_tasks(folders):
    folder = str(folders["bert"])
    with pytest.raises(ValueError, match=r"PoolerConfig.task='classify' is not served by BertForTokenClassification "
                                         r"\(token_classify\); it serves \('token_classify',\)"):
        LLM(folder, **COMMON, pooler_config=PoolerConfig(task="classify"))
    with pytest.raises(ValueError, match="BertForTokenClassification cannot run as an embedding model"):
        LLM(folder, **COMMON, convert="embed")
    with pytest.raises(ValueError, match=r"is a pooling model \(token_classify\).*LLM.encode\(pooling_task='token_classify'\)"):
        LLM(folder, **COMMON, runner="generate")
    llm = LLM(folder, **COMMON, runner="pooling", convert="classify")  # vLLM's default convert for the suffix
    with pytest.raises(ValueError, match=r"LLM.generate\(\) needs a generative model.*use LLM.encode\(pooling_task='token_classify'\)$"):
        llm.generate("the cat")


def test_decoder_token_classifier_classifies_the_last_token_when_its_pooler_config_says_so(folders, llms, random_sentences):
    """vLLM 0.26 runs Qwen3ForTokenClassification as its causal LM converted to a classifier: the
    score head serves token_classify by default, and classify (the last token) once
    PoolerConfig(task="classify") makes that the model's task."""
    folder, texts = folders["qwen3"], random_sentences(5, seed=44, high=20)
    with pytest.raises(ValueError, match=r"^Try switching the model's pooling_task via `PoolerConfig\(task=\"classify\"\)`"):
        llms["qwen3"].classify(texts, use_tqdm=False)
    with pytest.raises(ValueError, match="^This model does not support the Scoring API"):
        llms["qwen3"].score("a", "b", use_tqdm=False)
    llm = LLM(str(folder), **COMMON, **DECODER_ENGINE, pooler_config=PoolerConfig(task="classify"))
    assert llm.supported_tasks == ("classify", "token_classify")
    _, expected = _hf_logits(folder, texts)
    for out, logits in zip(llm.classify(texts, use_tqdm=False), expected):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), logits[-1].softmax(-1), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"^Scoring API is only enabled for num_labels == 1\."):
        llm.score("a", "b", use_tqdm=False)


# ---- the batch job -----------------------------------------------------------------------------------


def test_batch_job_refuses_token_classifiers(tmp_path, folders, llms, capsys):
    """The job writes one result per row (embed, classify, score) and has no encode-style task."""
    from tokenmill.batch.job import JobConfig, run_job
    from tokenmill.cli import main

    from support.jsonl import write_jsonl

    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "the cat"}])
    config = JobConfig(input=str(source), output=str(tmp_path / "out.jsonl"), model="tiny", task="classify", progress=False)
    with pytest.raises(ValueError, match=r"^--task classify: BertForTokenClassification is a token classifier \(a label per "
                                         r"prompt token\); the batch job runs --task embed, classify, score .* not token_classify"):
        run_job(config, llm=llms["bert"])
    with pytest.raises(SystemExit) as exited:  # argparse's refusal of a --task value
        main(["run", str(source), "-o", str(tmp_path / "o.jsonl"), "--task", "token_classify"])
    assert exited.value.code == 2 and "invalid choice: 'token_classify'" in capsys.readouterr().err
    assert main(["run", str(source), "-o", str(tmp_path / "o.jsonl"), "--task", "classify", "--model", str(folders["bert"]),
                 "--device", "cpu", "--no-progress"]) == 2
    assert "--task classify: BertForTokenClassification is a token classifier" in capsys.readouterr().err
