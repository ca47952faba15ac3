"""Bad input: a clear error before any work starts, naming the request and the field."""

from __future__ import annotations

import pytest

from test_generate import GREEDY, as_inputs, make_llm
from tokenmill import LLM, BeamSearchParams, PoolingParams, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=64)


def assert_engine_idle(llm):
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.scheduler.has_unfinished()


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": list(range(3, 70))}, r"prompts\[1\] has 67 tokens, more than max_model_len=64"),
        ({"prompt_token_ids": []}, r"prompts\[1\] is empty"),
        ("", r"prompts\[1\] is empty"),
        ({"prompt_token_ids": [5, 10**7]}, r"prompts\[1\] holds token id 10000000, outside the vocabulary"),
        ({"prompt_token_ids": [5, -1]}, r"prompts\[1\] holds token id -1"),
        ({"prompt_token_ids": "abc"}, r"prompts\[1\].prompt_token_ids must be a list of integers"),
        ({"text": "hi"}, r"prompts\[1\] is a dict without 'prompt' or 'prompt_token_ids'"),
        (42, r"prompts\[1\] has type int"),
        ([5, "x"], r"prompts\[1\] is a list, so it must be token ids"),
        ({"prompt": "hi", "multi_modal_data": {"image": object()}}, r"prompts\[1\].multi_modal_data is not supported: .*text-only"),
        ({"prompt_embeds": [[0.0]]}, r"prompts\[1\].prompt_embeds is not supported"),
        ({"encoder_prompt": "hi", "decoder_prompt": None}, r"prompts\[1\].encoder_prompt is not supported"),
        ({"prompt": "hi", "cache_salt": 7}, r"prompts\[1\].cache_salt must be a non-empty string, got 7"),
    ],
)
def test_bad_prompt_fails_whole_call_before_work(llm, prompt, message):
    steps_before = llm.llm_engine.stats.num_steps
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, prompt], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats.num_steps == steps_before
    assert_engine_idle(llm)
    # The engine still works afterwards.
    assert llm.generate(as_inputs([[5, 6, 7]]), GREEDY, use_tqdm=False)[0].finished


def test_request_that_cannot_fit_the_cache_is_refused(tiny_llama_dir, llm):
    per_block = llm.llm_engine.executor.runner.kv_bytes_per_block()
    small = make_llm(tiny_llama_dir, max_model_len=64, kv_cache_memory_bytes=3 * per_block)
    with pytest.raises(ValueError, match=r"prompts\[0\] may grow to 50 tokens \(4 KV blocks\) but the KV cache holds only 2"):
        small.generate(as_inputs([list(range(3, 43))]), GREEDY, use_tqdm=False)


def test_bad_sampling_params_type(llm):
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        llm.generate(as_inputs([[5, 6]]), [{"max_tokens": 3}], use_tqdm=False)
    # A dict where vLLM takes a SamplingParams (iterating its keys named "str"), or pooling's params.
    from tokenmill import PoolingParams

    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams or a list of them .*got dict \{'max_tokens': 4\}"):
        llm.generate("the cat", {"max_tokens": 4}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams .*got PoolingParams"):
        llm.generate("the cat", PoolingParams(), use_tqdm=False)
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 0, r"prompts\[1\]: SamplingParams.n=0 is invalid"),  # hung the call before
        ("max_tokens", "5", r"prompts\[1\]: SamplingParams.max_tokens='5' is invalid"),
        ("repetition_penalty", 0.0, r"prompts\[1\]: SamplingParams.repetition_penalty=0.0 is invalid"),
        ("top_p", 2.0, r"prompts\[1\]: SamplingParams.top_p=2.0 is invalid"),
        ("stop_token_ids", "12", r"prompts\[1\]: SamplingParams.stop_token_ids='12' is invalid"),
    ],
)
def test_a_field_set_after_construction_is_checked(llm, field, value, message):
    """vLLM's examples set fields on get_default_sampling_params()'s object: a bad value is refused
    as the constructor refuses it, before any work, and a good one is used."""
    params = llm.get_default_sampling_params()
    setattr(params, field, value)
    steps_before = llm.llm_engine.stats.num_steps
    with pytest.raises(ValueError, match=message + r".*set after the SamplingParams was made"):
        llm.generate(as_inputs([[5, 6, 7], [8, 9]]), [GREEDY, params], use_tqdm=False)
    assert llm.llm_engine.stats.num_steps == steps_before
    assert_engine_idle(llm)


def test_a_good_field_set_after_construction_is_used(llm):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=2, ignore_eos=True)
    params.max_tokens = 5
    assert len(llm.generate(as_inputs([[5, 6, 7]]), params, use_tqdm=False)[0].outputs[0].token_ids) == 5
    params.n = 2
    assert len(llm.generate(as_inputs([[5, 6, 7]]), params, use_tqdm=False)[0].outputs) == 2


@pytest.mark.parametrize("prompts", [5, None, 2.5, b"bytes"])
def test_prompts_of_no_prompt_type_name_the_argument(llm, prompts):
    with pytest.raises(ValueError, match=r"prompts must be a prompt \(text, token ids or a prompt dict\) or a list of them, got"):
        llm.generate(prompts, GREEDY, use_tqdm=False)


