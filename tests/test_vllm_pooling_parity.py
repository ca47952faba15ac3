"""vLLM 0.26's offline pooling tests, ported to tokenmill's tiny models.

Ported from vLLM's tests/entrypoints/pooling/: embed/test_offline.py, classify/test_offline.py,
token_embed/test_offline.py, token_classify/test_offline.py, scoring/test_cross_encoder_offline.py,
scoring/test_bi_encoder_offline.py, basic/test_encode.py, basic/test_tiling_engine.py,
basic/test_truncation.py (its online checks, through vLLM 0.26's offline ``tokenization_kwargs``) and
test_offline_params.py. Reference values come from transformers and sentence-transformers, never
from tokenmill; vLLM's hub models are replaced by the session's tiny BERTs (tests/conftest.py).
"""

from __future__ import annotations

import functools
import json
import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tokenmill import (
    LLM,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolerConfig,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
)
from tokenmill.inputs import TokensPrompt

PROMPT = "the chef prepared a delicious meal."
TEXTS_1 = ["what is the capital of france?", "what is the capital of germany?"]
TEXTS_2 = ["the capital of france is paris.", "the capital of germany is berlin."]
ENGINE = dict(dtype="float32", device="cpu", seed=0, max_num_seqs=3)


@functools.lru_cache(maxsize=None)
def _hf(folder: str, cls_name: str):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(folder).eval(), transformers.AutoTokenizer.from_pretrained(folder)


def _ids(folder, text: str) -> list[int]:
    return _hf(str(folder), "AutoModel")[1](text)["input_ids"]


def _hf_pair_logits(folder, pairs: list[list[str]]) -> torch.Tensor:
    model, tok = _hf(str(folder), "BertForSequenceClassification")
    batch = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits[:, 0]


# ---- embed/test_offline.py ---------------------------------------------------------------------


def test_embed_prompt_forms(bert_embedder_llm, tiny_bert_embedder_dir):
    ids = _ids(tiny_bert_embedder_dir, PROMPT)
    for prompts, count in ((PROMPT, 1), ([ids], 1), ([PROMPT, ids], 2), (TokensPrompt(prompt_token_ids=ids), 1)):
        outputs = bert_embedder_llm.embed(prompts, use_tqdm=False)
        assert len(outputs) == count
        for out in outputs:
            assert isinstance(out, EmbeddingRequestOutput)
            assert out.prompt_token_ids == ids
            assert len(out.outputs.embedding) == out.outputs.hidden_size == 32


def test_embed_use_activation_is_the_normalisation(bert_embedder_llm, tiny_bert_embedder_dir):
    from sentence_transformers import SentenceTransformer

    def get(use_activation):
        params = PoolingParams(use_activation=use_activation)
        return torch.tensor([o.outputs.embedding for o in bert_embedder_llm.embed([PROMPT], params, use_tqdm=False)])

    w_normal, wo_normal = get(True), get(False)
    assert not torch.allclose(w_normal, wo_normal, atol=1e-2)
    assert torch.allclose(w_normal, F.normalize(wo_normal, p=2, dim=-1), atol=1e-4)
    reference = SentenceTransformer(str(tiny_bert_embedder_dir), device="cpu").encode([PROMPT], convert_to_tensor=True)
    assert torch.allclose(wo_normal, reference, atol=1e-4)
    # vLLM 0.26 normalises by default; tokenmill follows the sentence-transformers folder, which has
    # no Normalize module here (README: "sentence-transformers folders are read for ... normalisation").
    assert torch.allclose(get(None), reference, atol=1e-4)


@pytest.mark.parametrize("task", ["classify", "token_classify"])
def test_embedder_refuses_classification_tasks(bert_embedder_llm, task):
    with pytest.raises(ValueError, match="Classification API is not supported by this model.+"):
        bert_embedder_llm.encode(PROMPT, pooling_task=task, use_tqdm=False)


