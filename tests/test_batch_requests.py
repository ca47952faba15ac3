"""Row -> request translation (generic rows and OpenAI batch lines) and OpenAI-shaped output records."""

from __future__ import annotations

import pytest

from tokenmill.batch.openai_batch import build_openai_request, openai_record
from tokenmill.batch.readers import RawRow
from tokenmill.batch.requests import (
    PromptSettings, RowError, build_row_request, derive_seed, row_seed, shared_sampling_params,
)
from tokenmill.batch.results import RowResult, SampleResult, generic_records
from tokenmill.outputs import Logprob


def row(record, index=0):
    return RawRow(index, record, None, f"line {index + 1}")


def test_prompt_precedence():
    rec = {"id": "a", "prompt": "P", "text": "T", "name": "N", "messages": [{"role": "user", "content": "M"}]}
    assert build_row_request(row(rec), PromptSettings(prompt_template="about {name}")).prompt == "about N"
    assert build_row_request(row(rec), PromptSettings(text_field="text")).prompt == "T"
    assert build_row_request(row(rec), PromptSettings()).messages == [{"role": "user", "content": "M"}]
    no_messages = {k: v for k, v in rec.items() if k != "messages"}
    assert build_row_request(row(no_messages), PromptSettings()).prompt == "P"


def test_an_empty_text_goes_on_to_the_engine():
    """As LLM.generate("") and vLLM take it: the tokenizer's BOS or the chat template may make tokens of
    it; the engine refuses it by name when nothing does (tests/test_prompt_batches.py)."""
    assert build_row_request(row({"prompt": ""}), PromptSettings()).prompt == ""
    assert build_row_request(row({"prompt": ""}), PromptSettings(chat=True)).messages == [{"role": "user", "content": ""}]


def test_chat_and_system():
    req = build_row_request(row({"prompt": "hi"}), PromptSettings(chat=True, system="be brief"))
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = build_row_request(row({"prompt": "hi"}), PromptSettings(system="S"))  # --system implies chat
    assert req.messages[0] == {"role": "system", "content": "S"}
    own_system = {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]}
    assert build_row_request(row(own_system), PromptSettings(system="S")).messages[0]["content"] == "mine"


def test_template_fills_lists_and_numbers():
    rec = {"name": "Tent", "features": ["light", "dry"], "price": 99}
    req = build_row_request(row(rec), PromptSettings(prompt_template="{name}: {features} for ${price}"))
    assert req.prompt == "Tent: light, dry for $99"


def test_ids():
    assert build_row_request(row({"prompt": "x"}, 5), PromptSettings()).row_id == 5
    assert build_row_request(row({"prompt": "x", "id": "abc"}), PromptSettings()).row_id == "abc"
    assert build_row_request(row({"prompt": "x", "sku": 7}), PromptSettings(id_field="sku")).row_id == 7
    with pytest.raises(RowError, match="no id field 'sku'"):
        build_row_request(row({"prompt": "x"}), PromptSettings(id_field="sku"))
    where = RawRow(6, {"prompt": "x", "name": "n"}, None, "line 9")  # the line a person finds, not the 0-based index
    with pytest.raises(RowError, match=r"^line 9 has no id field 'sku' \(--id-field; its fields: \['name', 'prompt'\]\)"):
        build_row_request(where, PromptSettings(id_field="sku"))


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "x"}, r"has no prompt: .*\(fields: \['text'\]\); or pass"),  # nothing close: no guess
        ({"id": 3, "Message": "x"}, r"has no prompt: .*\(fields: \['Message', 'id'\]; is 'Message' meant to be 'messages'\?\)"),
        ({"prompt": 42}, r"'prompt' must be a string \(or a list of token ids\), got int 42"),
        ({"messages": "not json"}, "'messages' is not a JSON list"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"content": "no role"}]}, r"messages\[0\] must be an object with a string 'role'"),
        ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\].content must be a string"),
        ({"prompt_token_ids": [1, "2"]}, "list of integers"),
        ({"prompt": "x", "sampling_params": [1]}, "'sampling_params' must be an object"),
        ({"prompt": "x", "sampling_params": "{bad"}, "not a JSON object"),
    ],
)
def test_bad_rows_name_the_field(record, message):
    with pytest.raises(RowError, match=message):
        build_row_request(row(record), PromptSettings())