def test_unknown_llm_keyword_is_an_error(tiny_llama_dir):
    with pytest.raises(TypeError, match=r"unknown keyword argument 'max_modle_len'; did you mean 'max_model_len'"):
        LLM(str(tiny_llama_dir), max_modle_len=64)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SamplingParams(max_token=8), r"SamplingParams got an unknown keyword argument 'max_token'; did you mean 'max_tokens'\?"),
        (lambda: SamplingParams(temprature=0.5, top_p=0.9), r"'temprature'; did you mean 'temperature'\? \(its arguments: \[.*'top_p'"),
        (lambda: PoolingParams(normalise=False), r"PoolingParams got an unknown keyword argument 'normalise'; did you mean 'normalize'\?"),
        (lambda: BeamSearchParams(beam_with=4), r"BeamSearchParams got an unknown keyword argument 'beam_with'; did you mean 'beam_width'\?"),
        (lambda: SamplingParams(xyzzy=1), r"unknown keyword argument 'xyzzy' \(its arguments: "),
    ],
)
def test_unknown_params_keyword_says_what_was_meant(make, message):
    """A misspelt keyword of a parameter object is still Python's TypeError (vLLM's msgspec raises one), naming
    the field it is close to and the ones it takes, as LLM(...) does."""
    with pytest.raises(TypeError, match=message):
        make()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "int3"}, r"LLM\(dtype='int3'\) is invalid"),
        ({"block_size": 12}, r"LLM\(block_size=12\) is invalid: must be a power of two"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5"),
        ({"load_format": "pt"}, r"load_format='pt'"),
        ({"max_model_len": 10**9}, r"max_model_len=1000000000 is larger than the model's max_position_embeddings"),
        # Values read from the environment or a YAML file arrive as strings: named, not compared.
        ({"max_model_len": "2048"}, r"LLM\(max_model_len='2048'\) is invalid: must be None or an integer >= 1"),
        ({"max_num_seqs": 2.5}, r"LLM\(max_num_seqs=2.5\) is invalid: must be None or an integer"),
        ({"gpu_memory_utilization": "0.9"}, r"LLM\(gpu_memory_utilization='0.9'\) is invalid: must be a number in \(0, 1\]"),
        # "false" is a true string: it must not turn trust_remote_code on.
        ({"trust_remote_code": "false"}, r"LLM\(trust_remote_code='false'\) is invalid: must be True or False"),
        ({"enable_prefix_caching": 1}, r"LLM\(enable_prefix_caching=1\) is invalid: must be True or False \(or None\)"),
        ({"device": None}, r"LLM\(device=None\) is invalid: must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ],
)
def test_invalid_engine_arguments(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama_dir, **kwargs)


def test_skip_tokenizer_init_accepts_token_ids_only(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, skip_tokenizer_init=True)
    out = llm.generate(as_inputs([[5, 6, 7]]), SamplingParams(temperature=0.0, max_tokens=3, detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.generate(["text"], GREEDY, use_tqdm=False)


def test_allowed_token_ids_given_as_a_tuple_run(llm):
    # A tuple passed SamplingParams' check, then indexed the bias row's dimensions mid-step (IndexError).
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, allowed_token_ids=(5, 6))
    assert params.allowed_token_ids == [5, 6]
    assert set(llm.generate(as_inputs([[5, 6, 7]]), params, use_tqdm=False)[0].outputs[0].token_ids) <= {5, 6}


@pytest.fixture(scope="module")
def padded_llm(tiny_models_root):
    """A model whose vocabulary (320 ids) is wider than its tokenizer's (289): an lm_head padded to a round size."""
    from transformers import LlamaConfig

    from support.tiny_models import save_tiny_model, tiny_config_kwargs

    config = LlamaConfig(**tiny_config_kwargs(vocab_size=320, tie_word_embeddings=False), architectures=["LlamaForCausalLM"])
    return make_llm(save_tiny_model(tiny_models_root, "llama_padded_vocab", config, seed=1), max_model_len=64)


def test_allowed_token_ids_stop_at_the_tokenizers_vocabulary(padded_llm):
    """As in vLLM: allowing only padding ids would generate nothing else, ids without text."""
    size = len(padded_llm.get_tokenizer())
    message = (rf"prompts\[1\]: SamplingParams.allowed_token_ids has token ids \[{size}\] outside the tokenizer's "
               rf"vocabulary \[0, {size}\) \(the model's ids {size}..319 are padding, without text\)")
    with pytest.raises(ValueError, match=message):
        padded_llm.generate(as_inputs([[5, 6], [7, 8]]), [GREEDY, SamplingParams(allowed_token_ids=[5, size])], use_tqdm=False)
    assert_engine_idle(padded_llm)
    # logit_bias may name any id of the model, as in vLLM.
    biased = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={size: 100.0})
    assert padded_llm.generate(as_inputs([[5, 6]]), biased, use_tqdm=False)[0].outputs[0].token_ids == [size, size]


def test_bad_generation_config_values_name_their_file(tiny_llama_dir, tmp_path):
    """The defaults a generation_config.json gives are checked as SamplingParams, and a bad one names
    the file it came from (a call without SamplingParams has nothing else to blame)."""
    import json

    from tokenmill.generation_defaults import default_sampling_params

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5, "do_sample": True}))
    folder_llm = make_llm(tiny_llama_dir, max_model_len=64, generation_config=str(tmp_path))
    path = str(tmp_path / "generation_config.json")
    with pytest.raises(ValueError, match=rf"default sampling settings from {path} are invalid: SamplingParams.top_p=1.5"):
        folder_llm.generate(as_inputs([[5, 6]]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"from the model's generation_config.json with override_generation_config are "
                                         r"invalid: SamplingParams.max_tokens='8' is invalid"):
        default_sampling_params("auto", {"temperature": 0.5}, {"max_new_tokens": "8"})
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"generation_config=.*holds a JSON list, not an object"):
        default_sampling_params(str(tmp_path), {}, None)
    # Good values are used, override over file.
    params = default_sampling_params("auto", {"temperature": 0.5, "top_k": 20, "max_new_tokens": 9}, {"top_k": 5})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 5, 9)