# ---- token_embed/test_offline.py -----------------------------------------------------------------


def test_token_embed_shape(bert_embedder_llm, tiny_bert_embedder_dir):
    ids = _ids(tiny_bert_embedder_dir, PROMPT)
    for prompts in (PROMPT, [ids]):
        (out,) = bert_embedder_llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        assert isinstance(out, PoolingRequestOutput)
        assert out.outputs.data.shape == (len(ids), 32)


# ---- classify/test_offline.py ------------------------------------------------------------------


def test_classify_prompt_forms(bert_classifier_llm, tiny_bert_classifier_dir):
    ids = _ids(tiny_bert_classifier_dir, PROMPT)
    for prompts, count in ((PROMPT, 1), ([ids], 1), ([PROMPT, ids], 2)):
        outputs = bert_classifier_llm.classify(prompts, use_tqdm=False)
        assert len(outputs) == count
        for out in outputs:
            assert isinstance(out, ClassificationRequestOutput)
            assert out.prompt_token_ids == ids
            assert len(out.outputs.probs) == out.outputs.num_classes == 3


def test_classify_use_activation(bert_classifier_llm, tiny_bert_classifier_dir):
    def get(use_activation):
        params = PoolingParams(use_activation=use_activation)
        return torch.tensor([o.outputs.probs for o in bert_classifier_llm.classify(PROMPT, pooling_params=params,
                                                                                    use_tqdm=False)])

    default, w_activation, wo_activation = get(None), get(True), get(False)
    assert torch.allclose(default, w_activation, atol=1e-2)
    assert not torch.allclose(w_activation, wo_activation, atol=1e-2)
    assert torch.allclose(wo_activation.softmax(-1), w_activation, atol=1e-4)
    model, tok = _hf(str(tiny_bert_classifier_dir), "BertForSequenceClassification")
    with torch.no_grad():
        assert torch.allclose(wo_activation, model(**tok(PROMPT, return_tensors="pt")).logits, atol=1e-4)


def test_score_needs_one_label(bert_classifier_llm):
    with pytest.raises(ValueError, match=r"Scoring API is only enabled for num_labels == 1\."):
        bert_classifier_llm.score("ping", "pong", use_tqdm=False)


@pytest.mark.parametrize("task", ["embed", "token_embed"])
def test_classifier_refuses_embedding_tasks(bert_classifier_llm, task):
    with pytest.raises(ValueError, match="Embedding API is not supported by this model.+"):
        bert_classifier_llm.encode(PROMPT, pooling_task=task, use_tqdm=False)


def test_plugin_task_is_refused_by_name(bert_classifier_llm):
    with pytest.raises(ValueError, match="pooling_task='plugin'.*not supported: tokenmill has no plugins"):
        bert_classifier_llm.encode(PROMPT, pooling_task="plugin", use_tqdm=False)


# ---- token_classify/test_offline.py ---------------------------------------------------------------


def test_token_classify(bert_classifier_llm, tiny_bert_classifier_dir):
    ids = _ids(tiny_bert_classifier_dir, PROMPT)
    model, tok = _hf(str(tiny_bert_classifier_dir), "BertForSequenceClassification")
    with torch.no_grad():  # vLLM's BERT token_classify: the classifier on every token's final state
        logits = model.classifier(model.bert(**tok(PROMPT, return_tensors="pt")).last_hidden_state[0])
    for prompts in (PROMPT, [ids]):
        (out,) = bert_classifier_llm.encode(prompts, pooling_task="token_classify", use_tqdm=False)
        assert isinstance(out, PoolingRequestOutput)
        assert out.prompt_token_ids == ids
        assert out.outputs.data.shape == (len(ids), 3)
        assert torch.allclose(out.outputs.data, logits.softmax(-1), atol=1e-4)
    raw = bert_classifier_llm.encode(PROMPT, PoolingParams(use_activation=False), pooling_task="token_classify",
                                     use_tqdm=False)
    assert torch.allclose(raw[0].outputs.data, logits, atol=1e-4)


