"""A batch row's own chat-template arguments and an OpenAI line's structured-output and sampling
fields, as vLLM's ChatCompletionRequest takes them: the prompt a row gets is transformers'
``apply_chat_template`` of the conversation as vLLM prepares it (tests/test_chat_reference.py's
reference), alone and rendered together with other rows; bad values are that row's error, naming
the field."""

from __future__ import annotations

import json

import pytest

from support.jsonl import read_jsonl, write_jsonl
from support.tiny_models import build_tiny_tokenizer
from test_batch_e2e import engine_left_clean, job, llm  # noqa: F401,F811 (fixtures)
from test_chat_reference import DOCUMENTS, LLAMA3, QWEN3, TOOL_TURN, TOOLS, reference
from tokenmill import SamplingParams
from tokenmill.batch.openai_batch import build_openai_request
from tokenmill.batch.readers import RawRow
from tokenmill.batch.requests import PromptSettings, RowError, build_row_request, shared_sampling_params
from tokenmill.batch.row_prompts import batch_prompts, row_prompt

USER = [{"role": "user", "content": "2+2?"}]
EFFORT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
          "{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
          "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


def chat_line(index=0, **body):
    record = {"custom_id": f"req-{index}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": USER, "max_tokens": 5, **body}}
    return RawRow(index, record, None, f"line {index + 1}")


def ids_of(tokenizer, request, job_template=None):
    return row_prompt(tokenizer, request, job_template)["prompt_token_ids"]


# Each body's fields, and the keywords transformers' apply_chat_template gets for the same rendering.
CASES = [
    ({"chat_template": QWEN3, "chat_template_kwargs": {"enable_thinking": False}},
     dict(template=QWEN3, enable_thinking=False)),
    ({"chat_template": QWEN3, "tools": TOOLS, "tool_choice": "auto"}, dict(template=QWEN3, tools=TOOLS)),
    ({"chat_template": LLAMA3, "tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": {"date_string": "1 Jan 2026"}},
     dict(template=LLAMA3, tools=TOOLS, date_string="1 Jan 2026")),
    ({"chat_template": DOCUMENTS, "documents": [{"title": "Rivers", "text": "The Rhine flows north."}]},
     dict(template=DOCUMENTS, documents=[{"title": "Rivers", "text": "The Rhine flows north."}])),
    # The field over a documents variable, as vLLM merges them.
    ({"chat_template": DOCUMENTS, "documents": [{"title": "A", "text": "a"}], "chat_template_kwargs": {"documents": []}},
     dict(template=DOCUMENTS, documents=[{"title": "A", "text": "a"}])),
    ({"chat_template": QWEN3, "add_generation_prompt": False}, dict(template=QWEN3, add_generation_prompt=False)),
    # reasoning_effort is a variable and turns enable_thinking on (off for "none") unless the variables set it.
    ({"chat_template": EFFORT, "reasoning_effort": "low"}, dict(template=EFFORT, reasoning_effort="low", enable_thinking=True)),
    ({"chat_template": EFFORT, "reasoning_effort": "none"}, dict(template=EFFORT, reasoning_effort="none", enable_thinking=False)),
    ({"chat_template": EFFORT, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "x"}},
     dict(template=EFFORT, reasoning_effort="high", enable_thinking=False)),
    ({"add_generation_prompt": False, "continue_final_message": True,
      "messages": [*USER, {"role": "assistant", "content": "The answer is"}]},
     dict(template=None, add_generation_prompt=False, continue_final_message=True)),
]


@pytest.mark.parametrize("fields, expected", CASES)
def test_openai_chat_fields_render_as_transformers(tiny, fields, expected):
    request = build_openai_request(chat_line(**fields))
    expected = dict(expected)
    template = expected.pop("template") or tiny.chat_template
    ids, text = reference(tiny, fields.get("messages", USER), template, **expected)
    assert ids_of(tiny, request) == ids
    if "continue_final_message" in fields:
        assert text.endswith("The answer is")


