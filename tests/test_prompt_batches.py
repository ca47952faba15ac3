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
def bos_llm(tiny_llama_bos_dir):
    """A tiny Llama whose tokenizer adds BOS."""
    return LLM(str(tiny_llama_bos_dir), device="cpu", dtype="float32", max_model_len=64, seed=0)


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


def _run_rows(llm, rows, tmp_path, **config):
    """A `tokenmill run` job over ``rows`` (greedy, 3 tokens); its records by row index."""
    from tokenmill.batch.job import JobConfig, run_job

    from support.jsonl import read_jsonl, write_jsonl

    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    sampling = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
    summary = run_job(JobConfig(input=str(source), output=str(output), model="m", sampling=sampling, progress=False,
                                overwrite=True, **config), llm=llm)
    return summary, {r["row"]: r for r in read_jsonl(output)}


def test_an_empty_text_row_runs_as_its_bos_as_generate_does(bos_llm, tmp_path):
    """A "" row of a generation job is the tokenizer's BOS alone, as transformers tokenizes "" and as
    vLLM's generate("") runs it (the job refused such rows: "the prompt is empty"); it continues that
    BOS as the HF model does greedily, with the same cumulative logprob."""
    import torch
    from transformers import AutoModelForCausalLM

    bos = bos_llm.get_tokenizer()("")["input_ids"]
    assert bos == [1]
    rows = [{"prompt": "", "sampling_params": {"logprobs": 0}}, {"prompt": "one two"}]
    summary, records = _run_rows(bos_llm, rows, tmp_path)
    assert summary.failed == 0 and records[0]["prompt_tokens"] == 1 and records[0]["completion_tokens"] == 3
    model = AutoModelForCausalLM.from_pretrained(bos_llm.llm_engine.config.model, dtype=torch.float32).eval()
    ids, cumulative = list(bos), 0.0
    with torch.no_grad():
        for _ in range(3):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            ids.append(int(logprobs.argmax()))
            cumulative += logprobs[ids[-1]].item()
    assert records[0]["cumulative_logprob"] == pytest.approx(cumulative, abs=1e-4)
    (generated,) = bos_llm.generate("", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert generated.outputs[0].token_ids == ids[1:]


def test_an_empty_text_row_without_bos_fails_alone_and_a_chat_one_runs(llm, tmp_path):
    """SmolLM2 adds no BOS: "" has no token, and its row fails alone with the engine's reason (vLLM
    refuses an empty prompt); as a chat turn it renders to the template's tokens and runs."""
    assert llm.get_tokenizer()("")["input_ids"] == []
    summary, records = _run_rows(llm, [{"prompt": ""}, {"prompt": "x"}], tmp_path)
    assert summary.failed == 1 and records[1]["error"] is None
    assert "is empty: a prompt needs at least one token" in records[0]["error"]
    from tokenmill.batch.requests import PromptSettings

    summary, records = _run_rows(llm, [{"prompt": ""}], tmp_path, prompt=PromptSettings(chat=True))
    turn = [{"role": "user", "content": ""}]
    rendered = llm.get_tokenizer().apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert summary.failed == 0 and records[0]["prompt_tokens"] == len(rendered)


def test_an_openai_completion_line_with_an_empty_prompt_runs_as_vllms_server_runs_it(bos_llm, llm, tmp_path):
    """vLLM's server (and OpenAI's API) take ``"prompt": ""`` on /v1/completions and tokenize it as
    any text: a BOS-adding tokenizer makes one token of it and the line runs; with no token the
    engine refuses it by name (a 400), the other lines unharmed. An empty list is no prompt."""
    from support.jsonl import read_jsonl, write_jsonl
    from tokenmill.batch.job import JobConfig, run_job

    def lines_of(model, prompts):
        source = write_jsonl(tmp_path / "in.jsonl", [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": prompt, "max_tokens": 2, "temperature": 0}} for i, prompt in enumerate(prompts)])
        output = tmp_path / "out.jsonl"
        run_job(JobConfig(input=str(source), output=str(output), model="m", sampling={}, progress=False,
                          overwrite=True), llm=model)
        return [line["response"] for line in sorted(read_jsonl(output), key=lambda line: line["custom_id"])]

    bos = bos_llm.get_tokenizer()("")["input_ids"]
    ran, batch_of_one = lines_of(bos_llm, ["", [""]])
    for response in (ran, batch_of_one):
        assert response["status_code"] == 200 and response["body"]["usage"]["prompt_tokens"] == len(bos) == 1
    refused, other, no_prompt = lines_of(llm, ["", "x", []])
    assert refused["status_code"] == 400 and other["status_code"] == 200
    assert "is empty: a prompt needs at least one token" in refused["body"]["error"]["message"]
    assert no_prompt["status_code"] == 400 and "body.prompt" in no_prompt["body"]["error"]["message"]