def test_reward_is_token_classify(bert_classifier_llm, bert_embedder_llm):
    """vLLM's LLM.reward (tests/entrypoints/llm/test_reward.py): encode(pooling_task="token_classify"),
    the activation on by default and off with use_activation=False (softmax=False, its older name)."""
    expected = bert_classifier_llm.encode(PROMPT, pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    (out,) = bert_classifier_llm.reward([PROMPT], use_tqdm=False)
    assert isinstance(out, PoolingRequestOutput) and torch.allclose(out.outputs.data, expected)
    raw = bert_classifier_llm.reward(PROMPT, pooling_params=PoolingParams(softmax=False), use_tqdm=False)[0].outputs.data
    assert torch.allclose(raw.softmax(-1), expected, atol=1e-5) and not torch.allclose(raw, expected, atol=1e-2)
    with pytest.raises(ValueError, match="token_classify"):
        bert_embedder_llm.reward(PROMPT, use_tqdm=False)


def test_pooler_config_task_token_classify(tiny_bert_classifier_dir):
    llm = LLM(str(tiny_bert_classifier_dir), pooler_config=PoolerConfig(task="token_classify"), **ENGINE)
    ids = _ids(tiny_bert_classifier_dir, PROMPT)
    (out,) = llm.encode(PROMPT, use_tqdm=False)  # the PoolerConfig's task when none is given
    assert out.outputs.data.shape == (len(ids), 3)
    assert llm.supported_tasks == ("classify", "token_classify")
    with pytest.raises(ValueError, match="PoolerConfig.task='token_embed' is not served"):
        LLM(str(tiny_bert_classifier_dir), pooler_config={"task": "token_embed"}, **ENGINE)
    with pytest.raises(ValueError, match="PoolerConfig.task='score' is invalid.*'classify'"):
        PoolerConfig(task="score")
    assert PoolerConfig(pooling_type="ALL").tok_pooling_type == "ALL"


# ---- scoring/test_cross_encoder_offline.py ---------------------------------------------------------


def test_cross_encoder_1_to_1_1_to_n_n_to_n(cross_encoder_llm, tiny_cross_encoder_dir):
    cases = [
        ((TEXTS_1[0], TEXTS_2[0]), [[TEXTS_1[0], TEXTS_2[0]]]),
        ((TEXTS_1[0], TEXTS_2), [[TEXTS_1[0], TEXTS_2[0]], [TEXTS_1[0], TEXTS_2[1]]]),
        ((TEXTS_1, TEXTS_2), [[TEXTS_1[0], TEXTS_2[0]], [TEXTS_1[1], TEXTS_2[1]]]),
    ]
    for (data_1, data_2), pairs in cases:
        scores = [o.outputs.score for o in cross_encoder_llm.score(data_1, data_2, use_tqdm=False)]
        expected = _hf_pair_logits(tiny_cross_encoder_dir, pairs).sigmoid().tolist()
        assert scores == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="2 texts in data_1 and 1 in data_2"):  # vLLM: "1:1, 1:N or N:N"
        cross_encoder_llm.score(TEXTS_1, TEXTS_2[0], use_tqdm=False)


def test_cross_encoder_classify_and_use_activation(cross_encoder_llm, tiny_cross_encoder_dir):
    (out,) = cross_encoder_llm.encode(PROMPT, pooling_task="classify", use_tqdm=False)
    assert len(out.outputs.data) == 1

    def get(use_activation):
        params = PoolingParams(use_activation=use_activation)
        return torch.tensor([o.outputs.score for o in cross_encoder_llm.score(TEXTS_1[0], TEXTS_2[0],
                                                                               pooling_params=params, use_tqdm=False)])

    default, w_activation, wo_activation = get(None), get(True), get(False)
    assert torch.allclose(default, w_activation, atol=1e-2)
    assert not torch.allclose(w_activation, wo_activation, atol=1e-2)
    assert torch.allclose(wo_activation.sigmoid(), w_activation, atol=1e-4)
    assert torch.allclose(wo_activation, _hf_pair_logits(tiny_cross_encoder_dir, [[TEXTS_1[0], TEXTS_2[0]]]), atol=1e-4)