def test_a_lines_tools_reach_the_template_as_vllms_server_dumps_them(tiny):
    """vLLM's server validates a line's tools into its request model and hands the template their
    dump: type first, a function's description and parameters null when not given, other keys
    dropped (a tool template prints each tool with tojson, which keeps keys in order)."""
    given = [{"function": {"name": "now", "extra": 1}, "type": "function"},
             {"type": "function", "function": {"parameters": {"type": "object"}, "name": "add", "strict": True}}]
    dumped = [{"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
              {"type": "function", "function": {"name": "add", "description": None, "parameters": {"type": "object"},
                                                "strict": True}}]
    request = build_openai_request(chat_line(chat_template=QWEN3, tools=given))
    ids, text = reference(tiny, USER, QWEN3, tools=dumped)
    assert ids_of(tiny, request) == ids and '{"type": "function", "function": {"name": "now", "description": null' in text


def test_a_lines_template_goes_over_the_jobs(tiny):
    request = build_openai_request(chat_line(chat_template=QWEN3))
    assert ids_of(tiny, request, job_template=LLAMA3) == reference(tiny, USER, QWEN3)[0]
    plain = build_openai_request(chat_line())
    assert ids_of(tiny, plain, job_template=LLAMA3) == reference(tiny, USER, LLAMA3)[0]


def test_rows_with_different_options_rendered_together_get_their_own_prompts(tiny):
    """batch_prompts renders rows with the same options in one call: each row still gets what it
    gets alone (and transformers' ids), whatever the others ask."""
    lines = [chat_line(0), chat_line(1, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": False}),
             chat_line(2, chat_template=QWEN3, tools=TOOLS), chat_line(3),
             chat_line(4, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": False},
                       messages=TOOL_TURN[:2]),
             chat_line(5, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": True})]
    requests = {raw.index: build_openai_request(raw) for raw in lines}
    together = batch_prompts(tiny, requests, None)
    assert sorted(together) == list(range(6))
    expected = [reference(tiny, USER, tiny.chat_template)[0], reference(tiny, USER, QWEN3, enable_thinking=False)[0],
                reference(tiny, USER, QWEN3, tools=TOOLS)[0], reference(tiny, USER, tiny.chat_template)[0],
                reference(tiny, TOOL_TURN[:2], QWEN3, enable_thinking=False)[0],
                reference(tiny, USER, QWEN3, enable_thinking=True)[0]]
    for i, request in requests.items():
        assert together[i]["prompt_token_ids"] == ids_of(tiny, request) == expected[i]
    assert expected[1] != expected[5]  # the variable took effect


def test_generic_rows_with_messages_take_tools_documents_and_template_variables(tiny):
    settings = PromptSettings()
    record = {"messages": USER, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    request = build_row_request(RawRow(0, record, None, "line 1"), settings)
    assert ids_of(tiny, request, QWEN3) == reference(tiny, USER, QWEN3, tools=TOOLS, enable_thinking=False)[0]
    # CSV cells hold JSON text; a Parquet struct's null variable is not set.
    csv_record = {"messages": json.dumps(USER), "tools": json.dumps(TOOLS), "documents": "",
                  "chat_template_kwargs": json.dumps({"enable_thinking": False, "date_string": None})}
    request = build_row_request(RawRow(0, csv_record, None, "line 1"), settings)
    assert request.chat.chat_template_kwargs == {"enable_thinking": False}
    assert ids_of(tiny, request, QWEN3) == reference(tiny, USER, QWEN3, tools=TOOLS, enable_thinking=False)[0]
    docs = [{"title": "Rivers", "text": "The Rhine flows north."}]
    request = build_row_request(RawRow(0, {"messages": USER, "documents": docs}, None, "line 1"), settings)
    assert ids_of(tiny, request, DOCUMENTS) == reference(tiny, USER, DOCUMENTS, documents=docs)[0]
    # Text rows (a --prompt-template may read a column named tools) are left alone.
    request = build_row_request(RawRow(0, {"prompt": "hi", "tools": "hammer, saw"}, None, "line 1"), PromptSettings(chat=True))
    assert request.chat is None
    with pytest.raises(RowError, match=r"line 1: 'tools'='hammer' is invalid: must be a non-empty list of tools"):
        build_row_request(RawRow(0, {"messages": USER, "tools": json.dumps("hammer")}, None, "line 1"), settings)
    with pytest.raises(RowError, match=r"line 1: 'chat_template_kwargs' is not JSON"):
        build_row_request(RawRow(0, {"messages": USER, "chat_template_kwargs": "{enable"}, None, "line 1"), settings)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tools": {"name": "f"}}, r"line 1: body\.tools=\{'name': 'f'\} is invalid: must be a non-empty list of tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
         r"body\.tools\[0\]=.* is invalid: a tool is \{\"type\": \"function\""),
        ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, r"body\.tools\[0\]\.type='code_interpreter'"),
        ({"tools": [{"function": {"name": "f", "parameters": "x"}}]}, r"body\.tools\[0\]\.function\.parameters='x' is invalid"),
        ({"tools": [{"function": {"name": "f", "description": 5}}]}, r"body\.tools\[0\]\.function\.description=5 is invalid"),
        ({"tools": TOOLS, "tool_choice": "required"}, r"body\.tool_choice='required' is not supported: .*'none', 'auto'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         r"body\.tool_choice=\{.*\} is not supported"),
        ({"tool_choice": "auto"}, r"body\.tool_choice='auto' needs tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, r"body\.tool_choice='always' is invalid: must be 'none', 'auto'"),
        ({"documents": ["text"]}, r"body\.documents=\['text'\] is invalid: must be a list of objects of strings"),
        ({"documents": [{"title": "t", "page": 3}]}, r"body\.documents=.* is invalid"),
        ({"chat_template_kwargs": ["enable_thinking"]}, r"body\.chat_template_kwargs=\['enable_thinking'\] is invalid: must be an object"),
        ({"chat_template": 3}, r"body\.chat_template=3 is invalid: must be a Jinja chat template"),
        ({"reasoning_effort": "extreme"}, r"body\.reasoning_effort='extreme' is invalid: must be one of 'none', 'minimal'"),
        ({"add_generation_prompt": "yes"}, r"body\.add_generation_prompt='yes' is invalid: must be true or false"),
        ({"continue_final_message": True}, r"body\.add_generation_prompt and body\.continue_final_message cannot both be true"),
        ({"response_format": {"type": "xml"}}, r"body\.response_format=\{'type': 'xml'\} is invalid: must be an object whose type is"),
        ({"response_format": "json"}, r"body\.response_format='json' is invalid"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         r"body\.response_format\.json_schema=\{'name': 'x'\} is invalid: must be \{\"name\""),
        ({"use_beam_search": True}, r"body\.use_beam_search=True is not supported by tokenmill: only vLLM's default false"),
        ({"echo": 1}, r"body\.echo=1 is not supported"),
        ({"add_special_tokens": True}, r"body\.add_special_tokens=True is not supported.*default false"),
        ({"logprob_token_ids": [3]}, r"\['logprob_token_ids'\] are not supported"),
    ],
)
def test_bad_chat_fields_are_the_lines_error_naming_the_field(body, message):
    with pytest.raises(RowError, match=message) as info:
        build_openai_request(chat_line(**body))
    assert info.value.row_id == "req-0"


def test_a_chat_template_variable_the_engine_owns_is_the_rows_error(tiny):
    request = build_openai_request(chat_line(chat_template_kwargs={"tokenize": False}))
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        row_prompt(tiny, request, None)
    assert batch_prompts(tiny, {0: request, 1: build_openai_request(chat_line(1))}, None).keys() == {1}


def test_vllms_defaults_in_a_dumped_body_are_accepted():
    """A body dumped from vLLM's request object carries its defaults, which change nothing here."""
    defaults = {"use_beam_search": False, "echo": False, "priority": 0, "include_reasoning": True,
                "add_special_tokens": False, "length_penalty": 1.0, "request_id": "abc", "tool_choice": "none",
                "add_generation_prompt": True, "continue_final_message": False, "spaces_between_special_tokens": True}
    request = build_openai_request(chat_line(**defaults))
    assert request.overrides == {"max_tokens": 5, "spaces_between_special_tokens": True}
    completion = RawRow(0, {"custom_id": "c", "url": "/v1/completions",
                            "body": {"prompt": "x", "add_special_tokens": True, "echo": False}}, None, "line 1")
    assert build_openai_request(completion).prompt == "x"


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["a", "b"]}, "strict": True}}},
         ("json", json.dumps({"enum": ["a", "b"]}))),
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
        ({"structured_outputs": {"disable_any_whitespace": True}, "response_format": {"type": "json_object"}},
         ("json_object", "")),
    ],
)
def test_response_format_becomes_the_structured_output_vllm_makes_of_it(body, expected):
    for url, prompt in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        raw = RawRow(0, {"custom_id": "c", "url": url, "body": {**prompt, **body}}, None, "line 1")
        params = shared_sampling_params({}, build_openai_request(raw).overrides, 0)
        assert params.structured_outputs.key == expected
    text = build_openai_request(chat_line(response_format={"type": "text"}))
    assert "structured_outputs" not in text.overrides
    both = build_openai_request(chat_line(structured_outputs={"regex": "a+"}, response_format={"type": "json_object"}))
    with pytest.raises(RowError, match="needs exactly one of"):  # as vLLM's replace() of one with the other
        shared_sampling_params({}, both.overrides, 0)
    not_an_object = build_openai_request(chat_line(structured_outputs="json", response_format={"type": "json_object"}))
    with pytest.raises(RowError, match=r"structured_outputs='json' is invalid"):
        shared_sampling_params({}, not_an_object.overrides, 0)


