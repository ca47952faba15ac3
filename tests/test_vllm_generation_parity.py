"""vLLM 0.26's assertions on generation (tests/samplers/, tests/v1/sample/, tests/detokenizer/,
tests/entrypoints/llm/, tests/test_sampling_params.py of vLLM) that make sense on a tiny model on a
CPU, run against tokenmill. References are Hugging Face transformers (fp32) and the model's own
tokenizer; the vLLM rules a test pins (which text a stop token leaves, when min_tokens lets a stop
string count, ...) are quoted from vLLM 0.26's source where no reference computes them."""

from __future__ import annotations

import pytest
import torch

from reference import hf_greedy, hf_model, hf_next_logprobs
from tokenmill import LLM, SamplingParams

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=48, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=8, seed=0)
PROMPTS = ["Hello, my name is", "The capital of France is", "the cat sat on the mat"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
EOS = 2  # the tiny tokenizer's <|im_end|> (tests/support/tiny_models.py)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **OPTIONS)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return hf_model(str(tiny_llama_dir))


def generate_one(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0]


# --- tests/samplers/test_logprobs.py, test_ranks.py; tests/v1/sample/test_logprobs_e2e.py ---------

def test_logprobs_and_ranks_match_hugging_face(llm, reference):
    """Greedy: `logprobs` top entries per position (the sampled one among them, rank 1), values and
    ranks of Hugging Face's log-softmax, cumulative_logprob their sum; prompt_logprobs: None first,
    then the prompt token plus the top ones. (test_logprobs' "decoded top tokens spell the text":
    test_decoded_tokens_complete_split_characters, on text whose bytes we choose.)"""
    k = 3
    for prompt in PROMPTS:
        out = generate_one(llm, prompt, GREEDY.clone(logprobs=k, prompt_logprobs=k))
        completion, ids = out.outputs[0], out.prompt_token_ids
        assert len(completion.logprobs) == len(completion.token_ids) == GREEDY.max_tokens
        context = list(ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            expected = hf_next_logprobs(reference, context)
            assert len(entry) == k and entry[token].rank == 1
            top = torch.topk(expected, k)
            assert list(entry) == top.indices.tolist()  # best first, as vLLM's dict is ordered
            for tid, lp in entry.items():
                assert abs(lp.logprob - float(expected[tid])) < 1e-4
            context.append(token)
        assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))) < 1e-6
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            entry, expected = out.prompt_logprobs[position], hf_next_logprobs(reference, ids[:position])
            assert ids[position] in entry and len(entry) in (k, k + 1)
            assert entry[ids[position]].rank == int((expected > expected[ids[position]]).sum()) + 1


def test_sampled_ranks_are_ranks_in_the_distribution(llm, reference):
    """test_ranks: a sampled token's rank is >= 1 and counts the tokens more likely than it."""
    out = generate_one(llm, PROMPTS[0], SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=0))
    context = list(out.prompt_token_ids)
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        expected = hf_next_logprobs(reference, context)
        assert list(entry) == [token]  # logprobs=0: the sampled token alone
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        context.append(token)


def test_max_logprobs_is_enforced(llm):
    """test_max_logprobs: more than LLM(max_logprobs=20) alternatives is a ValueError."""
    generate_one(llm, PROMPTS[0], GREEDY.clone(logprobs=20, max_tokens=1))
    with pytest.raises(ValueError, match="max_logprobs"):
        generate_one(llm, PROMPTS[0], GREEDY.clone(logprobs=21))
    with pytest.raises(ValueError, match="max_logprobs"):
        generate_one(llm, PROMPTS[0], GREEDY.clone(prompt_logprobs=21))


# --- tests/samplers/test_ignore_eos.py, tests/detokenizer/test_stop_reason.py ----------------------

