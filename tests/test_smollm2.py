"""The built-in default model, SmolLM2-135M-Instruct (real weights from its GGUF): greedy tokens
and logprobs against transformers' own GGUF loading, text, stop strings and chat."""

from __future__ import annotations

import pytest

from reference import hf_greedy
from tokenmill import LLM, SamplingParams

QUESTIONS = ["Write one sentence about rivers.", "What is the capital of France?", "Name three colors."]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=512, seed=0)


def chat_ids(llm, question: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.slow  # transformers' GGUF loading (~20 CPU-s a session, shared with test_loader), greedy by full forwards
def test_greedy_matches_transformers_gguf_loading(llm, smollm2_hf_gguf):
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(smollm2_hf_gguf, prompt, 12)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4


# Text -> the tokens llama.cpp cuts it into with this file (tokenizer.ggml.pre "smollm": every digit
# split apart first, then GPT-2's split; llama-vocab.cpp), which are also those of SmolLM2's own
# tokenizer.json (Digits(individual_digits=True) before ByteLevel). GPT-2's split alone cuts the
# spaces or newlines before a digit apart ("Ġ", "Ġ", "4" for "  4").
DIGIT_TEXTS = {
    "  42  ": ["ĠĠ", "4", "2", "ĠĠ"],
    "\n\n7. Done": ["ĊĊ", "7", ".", "ĠDone"],
    "x  = 10": ["x", "Ġ", "Ġ=", "Ġ", "1", "0"],
    "year 2024": ["year", "Ġ", "2", "0", "2", "4"],
}


def test_digits_are_tokenized_as_llama_cpp_does(llm):
    """The converted built-in and the GGUF read directly (load_format="gguf") alike."""
    from tokenmill.models import builtin
    from tokenmill.models.gguf_tokenizer import load_gguf_tokenizer

    direct = load_gguf_tokenizer(builtin.locate_gguf(builtin.find_builtin("smollm2-135m-instruct"), builtin.cache_dir()))
    for tokenizer in (llm.get_tokenizer(), direct):
        got = {text: tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
               for text in DIGIT_TEXTS}
        assert got == DIGIT_TEXTS
        assert all(tokenizer.decode(tokenizer(text)["input_ids"]) == text for text in DIGIT_TEXTS)


def test_chat_text_is_the_decoded_tokens_and_stops_at_end_of_turn(llm):
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], SamplingParams(temperature=0.0, max_tokens=60),
                       use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text.strip()
    assert "Paris" in outputs[1].outputs[0].text
    # An instruct model ends its turn: at least one answer stops on the end-of-turn token.
    stopped = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] in llm.llm_engine.config.eos_token_ids for c in stopped)
    assert all(c.stop_reason is None for c in stopped)


def test_stop_strings_cut_the_text(llm):
    free = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    assert len(words) > 4
    stop = " " + words[3]
    at = free.text.find(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop, "never-appears"],
                                include_stop_str_in_output=include)
        out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (free.text[: at + len(stop)] if include else free.text[:at])
        assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_default_sampling_params_come_from_generation_config(llm):
    found = llm.llm_engine.source.generation_config
    params = llm.get_default_sampling_params()
    for key, field in (("temperature", "temperature"), ("top_p", "top_p")):
        if key in found:
            assert getattr(params, field) == pytest.approx(found[key])
    assert isinstance(params, SamplingParams)



def test_generation_config_folder_overrides_defaults(llm, tmp_path):
    import json

    from tokenmill import LLM

    # do_sample false is transformers' switch, which vLLM does not read: the temperature still holds.
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.25, "top_p": 0.5,
                                                                 "max_new_tokens": 7}))
    other = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=128, generation_config=str(tmp_path))
    params = other.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.25, 0.5, 7)
    plain = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=128, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