def test_template_missing_field():
    with pytest.raises(RowError, match=r"no field\(s\) \['audience'\]"):
        build_row_request(row({"name": "x"}), PromptSettings(prompt_template="{name} for {audience}"))


@pytest.mark.parametrize("template, message", [("{", "malformed"), ("{}", "positional"), ("plain", "uses no row field")])
def test_bad_templates_fail_up_front(template, message):
    with pytest.raises(ValueError, match=message):
        PromptSettings(prompt_template=template)


def test_csv_sampling_params_as_json_text():
    req = build_row_request(row({"prompt": "x", "sampling_params": '{"max_tokens": 3}'}), PromptSettings())
    assert req.overrides == {"max_tokens": 3}


def test_row_sampling_params_made_once_per_distinct_values():
    """Rows with the same values share one checked build (``made``), each drawing with its own seed
    (``row_seed``, handed to the engine apart): every field as a fresh build gives it; bad values
    fail every row that has them."""
    from tokenmill.sampling_params import SamplingParams

    base, made = {"temperature": 0.7, "max_tokens": 8, "stop": ["\n"]}, {}
    rows = [({"max_tokens": 3}, 4), ({"max_tokens": 3}, 5), ({}, 6), ({"max_tokens": 3, "seed": 9}, 7), ({}, 8)]
    for overrides, index in rows:
        got = shared_sampling_params(base, overrides, index, made=made)
        fresh = shared_sampling_params(base, overrides, index)
        assert got is not fresh and got == fresh, overrides
        assert row_seed(got, 11, index) == overrides.get("seed", derive_seed(11, index))
    assert len(made) == 3
    one, two = (shared_sampling_params(base, {"max_tokens": 3}, i, made=made) for i in (1, 2))
    assert one is two and row_seed(one, 11, 1) != row_seed(two, 11, 2) and one.max_tokens == 3
    assert isinstance(one, SamplingParams) and one.output_kind.name == "CUMULATIVE"
    for _ in range(2):
        with pytest.raises(RowError, match="temperature"):
            shared_sampling_params(base, {"temperature": -1}, 0, made=made)
    # A schema's property order is part of the constraint (xgrammar follows it): no sharing across orders.
    orders = (["x", "y"], ["y", "x"])
    schemas = [{"structured_outputs": {"json": {"type": "object", "properties": {k: {"type": "integer"} for k in order}}}}
               for order in orders]
    got = [shared_sampling_params(base, schema, 1, made=made).structured_outputs.json for schema in schemas]
    assert [list(g["properties"]) for g in got] == list(orders)


def test_row_sampling_params():
    base = {"temperature": 0.7, "max_tokens": 8}
    p = shared_sampling_params(base, {"max_tokens": 3}, index=4)
    assert (p.max_tokens, p.temperature, row_seed(p, 11, 4)) == (3, 0.7, derive_seed(11, 4))
    assert derive_seed(11, 4) != derive_seed(11, 5) and derive_seed(11, 4) != derive_seed(12, 4)
    assert row_seed(shared_sampling_params(base, {"seed": 9}, 4), 11, 4) == 9
    assert row_seed(shared_sampling_params(base, {"temperature": 0}, 4), 11, 4) is None  # greedy needs none
    with pytest.raises(RowError, match="temperature"):
        shared_sampling_params(base, {"temperature": -1}, 0)
    with pytest.raises(RowError, match=r"unknown sampling parameter\(s\) \['temp'\]"):
        shared_sampling_params(base, {"temp": 1}, 0)
    with pytest.raises(RowError, match=r"\['temprature'\] in sampling_params \(did you mean 'temperature'\?\); "
                                       r"allowed: \[.*'max_tokens'.*'top_p'"):
        shared_sampling_params(base, {"temprature": 1}, 0)
    with pytest.raises(RowError, match="max_tokens"):
        shared_sampling_params(base, {"max_tokens": "8"}, 0)