def test_score_leaves_caller_params_and_checks_their_task(cross_encoder_llm):
    params = PoolingParams()
    cross_encoder_llm.score("query", "doc", pooling_params=params, use_tqdm=False)
    assert params.task is None
    with pytest.raises(ValueError, match="task='embed'"):
        cross_encoder_llm.score("query", "doc", pooling_params=PoolingParams(task="embed"), use_tqdm=False)
    # vLLM 0.26 runs a cross-encoder's scores as its "classify" task
    cross_encoder_llm.score("query", "doc", pooling_params=PoolingParams(task="classify"), use_tqdm=False)


def test_score_refuses_what_tokenmill_lacks(cross_encoder_llm):
    with pytest.raises(ValueError, match=r"multi-modal input .* not supported .*give strings"):
        cross_encoder_llm.score({"content": [{"type": "text", "text": "a"}]}, "b", use_tqdm=False)
    with pytest.raises(ValueError, match="late_interaction_params.*ColBERT"):
        PoolingParams(late_interaction_params={"mode": "cache_query"})
    with pytest.raises(ValueError, match="lora_request=.* is not supported for pooling models"):
        cross_encoder_llm.score("a", "b", lora_request=object(), use_tqdm=False)


@pytest.fixture(scope="module")
def identity_cross_encoder(tiny_cross_encoder_dir, tmp_path_factory):
    """The cross-encoder saved by sentence-transformers with an Identity activation, and a fast tokenizer."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("identity_ce") / "model"
    shutil.copytree(tiny_cross_encoder_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    BertTokenizerFast.from_pretrained(str(tiny_cross_encoder_dir)).save_pretrained(str(folder))
    return folder, LLM(str(folder), **ENGINE)


def test_cross_encoder_activation_applies_to_classify(identity_cross_encoder, tiny_cross_encoder_dir):
    # vLLM 0.26's get_act_fn: the saved activation is the classifier's, for classify and score alike.
    _, llm = identity_cross_encoder
    logits = _hf_pair_logits(tiny_cross_encoder_dir, [[TEXTS_1[0], TEXTS_2[0]]])
    (score,) = llm.score(TEXTS_1[0], TEXTS_2[0], use_tqdm=False)
    assert score.outputs.score == pytest.approx(float(logits[0]), abs=1e-4)
    model, tok = _hf(str(tiny_cross_encoder_dir), "BertForSequenceClassification")
    with torch.no_grad():
        raw = model(**tok(PROMPT, return_tensors="pt")).logits[0]
    (out,) = llm.classify(PROMPT, use_tqdm=False)
    assert out.outputs.probs == pytest.approx(raw.tolist(), abs=1e-4)


def test_max_tokens_per_doc(identity_cross_encoder):
    folder, llm = identity_cross_encoder
    long_doc = "the cat sat on the warm mat. " * 3
    no_limit = llm.score(TEXTS_1[0], long_doc, use_tqdm=False)
    with_limit = llm.score(TEXTS_1[0], long_doc, pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 4}),
                           use_tqdm=False)
    assert len(with_limit[0].prompt_token_ids) < len(no_limit[0].prompt_token_ids)
    _, tok = _hf(str(folder), "BertForSequenceClassification")
    doc_ids = tok(long_doc, add_special_tokens=False)["input_ids"][:4]
    assert with_limit[0].prompt_token_ids == tok(tok.decode(tok(TEXTS_1[0], add_special_tokens=False)["input_ids"]),
                                                  tok.decode(doc_ids))["input_ids"]
    with pytest.raises(ValueError, match="extra_kwargs.*max_tokens_per_doc.*must be less than max_model_len"):
        llm.score("a", "b", pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 10_000}), use_tqdm=False)


# ---- scoring/test_bi_encoder_offline.py ------------------------------------------------------------


def test_bi_encoder_scores(bert_embedder_llm, tiny_bert_embedder_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(tiny_bert_embedder_dir), device="cpu")

    def cosine(pairs):
        a = st.encode([p[0] for p in pairs], convert_to_tensor=True)
        b = st.encode([p[1] for p in pairs], convert_to_tensor=True)
        return F.cosine_similarity(a, b, dim=-1).tolist()

    for (data_1, data_2), pairs in (
        ((TEXTS_1[0], TEXTS_2[0]), [[TEXTS_1[0], TEXTS_2[0]]]),
        ((TEXTS_1[0], TEXTS_2), [[TEXTS_1[0], TEXTS_2[0]], [TEXTS_1[0], TEXTS_2[1]]]),
        ((TEXTS_1, TEXTS_2), [[TEXTS_1[0], TEXTS_2[0]], [TEXTS_1[1], TEXTS_2[1]]]),
    ):
        scores = [o.outputs.score for o in bert_embedder_llm.score(data_1, data_2, use_tqdm=False)]
        assert scores == pytest.approx(cosine(pairs), rel=1e-4)
    (out,) = bert_embedder_llm.encode(PROMPT, pooling_task="embed", use_tqdm=False)
    assert len(out.outputs.data) == 32


# ---- basic/test_encode.py, basic/test_tiling_engine.py -------------------------------------------


def test_multiple_pooling_params(bert_embedder_llm):
    prompts = [f"prompt {i} of the test" for i in range(10)]  # more than max_num_seqs: several steps
    outputs = bert_embedder_llm.encode(prompts, pooling_params=[PoolingParams() for _ in prompts],
                                       pooling_task="embed", use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [_ids_of(bert_embedder_llm, p) for p in prompts]
    with pytest.raises(ValueError):
        bert_embedder_llm.encode(prompts, pooling_params=[PoolingParams()] * 3, pooling_task="embed", use_tqdm=False)
    assert len(bert_embedder_llm.encode(prompts, pooling_params=PoolingParams(), pooling_task="embed", use_tqdm=False)) == 10
    assert len(bert_embedder_llm.encode(prompts, pooling_params=None, pooling_task="embed", use_tqdm=False)) == 10


def _ids_of(llm, text):
    return llm.get_tokenizer()(text)["input_ids"]


def test_abort_on_exception(bert_embedder_llm):
    engine = bert_embedder_llm.llm_engine
    original_step, calls = engine.step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("Simulated engine error")
        return original_step(*args, **kwargs)

    prompts = [f"prompt {i}" for i in range(10)]
    with mock.patch.object(engine, "step", side_effect=failing_step):
        with mock.patch.object(engine, "abort_request", wraps=engine.abort_request) as abort:
            with pytest.raises(RuntimeError, match="Simulated engine error"):
                bert_embedder_llm.encode(prompts, pooling_task="embed", use_tqdm=False)
    (request_ids,), _ = abort.call_args
    assert isinstance(request_ids, list) and len(request_ids) > 0
    assert not engine.has_unfinished_requests()


def test_use_tqdm_factory(bert_embedder_llm):
    made = []

    def factory(**kwargs):
        from tqdm import tqdm

        made.append(kwargs)
        return tqdm(disable=True, **kwargs)

    assert len(bert_embedder_llm.embed(["a cat", "a dog"], use_tqdm=factory)) == 2
    assert made and made[0]["total"] == 2


# ---- basic/test_truncation.py (online), through vLLM 0.26's tokenization_kwargs -----------------


def test_truncation(bert_embedder_llm):
    long_text = " ".join(["calculus"] * 100)
    max_model_len = bert_embedder_llm.llm_engine.config.max_model_len
    (out,) = bert_embedder_llm.embed(long_text, tokenization_kwargs={"truncate_prompt_tokens": 10}, use_tqdm=False)
    assert len(out.prompt_token_ids) == 10
    (out,) = bert_embedder_llm.embed(long_text, tokenization_kwargs={"truncate_prompt_tokens": -1}, use_tqdm=False)
    assert len(out.prompt_token_ids) == max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        bert_embedder_llm.embed(long_text, tokenization_kwargs={"truncate_prompt_tokens": max_model_len + 1},
                                use_tqdm=False)
    (out,) = bert_embedder_llm.embed("a cat", tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)
    assert out.prompt_token_ids == bert_embedder_llm.get_tokenizer()("a cat", add_special_tokens=False)["input_ids"]


def test_unknown_tokenization_kwargs_are_refused_by_name(bert_embedder_llm, cross_encoder_llm):
    """Keys vLLM's renderer does not read (it drops them with a warning) went to the tokenizer, where
    stride or is_split_into_words may act and a misspelt key does nothing: refused, naming the keys."""
    for kwargs in ({"is_split_into_words": True}, {"truncate_prompt_token": 3}):
        with pytest.raises(ValueError, match=r"is not supported: the keys are add_special_tokens, truncation, "
                                             r"max_length, padding, truncate_prompt_tokens, truncation_side"):
            bert_embedder_llm.embed(["a cat", "a dog"], tokenization_kwargs=kwargs, use_tqdm=False)
        with pytest.raises(ValueError, match=r"tokenization_kwargs\['"):
            cross_encoder_llm.score("a cat", "a dog", tokenization_kwargs=kwargs, use_tqdm=False)
    assert not bert_embedder_llm.llm_engine.has_unfinished_requests()


# ---- outputs, PoolingParams and the engine, as vLLM 0.26 spells them --------------------------------


def test_output_classes_take_vllm_positional_order():
    out = PoolingRequestOutput("7", PoolingOutput(torch.tensor([0.5, 0.25])), [1, 2], 0, True)
    assert out.num_cached_tokens == 0 and out.finished is True
    embedded = EmbeddingRequestOutput.from_base(out)
    assert (embedded.request_id, embedded.outputs.embedding, embedded.num_cached_tokens, embedded.finished) == \
        ("7", [0.5, 0.25], 0, True)


def test_pooling_params_vllm_fields():
    from tokenmill import RequestOutputKind

    params = PoolingParams(requires_token_ids=True, extra_kwargs={"max_tokens_per_query": 3},
                           output_kind=RequestOutputKind.FINAL_ONLY)
    assert params.requires_token_ids and params.extra_kwargs == {"max_tokens_per_query": 3}
    with pytest.raises(ValueError, match="output_kind.*FINAL_ONLY"):
        PoolingParams(output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match="extra_kwargs.*max_tokens_per_query"):
        PoolingParams(extra_kwargs={"max_tokens": 3})


def test_engine_add_request_keywords(bert_embedder_llm):
    engine = bert_embedder_llm.llm_engine
    assert engine.get_supported_tasks() == bert_embedder_llm.supported_tasks == ("embed", "token_embed")
    request_id = engine.add_request("parity-0", {"prompt_token_ids": [5, 6]}, PoolingParams(task="embed"),
                                    arrival_time=1.0, lora_request=None, tokenization_kwargs=None, trace_headers=None,
                                    priority=0, prompt_text="a cat")
    assert request_id == "parity-0"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["parity-0"] and outputs[0].prompt_token_ids == [5, 6]
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(0, "a cat")
    with pytest.raises(ValueError, match="lora_request=.* is not supported for pooling models"):
        engine.add_request("parity-1", "a cat", lora_request=object())
