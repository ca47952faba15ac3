"""The pooling API's contract: which runner a model gets, errors that name the field or the method
that fits, PoolingParams validation, score's pairing rules, and engine-level requests (token types,
truncation, abort) on tiny random models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenmill import LLM, PoolingParams, SamplingParams
from tokenmill.outputs import EmbeddingOutput, PoolingOutput, ScoringOutput

ENGINE = dict(dtype="float32", device="cpu", seed=0)


@pytest.fixture(scope="module")
def generator(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=64, kv_cache_memory_bytes=8 * 2**20, **ENGINE)


@pytest.fixture(autouse=True)
def engines_left_clean(request):
    yield
    for name in ("bert_embedder_llm", "bert_classifier_llm", "cross_encoder_llm", "generator"):
        if name in request.fixturenames:
            assert not request.getfixturevalue(name).llm_engine.has_unfinished_requests()


# --- the method that fits ------------------------------------------------------------------------


def test_generation_on_a_pooling_model_names_the_pooling_methods(bert_embedder_llm, bert_classifier_llm):
    with pytest.raises(ValueError, match=r"LLM.generate\(\) needs a generative model.*use LLM.embed\(\)"):
        bert_embedder_llm.generate("the cat")
    with pytest.raises(ValueError, match=r"LLM.chat\(\) needs a generative model.*is a pooling model: use LLM.classify\(\) or LLM.encode\(pooling_task='token_classify'\)$"):
        bert_classifier_llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"pooling model: use LLM.embed\(\)"):
        bert_embedder_llm.llm_engine.add_request("r1", "the cat", SamplingParams())


@pytest.mark.parametrize("method", ["embed", "classify", "encode"])
def test_pooling_on_a_generative_model_says_how_to_start_one(generator, method):
    with pytest.raises(ValueError, match=rf"LLM.{method}\(\) needs a pooling model.*generate\(\).*runner='pooling'"):
        getattr(generator, method)(["the cat"])
    with pytest.raises(ValueError, match=r"LLM.score\(\) needs a pooling model"):
        generator.score("a", "b")


def test_a_task_the_head_does_not_serve_names_the_right_method(bert_embedder_llm, bert_classifier_llm):
    with pytest.raises(ValueError, match=r"task 'classify' is not served.*BertModel, embed.*use LLM.embed\(\)"):
        bert_embedder_llm.classify("the cat")
    with pytest.raises(ValueError, match=r"task 'embed' is not served.*use LLM.classify\(\)"):
        bert_classifier_llm.embed("the cat")
    with pytest.raises(ValueError, match=r"score needs a cross-encoder.*3 labels: use LLM.classify\(\)"):
        bert_classifier_llm.score("the cat", "a dog")
    with pytest.raises(ValueError, match="pooling_task='rerank' is invalid"):
        bert_classifier_llm.encode("the cat", pooling_task="rerank")


def test_encode_defaults_to_the_model_task(bert_classifier_llm):
    raw = bert_classifier_llm.encode(["the cat", "a dog sat"], use_tqdm=False)
    probs = bert_classifier_llm.classify(["the cat", "a dog sat"], use_tqdm=False)
    assert [o.outputs.data.tolist() for o in raw] == [o.outputs.probs for o in probs]
    assert raw[0].finished and raw[0].outputs.data.shape == (3,)


# --- which runner --------------------------------------------------------------------------------


def test_runner_task_and_convert(tiny_llama_dir, tiny_bert_embedder_dir, tiny_bert_classifier_dir):
    llm = LLM(str(tiny_llama_dir), task="embed", **ENGINE)  # vLLM's older spelling of runner="pooling"
    assert llm.llm_engine.pooling.architecture == "LlamaModel"
    assert llm.llm_engine.pooling.pooler.pooling_type == "LAST"
    with pytest.raises(ValueError, match="BertModel is a pooling model .*cannot generate.*LLM.embed"):
        LLM(str(tiny_bert_embedder_dir), runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="convert='classify'.*ForSequenceClassification.*LlamaForCausalLM"):
        LLM(str(tiny_llama_dir), runner="pooling", convert="classify", **ENGINE)
    with pytest.raises(ValueError, match="task='embed'.*runner='pooling'.*runner='generate'"):
        LLM(str(tiny_llama_dir), task="embed", runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is smaller than max_model_len=64"):
        LLM(str(tiny_bert_classifier_dir), max_num_batched_tokens=16, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: pooling models run on one device"):
        LLM(str(tiny_bert_classifier_dir), tensor_parallel_size=2, **ENGINE)


def test_apply_model_reaches_the_pooling_model(bert_classifier_llm):
    assert bert_classifier_llm.apply_model(lambda model: type(model).__name__) == ["BertForSequenceClassification"]
    with pytest.raises(ValueError, match="not available for a pooling model"):
        bert_classifier_llm.collective_rpc("determine_num_blocks")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"runner": "draft"}, r"LLM\(runner='draft'\) is invalid"),
        ({"convert": "reward"}, r"LLM\(convert='reward'\) is invalid"),
        ({"task": "transcription"}, r"LLM\(task='transcription'\) is invalid"),
        ({"pooler_config": {"pooling_typ": "MEAN"}}, r"pooler_config has unknown key\(s\) \['pooling_typ'\]"),
        ({"pooler_config": {"pooling_type": "MAX"}}, r"PoolerConfig.pooling_type='MAX' is invalid"),
    ],
)
def test_bad_engine_arguments_name_the_field(tiny_bert_embedder_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_bert_embedder_dir), **ENGINE, **kwargs)


def test_unsupported_sentence_transformers_module_is_refused(tiny_bert_embedder_dir, tmp_path):
    folder = tmp_path / "with_dense"
    shutil.copytree(tiny_bert_embedder_dir, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"modules.json has a 'sentence_transformers.models.Dense' module"):
        LLM(str(folder), **ENGINE)


# --- PoolingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dimensions": 0}, r"PoolingParams.dimensions=0 is invalid"),
        ({"normalize": "yes"}, r"PoolingParams.normalize='yes' is invalid"),
        ({"use_activation": 1}, r"PoolingParams.use_activation=1 is invalid"),
        ({"truncate_prompt_tokens": 0}, r"PoolingParams.truncate_prompt_tokens=0 is invalid"),
        ({"task": "rerank"}, r"PoolingParams.task='rerank' is invalid"),
        ({"softmax": False, "use_activation": True}, r"PoolingParams.softmax=False is invalid"),
        ({"step_tag_id": 5}, r"PoolingParams.step_tag_id=5 is invalid: must be None: STEP pooling"),
        ({"skip_reading_prefix_cache": "no"}, r"PoolingParams.skip_reading_prefix_cache='no' is invalid"),
    ],
)
def test_pooling_params_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**kwargs)


def test_pooling_params_take_numpy_integers_as_vllm_does():
    """vLLM's PoolingParams (a msgspec Struct) checks no types at construction: numpy integers are
    taken for truncate_prompt_tokens and dimensions; tokenmill stores the Python int they equal."""
    import numpy as np

    params = PoolingParams(truncate_prompt_tokens=np.int64(-1), dimensions=np.int32(8))
    assert (params.truncate_prompt_tokens, params.dimensions) == (-1, 8)
    assert type(params.truncate_prompt_tokens) is int and type(params.dimensions) is int
    with pytest.raises(ValueError, match=r"PoolingParams.dimensions=0 is invalid"):
        PoolingParams(dimensions=np.int64(0))


def test_use_activation_is_an_embedders_normalisation_as_in_vllm_0_26(tiny_bert_embedder_dir, bert_embedder_llm):
    """vLLM 0.26 dropped ``normalize``: ``use_activation`` switches an embedder's L2 normalisation,
    per request and in pooler_config; the older name still works and must agree when both are set."""
    embed = lambda llm, params=None: torch.tensor(llm.embed("the cat sat", params, use_tqdm=False)[0].outputs.embedding)
    raw = embed(bert_embedder_llm, PoolingParams(normalize=False))
    assert abs(float(raw.norm()) - 1.0) > 1e-3  # really unnormalised, so the checks below can tell
    torch.testing.assert_close(embed(bert_embedder_llm, PoolingParams(use_activation=False)), raw, rtol=0, atol=0)
    torch.testing.assert_close(embed(bert_embedder_llm, PoolingParams(use_activation=True)),
                               torch.nn.functional.normalize(raw, dim=0), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"normalize=True and use_activation=False disagree"):
        bert_embedder_llm.embed("the cat", PoolingParams(normalize=True, use_activation=False))
    torch.testing.assert_close(embed(bert_embedder_llm), raw, rtol=0, atol=0)  # its sentence-transformers folder: no Normalize
    normalising = LLM(str(tiny_bert_embedder_dir), **ENGINE, pooler_config={"use_activation": True})
    torch.testing.assert_close(embed(normalising), torch.nn.functional.normalize(raw, dim=0), rtol=0, atol=1e-6)
    torch.testing.assert_close(embed(normalising, PoolingParams(use_activation=False)), raw, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"pooler_config: normalize=True and use_activation=False disagree"):
        LLM(str(tiny_bert_embedder_dir), **ENGINE, pooler_config={"use_activation": False, "normalize": True})


def test_pooler_config_calibrates_classifier_logits(tiny_bert_classifier_dir, bert_classifier_llm):
    """vLLM's logit_mean / logit_sigma: activation((logit - mean) / sigma), raw outputs calibrated too."""
    texts = ["the cat", "a dog ran far"]
    raw = torch.tensor([o.outputs.probs for o in bert_classifier_llm.classify(texts, PoolingParams(use_activation=False), use_tqdm=False)])
    calibrated = LLM(str(tiny_bert_classifier_dir), **ENGINE, pooler_config={"logit_mean": 0.5, "logit_sigma": 2.0})
    got_raw = torch.tensor([o.outputs.probs for o in calibrated.classify(texts, PoolingParams(use_activation=False), use_tqdm=False)])
    torch.testing.assert_close(got_raw, (raw - 0.5) / 2.0, rtol=0, atol=1e-6)
    got = torch.tensor([o.outputs.probs for o in calibrated.classify(texts, use_tqdm=False)])
    torch.testing.assert_close(got, ((raw - 0.5) / 2.0).softmax(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "pooler_config, message",
    [
        ({"logit_sigma": 0}, "PoolerConfig.logit_sigma=0 is invalid"),
        ({"logit_mean": "high"}, "PoolerConfig.logit_mean='high' is invalid"),
        ({"tok_pooling_type": "STEP"}, "PoolerConfig.tok_pooling_type='STEP' is not supported"),
        ({"enable_chunked_processing": True}, "PoolerConfig.enable_chunked_processing=True is not supported"),
        ({"step_tag_id": 5}, "PoolerConfig.step_tag_id=5 is not supported"),
        ({"pooling_type": "CLS", "seq_pooling_type": "MEAN"}, "pooling_type='CLS' and seq_pooling_type='MEAN' disagree"),
    ],
)
def test_pooler_config_refuses_what_it_cannot_do(pooler_config, message):
    from tokenmill import PoolerConfig

    with pytest.raises(ValueError, match=message):
        PoolerConfig(**pooler_config)
    assert PoolerConfig(seq_pooling_type="mean").pooling_type == "MEAN"  # vLLM 0.26's name for it


def test_pooling_params_older_names_and_task_fields(bert_embedder_llm, bert_classifier_llm):
    assert PoolingParams(softmax=False).use_activation is False  # vLLM's deprecated spellings still work
    assert PoolingParams(activation=True).use_activation is True
    with pytest.raises(ValueError, match=r"\['normalize'\] do not apply to task 'classify'"):
        bert_classifier_llm.classify("the cat", PoolingParams(normalize=True))
    with pytest.raises(ValueError, match="not trained for Matryoshka"):
        bert_embedder_llm.embed("the cat", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="got 1 pooling_params for 2 prompts"):
        bert_embedder_llm.embed(["a", "b"], [PoolingParams()])


def test_output_objects_check_their_shapes():
    assert EmbeddingOutput.from_base(PoolingOutput(torch.tensor([0.5, 1.5]))).hidden_size == 2
    assert ScoringOutput.from_base(PoolingOutput(torch.tensor([0.25]))).score == 0.25
    with pytest.raises(ValueError, match="one vector"):
        EmbeddingOutput.from_base(PoolingOutput(torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="one number"):
        ScoringOutput.from_base(PoolingOutput(torch.zeros(3)))


# --- score pairing ---------------------------------------------------------------------------------


def test_score_pairing_rules(bert_embedder_llm):
    with pytest.raises(ValueError, match="2 texts in data_1 and 3 in data_2"):
        bert_embedder_llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="at least one text"):
        bert_embedder_llm.score([], ["c"])
    for bad in (None, 5):  # were a bare "object is not iterable"
        with pytest.raises(ValueError, match=rf"score data_2={bad} is invalid: must be a text, a prompt dict or a list of them"):
            bert_embedder_llm.score("a", bad)
    one_to_n = bert_embedder_llm.score("the cat", ["a dog", "the cat", "red sun"], use_tqdm=False)
    assert len(one_to_n) == 3 and one_to_n[1].outputs.score == pytest.approx(1.0, abs=1e-5)
    n_to_n = bert_embedder_llm.score(["a dog", "the cat"], ["the cat", "the cat"], use_tqdm=False)
    assert n_to_n[1].outputs.score == pytest.approx(1.0, abs=1e-5)
    assert n_to_n[0].outputs.score == pytest.approx(one_to_n[0].outputs.score, abs=1e-6)


@pytest.mark.parametrize("data_1, data_2, where", [(["a", None], ["b", "c"], r"data_1\[1\]=None"),
                                                   ("a", [5], r"data_2\[0\]=5")])
def test_a_cross_encoder_names_an_input_that_is_no_text(cross_encoder_llm, data_1, data_2, where):
    """vLLM's cross-encoders take texts only; this was a TypeError naming neither the argument nor its index."""
    with pytest.raises(ValueError, match=rf"score {where}.* is invalid: a cross-encoder scores text pairs, so it must be a string"):
        cross_encoder_llm.score(data_1, data_2, use_tqdm=False)


def test_cross_encoder_takes_text_pairs(cross_encoder_llm):
    llm = cross_encoder_llm
    with pytest.raises(ValueError, match=r"score data_2\[0\]=\{'prompt_token_ids': \[5, 6\]\} is invalid: .*must be a string"):
        llm.score("the cat", [{"prompt_token_ids": [5, 6]}])
    assert not llm.llm_engine.has_unfinished_requests()


# --- engine-level requests -------------------------------------------------------------------------


def test_token_type_ids_are_checked(bert_classifier_llm):
    engine = bert_classifier_llm.llm_engine
    with pytest.raises(ValueError, match=r"token_type_ids must be 3 integers in \[0, 2\)"):
        engine.add_request("t1", {"prompt_token_ids": [2, 50, 3], "token_type_ids": [0, 2, 0]}, PoolingParams())
    with pytest.raises(ValueError, match="token_type_ids must be 3 integers"):
        engine.add_request("t2", {"prompt_token_ids": [2, 50, 3], "token_type_ids": [0, 1]}, PoolingParams())


def test_abort_leaves_the_other_requests_running(bert_classifier_llm):
    engine = bert_classifier_llm.llm_engine
    for i, text in enumerate(["the cat", "a dog sat on the mat", "blue river"]):
        engine.add_request(f"a{i}", text, PoolingParams(task="classify"))
    engine.abort_request("a1")
    done = []
    while engine.has_unfinished_requests():
        done.extend(engine.step())
    assert sorted(o.request_id for o in done) == ["a0", "a2"]
    assert all(o.finished and abs(sum(o.outputs.data.tolist()) - 1) < 1e-5 for o in done)


def test_add_and_abort_request_arguments_are_checked_as_the_generation_engines(bert_classifier_llm):
    engine = bert_classifier_llm.llm_engine
    with pytest.raises(ValueError, match=r"arrival_time='x' is invalid: must be None or a finite number"):
        engine.add_request("b0", "the cat", PoolingParams(), arrival_time="x")
    with pytest.raises(TypeError, match="request_ids must be a request id .* or a list of them, got NoneType"):
        engine.abort_request(None)  # iterating None failed with a bare TypeError
    assert not engine.has_unfinished_requests()


def test_truncation_of_text_and_token_ids(bert_classifier_llm, bert_embedder_llm):
    tok = bert_classifier_llm.get_tokenizer()
    text = "the quick brown fox jumps over the lazy dog and the cat"
    out = bert_classifier_llm.classify(text, truncate_prompt_tokens=6, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok(text, truncation=True, max_length=6)["input_ids"]  # [CLS] ... [SEP] kept
    ids = tok(text)["input_ids"]
    cut = bert_classifier_llm.encode({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[:5]  # the tokenizer truncates on the right
    with pytest.raises(ValueError, match="truncate_prompt_tokens=100 is larger than max_model_len=48"):
        bert_embedder_llm.embed(text, truncate_prompt_tokens=100)
    with pytest.raises(ValueError, match="more than max_model_len=48"):
        bert_embedder_llm.embed(" ".join(["cat"] * 60))