def test_row_repetition_detection_object():
    # A JSON object, or an Arrow struct whose unset keys come back as nulls.
    rd = {"max_pattern_size": 4, "min_pattern_size": None, "min_count": 3}
    p = shared_sampling_params({"max_tokens": 8}, {"repetition_detection": rd}, index=0)
    assert (p.repetition_detection.max_pattern_size, p.repetition_detection.min_pattern_size,
            p.repetition_detection.min_count) == (4, 0, 3)
    with pytest.raises(RowError, match=r"row 2: RepetitionDetectionParams\.min_count=1 is invalid"):
        shared_sampling_params({}, {"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}, 2)
    with pytest.raises(RowError, match="thinking_token_budget=64 is invalid.*no reasoning parsers"):
        shared_sampling_params({}, {"thinking_token_budget": 64}, 0)


# --- OpenAI batch ------------------------------------------------------------------------------


def openai_line(**overrides):
    line = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}}
    line.update(overrides)
    return row(line)


def test_openai_chat_and_completion_requests():
    req = build_openai_request(openai_line())
    assert req.messages == [{"role": "user", "content": "hi"}] and req.row_id == "req-1"
    assert req.overrides == {"max_tokens": 5, "temperature": 0}
    req = build_openai_request(openai_line(url="/v1/completions", body={"prompt": "Once", "max_completion_tokens": 3, "n": 2}))
    assert req.prompt == "Once" and req.overrides == {"max_tokens": 3, "n": 2}
    for body in ({"max_completion_tokens": 2, "max_tokens": 5}, {"max_tokens": 5, "max_completion_tokens": 2}):
        # The newer name wins, whichever comes last in the line (as OpenAI and vLLM's server take it).
        assert build_openai_request(openai_line(body={"messages": [{"role": "user", "content": "x"}], **body})).overrides["max_tokens"] == 2
    req = build_openai_request(openai_line(url="/v1/completions", body={"prompt": [[1, 2, 3]]}))
    assert req.prompt_token_ids == [1, 2, 3]
    req = build_openai_request(openai_line(body={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}))
    assert req.overrides["logprobs"] == 2 and req.openai.top_logprobs == 2
    rd = {"max_pattern_size": 8, "min_count": 4}  # an object, as vLLM's server takes it
    req = build_openai_request(openai_line(url="/v1/completions", body={"prompt": "a", "repetition_detection": rd}))
    assert req.overrides == {"repetition_detection": rd}
    assert shared_sampling_params({}, req.overrides, 0).repetition_detection.min_count == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"custom_id": None}, "custom_id"),
        ({"method": "GET"}, "method 'GET'"),
        ({"url": "/v1/embeddings"}, "url '/v1/embeddings' is answered under --task embed, and this job runs --task generate"),
        ({"url": "/v1/rerank"}, "url '/v1/rerank' is answered under --task score"),
        ({"url": "/v1/audio/transcriptions"}, r"is not supported; use .*'/v1/score' / '/v1/rerank' \(--task score\)"),
        ({"body": "x"}, "'body' must be an object"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "tools": []}}, r"body\.tools=\[\] is invalid: must be a non-empty list"),
        ({"url": "/v1/completions", "body": {"prompt": "x", "tools": [{"function": {"name": "f"}}]}}, r"\['tools'\] are not supported"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "temprature": 0}},
         r"\['temprature'\] are not supported by tokenmill \(did you mean 'temperature'\?\) \(supported: \["),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "top-p": 0.5}}, r"\['top-p'\] .* \(did you mean 'top_p'\?\)"),
        # Fields of vLLM's request models that are refused here are not taken for typos of a near name.
        ({"url": "/v1/completions", "body": {"prompt": "x", "top_logprobs": 2}}, r"\['top_logprobs'\] are not supported by tokenmill yet"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "logprob_token_ids": [1]}},
         r"\['logprob_token_ids'\] are not supported by tokenmill yet"),
        ({"body": {"max_tokens": 3}}, "body.messages is required"),
        ({"url": "/v1/completions", "body": {"prompt": ["a", "b"]}}, "one prompt per batch line"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "stream": True}}, "stream"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}}, r"body\.stream='yes' is not supported"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "stream": 1}}, r"body\.stream=1 is not supported"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": True}},
         r"body\.top_logprobs=True is invalid: must be an integer in \[0, 20\]"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}},
         "body.logprobs='yes' is invalid: must be true or false"),
        ({"body": {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}},
         "body.top_logprobs=3 needs body.logprobs=true"),
    ],
)
def test_openai_bad_requests(overrides, message):
    with pytest.raises(RowError, match=message) as info:
        build_openai_request(openai_line(**overrides))
    if overrides.get("custom_id", "req-1") is not None:
        assert info.value.row_id == "req-1"