def test_ignore_eos_runs_to_max_tokens_and_eos_stops_otherwise(llm, reference):
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={EOS: 100.0})
    out = generate_one(llm, PROMPTS[0], forced.clone(ignore_eos=True)).outputs[0]
    assert out.token_ids == [EOS] * 5 and out.finish_reason == "length" and out.stop_reason is None
    out = generate_one(llm, PROMPTS[0], forced).outputs[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop" and out.stop_reason is None


def test_eos_of_the_tokenizer_and_of_the_configs(tiny_llama_dir, tmp_path):
    """vLLM (SamplingParams.update_from_generation_config, its scheduler's check_stop): the tokenizer's
    eos ends a sequence with stop_reason None even where config.json names another, and
    generation_config.json's other eos ids end it with stop_reason the id."""
    import json
    import shutil

    folder = tmp_path / "llama"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))  # not the tokenizer's <|im_end|>
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    llm = LLM(str(folder), **OPTIONS)
    assert llm.get_tokenizer().eos_token_id == EOS
    for token, reason in ((EOS, None), (7, 7), (9, 9)):
        out = generate_one(llm, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[token])).outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", reason)


def test_stop_reason_of_stop_ids_strings_and_length(llm, reference):
    ids = llm.get_tokenizer()(PROMPTS[2])["input_ids"]
    greedy = hf_greedy(reference, ids, 8)[0]
    third = greedy[2]
    out = generate_one(llm, PROMPTS[2], GREEDY.clone(stop_token_ids=[third])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == third and out.token_ids == greedy[:3]
    out = generate_one(llm, PROMPTS[2], GREEDY).outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None and out.token_ids == greedy


# --- tests/detokenizer/test_stop_token_ids.py, test_stop_strings.py, test_min_tokens.py ---------------

def test_a_stop_tokens_text_is_left_out_unless_asked(llm, reference):
    """vLLM's detokenizer drops the text of the token that stopped the sequence (eos or a stop id)
    unless include_stop_str_in_output; its id stays in token_ids. Before, tokenmill kept the text
    (with skip_special_tokens=False even '<|im_end|>')."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(PROMPTS[2])["input_ids"]
    greedy = hf_greedy(reference, ids, 8)[0]
    stop_at = next(i for i, t in enumerate(greedy) if tokenizer.decode([t]).strip())  # a token with visible text
    params = GREEDY.clone(stop_token_ids=[greedy[stop_at]])
    out = generate_one(llm, PROMPTS[2], params).outputs[0]
    assert out.token_ids == greedy[: stop_at + 1]
    assert out.text == tokenizer.decode(greedy[:stop_at])
    kept = generate_one(llm, PROMPTS[2], params.clone(include_stop_str_in_output=True)).outputs[0]
    assert kept.text == tokenizer.decode(greedy[: stop_at + 1])
    eos = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={EOS: 100.0}, skip_special_tokens=False)
    out = generate_one(llm, PROMPTS[0], eos).outputs[0]
    assert out.token_ids == [EOS] and out.text == ""
    assert generate_one(llm, PROMPTS[0], eos.clone(include_stop_str_in_output=True)).outputs[0].text == "<|im_end|>"


def test_stop_strings_cut_the_text_and_count_after_min_tokens(llm, reference):
    """Stop strings: text cut before (or, included, after) the string, stop_reason the string,
    token_ids up to the token that completed it. With min_tokens=m, vLLM checks stop strings only
    once more than m tokens are out (`num_output_tokens() > min_tokens`): a string the m-th token
    completes does not stop the sequence (tokenmill stopped there before)."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(PROMPTS[2])["input_ids"]
    greedy = hf_greedy(reference, ids, 12)[0]
    pieces = [tokenizer.decode(greedy[:i]) for i in range(len(greedy) + 1)]
    # a stop string of one token's text: where it first ends, and whether it ends again later
    stop_at = next(i for i, t in enumerate(greedy) if tokenizer.decode([t]).strip())
    stop = tokenizer.decode([greedy[stop_at]])
    text = pieces[-1]
    first = text.find(stop)
    out = generate_one(llm, PROMPTS[2], GREEDY.clone(max_tokens=12, stop=[stop])).outputs[0]
    assert out.text == text[:first] and out.stop_reason == stop and out.finish_reason == "stop"
    ends = next(i for i in range(len(pieces)) if len(pieces[i]) >= first + len(stop))  # tokens out when it completes
    assert out.token_ids == greedy[:ends]
    included = generate_one(llm, PROMPTS[2], GREEDY.clone(max_tokens=12, stop=[stop], include_stop_str_in_output=True))
    assert included.outputs[0].text == text[: first + len(stop)]
    # min_tokens = the count at which it completes: that token may not stop; the next occurrence does
    held = generate_one(llm, PROMPTS[2], GREEDY.clone(max_tokens=12, stop=[stop], min_tokens=ends)).outputs[0]
    later = text.find(stop, len(pieces[ends]) - len(stop) + 1)
    if later == -1:
        assert held.finish_reason == "length" and held.text == text
    else:
        assert held.stop_reason == stop and held.text == text[:later] and len(held.token_ids) > ends
    assert len(held.token_ids) > ends


def test_detokenize_false_gives_token_ids_only(llm):
    """test_disable_detokenization: same tokens, empty text; vLLM also leaves decoded_token None."""
    params = GREEDY.clone(logprobs=1)
    with_text = generate_one(llm, PROMPTS[0], params).outputs[0]
    without = generate_one(llm, PROMPTS[0], params.clone(detokenize=False)).outputs[0]
    assert without.text == "" and with_text.text != "" and without.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for entry in without.logprobs for lp in entry.values())