def test_sampling_fields_vllm_takes_from_the_body():
    body = {"logit_bias": {"5": 10, "7": -100}, "allowed_token_ids": [5, 7], "bad_words": ["cat"],
            "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4}
    params = shared_sampling_params({}, build_openai_request(chat_line(**body)).overrides, 0)
    assert (params.logit_bias, params.allowed_token_ids, params.bad_words) == ({5: 10.0, 7: -100.0}, [5, 7], ["cat"])
    assert (params.spaces_between_special_tokens, params.truncate_prompt_tokens) == (False, 4)
    with pytest.raises(RowError, match="logit_bias"):
        shared_sampling_params({}, build_openai_request(chat_line(logit_bias={"x": 1})).overrides, 0)


# --- end to end: `tokenmill run` on a tiny random Llama ----------------------------------------

# A short template reading tools and a variable (the tiny model's max_model_len is 128 tokens).
SHORT = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
         "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
         "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}")


def test_openai_lines_chat_fields_and_constraints_take_effect(tmp_path, llm):
    tokenizer = llm.get_tokenizer()
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    messages = [{"role": "user", "content": "What is the weather in Bern?"}]
    lines = [
        {"custom_id": "tools", "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_tokens": 4, "chat_template": SHORT, "tools": TOOLS,
                  "chat_template_kwargs": {"enable_thinking": False}}},
        {"custom_id": "schema", "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_tokens": 8, "response_format": {
             "type": "json_schema", "json_schema": {"name": "colour", "schema": {"enum": ["red", "blue"]}}}}},
        {"custom_id": "bias", "url": "/v1/completions", "body": {"prompt": "x y", "max_tokens": 4, "logit_bias": {str(token): 100}}},
        {"custom_id": "required", "url": "/v1/chat/completions",
         "body": {"messages": messages, "tools": TOOLS, "tool_choice": "required"}},
    ]
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", lines), sampling={"temperature": 0.0})
    assert summary.failed == 1
    lines_out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    out = {custom_id: line["response"] for custom_id, line in lines_out.items()}

    ids = reference(tokenizer, messages, SHORT, tools=TOOLS, enable_thinking=False)[0]
    assert "<tools>get_weather;</tools>" in tokenizer.decode(ids) and "<nothink>" in tokenizer.decode(ids)
    want = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    body = out["tools"]["body"]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["choices"][0]["message"]["content"] == want

    choice = out["schema"]["body"]["choices"][0]  # the random model says "red" or "blue", as JSON, and stops
    assert json.loads(choice["message"]["content"]) in ("red", "blue") and choice["finish_reason"] == "stop"
    assert out["bias"]["body"]["choices"][0]["text"] == tokenizer.decode([token] * 4)
    refused = lines_out["required"]["response"]  # a request with an unsupported value: OpenAI's 400
    assert refused["status_code"] == 400
    assert "line 4: body.tool_choice='required' is not supported" in refused["body"]["error"]["message"]