def test_openai_fields_set_to_null_are_not_set():
    """A body dumped from a typed request object carries every field, unsupported ones as null."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": False, "tools": None,
            "tool_choice": None, "response_format": None, "logit_bias": None, "temperature": None}
    req = build_openai_request(openai_line(body=body))
    assert req.overrides == {"max_tokens": 3}
    with pytest.raises(RowError, match=r"\['logprob_token_ids'\] are not supported"):
        build_openai_request(openai_line(body={**body, "logprob_token_ids": [1]}))


def test_openai_output_shapes():
    meta = build_openai_request(openai_line()).openai
    ok = RowResult(0, "req-1", prompt_tokens=7, samples=[SampleResult(0, "Hello!", [5, 6], "stop")], openai=meta)
    rec = openai_record(ok, "tiny", 123, "job")
    assert rec["custom_id"] == "req-1" and rec["error"] is None and rec["id"].startswith("batch_req_")
    body = rec["response"]["body"]
    assert rec["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["model"] == "tiny" and body["created"] == 123
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello!", "refusal": None}, "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert openai_record(ok, "tiny", 999, "job")["id"] == rec["id"]  # stable across reruns

    bad = RowResult(1, "req-2", error="prompt too long", openai=meta)
    rec = openai_record(bad, "tiny", 123, "job")
    assert rec["response"]["status_code"] == 400 and rec["response"]["body"]["error"]["message"] == "prompt too long"
    unparsable = RowResult(2, None, error="line 3 is not valid JSON")
    rec = openai_record(unparsable, "tiny", 123, "job")
    assert rec["response"] is None and rec["error"]["message"] == "line 3 is not valid JSON"


def test_openai_logprobs_shapes():
    chat_meta = build_openai_request(openai_line(body={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1})).openai
    lp = [{5: Logprob(-0.1, 1, "He"), 9: Logprob(-2.0, 2, "Ha")}]
    sample = SampleResult(0, "He", [5], "length", -0.1, lp)
    choice = openai_record(RowResult(0, "c", 1, [sample], openai=chat_meta), "m", 0, "j")["response"]["body"]["choices"][0]
    assert choice["logprobs"]["content"] == [{"token": "He", "logprob": -0.1, "bytes": [72, 101],
                                              "top_logprobs": [{"token": "He", "logprob": -0.1, "bytes": [72, 101]}]}]
    comp_meta = build_openai_request(openai_line(url="/v1/completions", body={"prompt": "x", "logprobs": 1})).openai
    choice = openai_record(RowResult(0, "c", 1, [sample], openai=comp_meta), "m", 0, "j")["response"]["body"]["choices"][0]
    assert choice["text"] == "He"
    assert choice["logprobs"] == {"tokens": ["He"], "token_logprobs": [-0.1], "top_logprobs": [{"He": -0.1, "Ha": -2.0}], "text_offset": [0]}


def test_generic_records():
    result = RowResult(3, "x", 4, [SampleResult(0, "a", [1], "stop"), SampleResult(1, "bc", [2, 3], "length")])
    recs = generic_records(result)
    assert [(r["sample_index"], r["text"], r["completion_tokens"]) for r in recs] == [(0, "a", 1), (1, "bc", 2)]
    assert all(r["row"] == 3 and r["id"] == "x" and r["error"] is None for r in recs)
    (err,) = generic_records(RowResult(4, 4, error="boom"))
    assert err["error"] == "boom" and err["text"] is None


def test_null_prompt_fields_count_as_absent():
    # A Parquet table mixing chat and text rows gives each row both columns, one of them null.
    text_row = build_row_request(row({"prompt": "hi", "messages": None, "prompt_token_ids": None}), PromptSettings())
    assert text_row.prompt == "hi" and text_row.messages is None
    chat_row = build_row_request(row({"prompt": None, "messages": [{"role": "user", "content": "q"}]}), PromptSettings())
    assert chat_row.messages == [{"role": "user", "content": "q"}]
    ids_row = build_row_request(row({"prompt": None, "messages": None, "prompt_token_ids": [5, 6]}), PromptSettings())
    assert ids_row.prompt_token_ids == [5, 6]
    with pytest.raises(RowError, match=r"has no prompt: .*\('messages' and 'prompt' are null\)"):
        build_row_request(row({"prompt": None, "messages": None}), PromptSettings())


def test_template_null_field_is_an_error_not_the_text_none():
    with pytest.raises(RowError, match=r"line 1: field\(s\) \['audience'\] used by --prompt-template are null"):
        build_row_request(row({"name": "x", "audience": None}), PromptSettings(prompt_template="{name} for {audience}"))


@pytest.mark.parametrize("overrides, message", [
    ({"stop": 5}, r"SamplingParams\.stop=5 is invalid: must be a string, a list of strings or None"),
    ({"stop": {"a": 1}}, r"SamplingParams\.stop=\{'a': 1\} is invalid"),
    ({"stop_token_ids": 7}, r"SamplingParams\.stop_token_ids=7 is invalid: must be a list of non-negative integers"),
    ({"stop_token_ids": "12"}, r"SamplingParams\.stop_token_ids='12' is invalid"),
])
def test_row_stop_values_of_the_wrong_shape_name_the_field(overrides, message):
    with pytest.raises(RowError, match=rf"line 3: {message}"):
        shared_sampling_params({}, overrides, 2, where="line 3")


@pytest.mark.parametrize(
    "columns, settings, message",
    [
        (["id", "promt"], PromptSettings(),
         r"has no 'prompt', 'messages' or 'prompt_token_ids' column \(its columns: \['id', 'promt'\]; is 'promt' meant to be "
         r"'prompt'\?\); pass --text-field or --prompt-template"),
        (["id", "text"], PromptSettings(), r"\(its columns: \['id', 'text'\]\); pass --text-field"),  # nothing close: no guess
        (["id", "body"], PromptSettings(text_field="bdy"), r"no column 'bdy' \(--text-field\) \(did you mean 'body'\?\); its columns"),
        (["key", "body"], PromptSettings(id_field="kye"), r"no column 'kye' \(--id-field\) \(did you mean 'key'\?\)"),
        (["product"], PromptSettings(prompt_template="Sell {prodct}"),
         r"no column\(s\) \['prodct'\] used by --prompt-template \(did you mean 'product'\?\)"),
    ],
)
def test_a_missing_column_close_to_one_the_file_has_is_named(columns, settings, message):
    """CSV / Parquet headers (and a JSONL file's first rows): a misspelt column, or a flag naming one, says
    which was meant, before the model loads."""
    from tokenmill.batch.requests import check_columns

    with pytest.raises(ValueError, match=message):
        check_columns(columns, settings, "in.csv")
