"""Prompts tokenized together: `generate`'s text prompts in one tokenizer call and `chat`'s
conversations rendered and tokenized in one `apply_chat_template` call give, prompt for prompt,
the ids transformers gives each one alone; a bad conversation among many is still named."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

TEXTS = ["Write one sentence about rivers.", "  two  spaces and a tab\there", "café, naïve, 東京 and 🙂",
         "<|im_start|>user\nspecial tokens typed as text<|im_end|>", "x"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256, seed=0)


@pytest.fixture
def tokenizer_calls(llm, monkeypatch):
    """How many times the tokenizer was called (its ``__call__``), each with how many texts."""
    tokenizer = llm.get_tokenizer()
    calls: list[int] = []
    original = type(tokenizer).__call__

    def counting(self, text=None, *args, **kwargs):
        calls.append(len(text) if isinstance(text, list) else 1)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    return calls


def test_generate_tokenizes_text_prompts_in_one_call(llm, tokenizer_calls):
    tokenizer = llm.get_tokenizer()
    expected = [tokenizer.encode(text) for text in TEXTS]  # transformers, one text at a time
    tokenizer_calls.clear()
    prompts = [TEXTS[0], {"prompt": TEXTS[1]}, TEXTS[2], {"prompt": TEXTS[3], "cache_salt": "s"}, TEXTS[4],
               {"prompt_token_ids": [1, 2, 3]}]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert tokenizer_calls == [len(TEXTS)]
    assert [o.prompt_token_ids for o in outputs] == expected + [[1, 2, 3]]
    assert [o.prompt for o in outputs] == TEXTS + [None]


def test_tokenization_kwargs_apply_to_every_prompt_of_the_batch(llm):
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(TEXTS, PARAMS, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 4})
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(t, truncation=True, max_length=4) for t in TEXTS]


def test_chat_renders_and_tokenizes_conversations_together(llm, tokenizer_calls):
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": text}] for text in TEXTS]
    conversations[1] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    expected = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                for c in conversations]
    tokenizer_calls.clear()
    outputs = llm.chat(conversations, PARAMS, use_tqdm=False)
    assert tokenizer_calls == [len(conversations)]
    assert [o.prompt_token_ids for o in outputs] == expected


def test_a_bad_conversation_among_many_is_named(llm):
    conversations = [[{"role": "user", "content": text}] for text in TEXTS]
    conversations[3] = [{"content": "no role"}]
    with pytest.raises(ValueError, match=r"messages\[3\]\[0\] must be a dict with a string 'role'"):
        llm.chat(conversations, PARAMS, use_tqdm=False)
    template = "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}" \
               "{{ m.content }}{% endfor %}"
    conversations[3] = [{"role": "user", "content": "boom"}]
    with pytest.raises(ValueError, match=r"messages\[3\]: the chat template refused it: TemplateError: no boom"):
        llm.chat(conversations, PARAMS, use_tqdm=False, chat_template=template)
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompts_tokenized_in_chunks_across_their_edges(llm, tokenizer_calls, monkeypatch):
    """A call of millions of prompts must not hold every prompt's encoding at once: at most
    TOKENIZE_CHUNK texts (or conversations) a tokenizer call, the same ids across the chunks' edges."""
    from tokenmill import inputs

    monkeypatch.setattr(inputs, "TOKENIZE_CHUNK", 2)
    tokenizer = llm.get_tokenizer()
    expected = [tokenizer.encode(text) for text in TEXTS]
    conversations = [[{"role": "user", "content": text}] for text in TEXTS]
    alone = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
             for c in conversations]
    tokenizer_calls.clear()
    assert [o.prompt_token_ids for o in llm.generate(TEXTS, PARAMS, use_tqdm=False)] == expected
    assert tokenizer_calls == [2, 2, 1]
    tokenizer_calls.clear()
    assert [o.prompt_token_ids for o in llm.chat(conversations, PARAMS, use_tqdm=False)] == alone
    assert tokenizer_calls == [2, 2, 1]


@pytest.fixture(scope="module")
def bos_llm(tmp_path_factory):
    """A tiny Llama whose tokenizer adds BOS (the SentencePiece layout of tests/support/spm_tokenizers.py)."""
    from transformers import LlamaConfig

    from support.spm_tokenizers import build_spm_tokenizer
    from support.tiny_models import save_tiny_model, tiny_config_kwargs

    config = LlamaConfig(**tiny_config_kwargs(vocab_size=400), architectures=["LlamaForCausalLM"])
    folder = save_tiny_model(tmp_path_factory.mktemp("bos"), "llama", config, seed=1)
    build_spm_tokenizer().save_pretrained(folder)
    return LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, seed=0)


def test_truncated_text_prompt_keeps_bos_as_vllm(bos_llm):
    """vLLM cuts a text prompt in the tokenizer (truncation=True, max_length=k, its generate
    tokenizer's truncation_side "left"): BOS and the last k-1 tokens; token ids are sliced."""
    text = "one two three four"
    ids = bos_llm.get_tokenizer()(text)["input_ids"]
    assert ids[0] == 1 and len(ids) > 4
    cut = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=3)
    texts = bos_llm.generate([text, {"prompt": text}], cut, use_tqdm=False)
    assert [o.prompt_token_ids for o in texts] == [[1, *ids[-2:]]] * 2
    assert texts[0].prompt == text
    given = bos_llm.generate([ids, {"prompt": text, "prompt_token_ids": ids}], cut, use_tqdm=False)
    assert [o.prompt_token_ids for o in given] == [ids[-3:]] * 2
    # The tokenizer's own truncation, asked through tokenization_kwargs, cuts on the left as in vLLM.
    (out,) = bos_llm.generate(text, PARAMS, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 3})
    assert out.prompt_token_ids == [1, *ids[-2:]]
    assert bos_llm.get_tokenizer().truncation_side == "left"