def test_generic_rows_with_messages_and_tools_through_the_job(tmp_path, llm):
    tokenizer = llm.get_tokenizer()
    rows = [{"id": "t", "messages": USER, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
            {"id": "p", "messages": USER}]
    job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", rows), chat_template=SHORT)
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    with_tools = reference(tokenizer, USER, SHORT, tools=TOOLS, enable_thinking=False)[0]
    assert records["t"]["prompt_tokens"] == len(with_tools) > records["p"]["prompt_tokens"] == len(reference(tokenizer, USER, SHORT)[0])


def test_a_job_template_that_needs_tools_passes_the_up_front_check_and_renders_each_rows_tools(tmp_path, llm):
    """--chat-template is checked before any row runs by rendering a one-turn conversation without
    tools: a template that refuses a conversation without tools must still pass (the rows carry
    them), each row rendering with its own tools as transformers renders them, and a row without
    tools failing alone with the template's own message."""
    needs_tools = ("{% if not tools %}{{ raise_exception('this template needs tools') }}{% endif %}" + SHORT)
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    rows = [{"id": "weather", "messages": USER, "tools": TOOLS}, {"id": "time", "messages": USER, "tools": other},
            {"id": "none", "messages": USER}]
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", rows), chat_template=needs_tools)
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    tokenizer = llm.get_tokenizer()
    for name, tools in (("weather", TOOLS), ("time", other)):
        ids = reference(tokenizer, USER, needs_tools, tools=tools)[0]
        want = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
        assert records[name]["error"] is None and records[name]["prompt_tokens"] == len(ids)
        assert records[name]["text"] == want
    assert summary.failed == 1 and "this template needs tools" in records["none"]["error"]