def test_decoded_tokens_complete_split_characters(llm):
    """vLLM 0.26 reports a token holding part of a character ("é" is two byte tokens here) as ""
    and the token that completes it as the whole character (LogprobsProcessor._verify_tokens),
    so a position's decoded tokens, read in order, spell the text; tokenmill said "\ufffd" for both.
    Checked on prompt logprobs, whose tokens the test chooses, in both containers."""
    tokenizer = llm.get_tokenizer()
    text = "the café é"
    ids = tokenizer(text)["input_ids"]
    assert len(tokenizer.encode("é", add_special_tokens=False)) == 2  # the case under test
    for flat in (False, True):
        for k in (0, 2):
            out = generate_one(llm, text, SamplingParams(max_tokens=1, prompt_logprobs=k, flat_logprobs=flat))
            decoded = [out.prompt_logprobs[i][ids[i]].decoded_token for i in range(1, len(ids))]
            assert "".join(decoded) == tokenizer.decode(ids[1:])
            assert "\ufffd" not in "".join(decoded) and decoded[-2:] == ["", "é"]


def test_decoded_tokens_read_from_known_texts_equal_decoding_them(llm, tiny_llama_dir):
    """Positions whose tokens' texts the engine has met before are built from those texts (a
    scoring job's fast path); they equal what a fresh engine decodes, alternatives included."""
    text = "the café é and the café again, the end"
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=2, temperature=0.0)
    warm = [generate_one(llm, text, params) for _ in range(2)][-1]  # every whole token's text known
    fresh = generate_one(LLM(str(tiny_llama_dir), **OPTIONS), text, params)

    def texts(positions):
        return [[(t, lp.decoded_token) for t, lp in p.items()] if p else None for p in positions]

    assert texts(warm.prompt_logprobs) == texts(fresh.prompt_logprobs)
    assert texts(warm.outputs[0].logprobs) == texts(fresh.outputs[0].logprobs)
    tokenizer = llm.get_tokenizer()
    for positions in (warm.prompt_logprobs[1:], warm.outputs[0].logprobs):  # a whole token's text is its own decoding
        for token_id, lp in (entry for p in positions for entry in p.items()):
            alone = tokenizer.decode([token_id])
            assert lp.decoded_token == alone or alone.endswith("\ufffd")


# --- tests/test_sampling_params.py, tests/v1/sample/test_sampling_params_e2e.py; vLLM 0.26's SamplingParams ---

