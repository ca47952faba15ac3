"""`tokenmill run` with a model whose output holds NaN or infinities (an fp16 model that overflowed;
injected here: tiny random models do not overflow). JSON has no NaN or Infinity, and strict readers
(and vector databases' loaders) refuse a line holding them: every output line must parse strictly
(``support.jsonl.read_jsonl`` refuses them). A pooling row whose vector or score is not a number has
no result: it is an error row naming its line (an OpenAI line a 500, the engine's fault, as vLLM's
server without orjson answers one), the others are written as usual; a generation record's logprobs
are written as vLLM's server writes them (-inf as -9999.0, NaN null)."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch

import tokenmill.batch.loop as loop_module
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.pooling import PoolingRows
from tokenmill.outputs import PoolingOutput

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import GREEDY, by_row, engine_left_clean, llm  # noqa: F401 (fixtures)

TEXTS = ["the cat sat on a warm mat", "wind blew over its fur", "the sun went down", "a mat while the cat"]
BROKEN_ROW = 2  # on line 3 of the input


def job(tmp_path, engine, rows, output="out.jsonl", **overrides):
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    config = JobConfig(input=str(path), output=str(tmp_path / output), model="tiny", progress=False, **overrides)
    return run_job(config, llm=engine)


def poison_pooled_output(monkeypatch, value: float) -> None:
    """Row BROKEN_ROW's first engine output gets ``value`` in its second place, as the model had made it."""
    real = PoolingRows.result

    def poisoned(self, request, outputs):
        if request.index == BROKEN_ROW:
            data = outputs[0].outputs.data.clone()
            data.view(-1)[min(1, data.numel() - 1)] = value
            outputs = [*outputs]
            outputs[0] = type(outputs[0])(outputs[0].request_id, PoolingOutput(data), outputs[0].prompt_token_ids,
                                          outputs[0].num_cached_tokens, outputs[0].finished)
        return real(self, request, outputs)

    monkeypatch.setattr(PoolingRows, "result", poisoned)


@pytest.mark.parametrize("task, model, field", [
    ("embed", "bert_embedder_llm", "embedding"), ("classify", "bert_classifier_llm", "probs"),
    ("score", "cross_encoder_llm", "score"), ("score", "bert_embedder_llm", "score")])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_pooling_row_whose_output_is_not_a_number_fails_alone(tmp_path, request, monkeypatch, task, model, field, value):
    pooling_llm = request.getfixturevalue(model)
    rows = [{"text_1": t, "text_2": TEXTS[-1 - i]} if task == "score" else {"prompt": t} for i, t in enumerate(TEXTS)]
    poison_pooled_output(monkeypatch, value)
    summary = job(tmp_path, pooling_llm, rows, task=task)
    assert summary.exit_code == 3 and summary.rows_done == len(TEXTS) and summary.failed == 1
    records = {r["row"]: r for r in read_jsonl(tmp_path / "out.jsonl")}  # strict: no NaN, no Infinity
    assert sorted(records) == list(range(len(TEXTS)))
    error = records[BROKEN_ROW]["error"]
    assert error.startswith("line 3: the model's output is not a number: ") and "--dtype" in error
    assert records[BROKEN_ROW][field] is None and summary.errors == [error]
    assert all(records[i][field] is not None and records[i]["error"] is None for i in records if i != BROKEN_ROW)


def test_a_parquet_output_holds_no_nan_either(tmp_path, bert_embedder_llm, monkeypatch):
    poison_pooled_output(monkeypatch, math.nan)
    summary = job(tmp_path, bert_embedder_llm, [{"prompt": t} for t in TEXTS], output="out.parquet", task="embed")
    assert summary.failed == 1
    records = {r["row"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert records[BROKEN_ROW]["embedding"] is None and "not a number" in records[BROKEN_ROW]["error"]
    assert all(math.isfinite(x) for i in records if i != BROKEN_ROW for x in records[i]["embedding"])


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_an_openai_embeddings_line_with_a_nan_vector_is_a_500(tmp_path, bert_embedder_llm, monkeypatch, encoding):
    """The line's other inputs are fine, but the line is one response: no vector of it is written."""
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": [t, TEXTS[0]], "encoding_format": encoding}} for i, t in enumerate(TEXTS)]
    poison_pooled_output(monkeypatch, math.nan)
    summary = job(tmp_path, bert_embedder_llm, lines, task="embed")
    assert summary.exit_code == 3 and summary.failed == 1
    out = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert [out[f"e{i}"]["response"]["status_code"] for i in range(len(TEXTS))] == [200, 200, 500, 200]
    error = out["e2"]["response"]["body"]["error"]
    assert error["type"] == "server_error" and "the embedding of input 0 has 1 NaN or infinite value(s)" in error["message"]


def test_an_openai_rerank_line_with_a_nan_score_is_a_500(tmp_path, cross_encoder_llm, monkeypatch):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/rerank",
              "body": {"query": t, "documents": TEXTS[:3]}} for i, t in enumerate(TEXTS)]
    poison_pooled_output(monkeypatch, math.nan)
    summary = job(tmp_path, cross_encoder_llm, lines, task="score")
    assert summary.failed == 1
    out = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert [out[f"r{i}"]["response"]["status_code"] for i in range(len(TEXTS))] == [200, 200, 500, 200]
    assert "the score of pair 0 is nan" in out["r2"]["response"]["body"]["error"]["message"]


def test_generation_logprobs_that_are_not_numbers_are_written_as_vllms_server_writes_them(tmp_path, llm, monkeypatch):
    """-inf as -9999.0 and NaN as null (pydantic's JSON), as the OpenAI lines write them; the other
    rows' values are untouched."""
    real = loop_module.result_from_output

    def overflowed(index, *args, **kwargs):
        result = real(index, *args, **kwargs)
        if index == BROKEN_ROW:
            result.samples[0].cumulative_logprob = math.nan
            result.prompt_token_logprobs = [-math.inf, math.nan, *result.prompt_token_logprobs[2:]]
        return result

    monkeypatch.setattr(loop_module, "result_from_output", overflowed)
    summary = job(tmp_path, llm, [{"prompt": t} for t in TEXTS], sampling={**GREEDY, "logprobs": 1, "prompt_logprobs": 0})
    assert summary.exit_code == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))  # strict: no NaN, no Infinity
    broken = records[(BROKEN_ROW, 0)]
    assert broken["cumulative_logprob"] is None and broken["prompt_token_logprobs"][:2] == [-9999.0, None]
    assert broken["prompt_logprob"] is None  # the sum of a NaN
    for i in range(len(TEXTS)):
        if i != BROKEN_ROW:
            record = records[(i, 0)]
            assert record["cumulative_logprob"] < 0 and all(-9999.0 < lp <= 0 for lp in record["prompt_token_logprobs"])
            assert record["prompt_logprob"] == pytest.approx(math.fsum(record["prompt_token_logprobs"]))


def test_a_prompt_logprob_of_minus_infinity_is_summed_to_minus_9999(tmp_path, llm, monkeypatch):
    real = loop_module.result_from_output

    def cut(index, *args, **kwargs):
        result = real(index, *args, **kwargs)
        if index == BROKEN_ROW:
            result.prompt_token_logprobs = [-math.inf, *result.prompt_token_logprobs[1:]]
            result.samples[0].cumulative_logprob = -math.inf
        return result

    monkeypatch.setattr(loop_module, "result_from_output", cut)
    job(tmp_path, llm, [{"prompt": t} for t in TEXTS], sampling={**GREEDY, "logprobs": 1, "prompt_logprobs": 0})
    broken = by_row(read_jsonl(tmp_path / "out.jsonl"))[(BROKEN_ROW, 0)]
    assert broken["prompt_logprob"] == broken["cumulative_logprob"] == broken["prompt_token_logprobs"][0] == -9999.0


def test_every_value_kind_of_a_generic_record_is_strict_json(tmp_path, llm):
    """Text that looks like a constant, ids of every type (a float id NaN from a Parquet input
    among them), logprobs, an error row: every line parses strictly."""
    import pyarrow as pa

    table = pa.table({"prompt": [*TEXTS, "NaN", ""], "id": [1.5, math.nan, math.inf, None, -math.inf, 2.0]})
    pq.write_table(table, tmp_path / "in.parquet")
    config = JobConfig(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out.jsonl"), model="tiny", progress=False,
                       sampling={**GREEDY, "logprobs": 1, "prompt_logprobs": 0})
    summary = run_job(config, llm=llm)
    assert summary.failed == 1  # the empty prompt
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(row for row, _ in records) == list(range(6))
    assert records[(1, 0)]["id"] == "nan" and records[(2, 0)]["id"] == "inf" and records[(4, 0)]["text"] is not None
    assert torch.isfinite(torch.tensor(records[(0, 0)]["prompt_token_logprobs"])).all()