def test_sampling_params_spellings_and_checks_of_vllm():
    """vLLM 0.26's __post_init__ / _verify_args: logprobs=True is 1, seed=-1 is no seed, a positive
    temperature below 0.01 is raised to 0.01 (so it samples), temperature above 2, n > 1 with greedy
    sampling and stop strings without detokenization are refused (tokenmill accepted all three,
    and ignored the stop strings)."""
    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(seed=-1).seed is None
    low = SamplingParams(temperature=1e-3)
    assert low.temperature == 0.01 and low.sampling_type.name == "RANDOM"
    assert SamplingParams(temperature=2.0).temperature == 2.0
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=2.5 is invalid: must be in \[0, 2\]"):
        SamplingParams(temperature=2.5)
    with pytest.raises(ValueError, match="SamplingParams.n=2 is invalid: must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0.0)
    assert SamplingParams(n=2, temperature=1e-3).n == 2  # raised to 0.01: not greedy
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\['a'\] is invalid: must be empty when detokenize=False"):
        SamplingParams(stop="a", detokenize=False)
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    with pytest.raises(ValueError, match="logprobs=-2 is invalid"):
        SamplingParams(logprobs=-2)


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_llama_dir, llm, reference):
    """vLLM: logprobs=-1 / prompt_logprobs=-1 return every token's logprob, allowed when
    LLM(max_logprobs=-1) (or a limit >= the vocabulary); under the default 20 it is refused."""
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, 289\) is invalid: must be <= max_logprobs \(20\)"):
        generate_one(llm, PROMPTS[0], GREEDY.clone(logprobs=-1))
    whole = LLM(str(tiny_llama_dir), **{**OPTIONS, "max_logprobs": -1})
    out = generate_one(whole, PROMPTS[0], GREEDY.clone(max_tokens=2, logprobs=-1, prompt_logprobs=-1))
    vocab = reference.config.vocab_size
    expected = hf_next_logprobs(reference, out.prompt_token_ids)
    first = out.outputs[0].logprobs[0]
    assert len(first) == vocab and all(abs(first[t].logprob - float(expected[t])) < 1e-4 for t in range(vocab))
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])


def test_truncate_prompt_tokens_in_tokenization_kwargs_is_refused_not_ignored(llm):
    """vLLM 0.26 truncates generation prompts with tokenization_kwargs={"truncate_prompt_tokens": k}
    (its renderer's key, keeping the tokenizer's side); the tokenizer tokenmill handed it to ignored
    it, so the whole prompt ran. Now it is refused, naming what does truncate."""
    with pytest.raises(ValueError, match=r"tokenization_kwargs\['truncate_prompt_tokens'\]=3 is not supported for generation"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(PROMPTS[2])["input_ids"]
    assert generate_one(llm, PROMPTS[2], GREEDY.clone(truncate_prompt_tokens=3)).prompt_token_ids == ids[-3:]


@pytest.mark.parametrize("kwargs", [{"is_split_into_words": True}, {"add_special_token": False}, {"do_lower_case": True}])
def test_unknown_tokenization_kwargs_are_refused_by_name(llm, kwargs):
    """vLLM's renderer reads add_special_tokens, truncation, max_length and padding (and its own
    truncate_prompt_tokens / truncation_side) and drops any other key with a warning; tokenmill handed
    them to the tokenizer, where is_split_into_words changes the tokens and a misspelt key does nothing.
    Refused instead, naming the key and the keys there are; nothing is left queued."""
    (key, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"tokenization_kwargs\['{key}'\]={value} is not supported: the keys are "
                                         r"add_special_tokens, truncation, max_length, padding \("):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, tokenization_kwargs=kwargs)
    with pytest.raises(ValueError, match=rf"tokenization_kwargs\['{key}'\]"):
        llm.llm_engine.add_request("unknown-key", PROMPTS[0], GREEDY, tokenization_kwargs=kwargs)
    assert not llm.llm_engine.has_unfinished_requests()
    ids = llm.get_tokenizer()(PROMPTS[0], add_special_tokens=False)["input_ids"]
    (out,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    assert out.prompt_token_ids == ids


def test_truncate_prompt_tokens_past_max_model_len_is_refused(llm):
    """As vLLM 0.26 refuses it (a cut that cannot make a prompt fit), whatever the prompt's length: a
    short prompt ran, a long one was refused as too long, naming max_model_len but not the cut."""
    most = llm.llm_engine.config.max_model_len
    for prompt in (PROMPTS[0], "word " * (most + 10)):
        with pytest.raises(ValueError, match=rf"prompts\[0\]: SamplingParams.truncate_prompt_tokens={most + 1} is "
                                             rf"invalid: must be -1 or at most max_model_len \({most}\)"):
            llm.generate(prompt, GREEDY.clone(truncate_prompt_tokens=most + 1), use_tqdm=False)
    assert len(generate_one(llm, "word " * (most + 10), GREEDY.clone(truncate_prompt_tokens=most)).prompt_token_ids) == most
