"""`tokenmill run --task embed|classify|score` on tiny random BERT models: records match LLM.embed /
classify / score (themselves checked against transformers and sentence-transformers), bad rows fail
alone, Parquet output has a typed schema, and an interrupted job resumes with every row once."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import PoolingParams
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.journal import ResumeError
from tokenmill.batch.requests import PromptSettings
from tokenmill.cli import main

from support.jsonl import read_jsonl, write_jsonl


@pytest.fixture
def texts(random_sentences):
    return lambda count, seed=0: random_sentences(count, seed, high=15)


def job(tmp_path, llm, rows, task, output="out.jsonl", **overrides):
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    config = JobConfig(input=str(source), output=str(tmp_path / output), model="tiny", task=task, progress=False,
                       **overrides)
    return run_job(config, llm=llm)


def by_row(records):
    rows = {}
    for record in records:
        assert record["row"] not in rows, f"row {record['row']} written twice"
        rows[record["row"]] = record
    return rows


def test_embed_rows_match_llm_embed_and_bad_rows_fail_alone(tmp_path, bert_embedder_llm, texts):
    words = texts(6)
    rows = [{"id": f"r{i}", "prompt": t} for i, t in enumerate(words)]
    rows[2] = {"id": "r2", "body": words[2]}  # no prompt
    rows[3] = {"id": "r3", "prompt": words[3], "pooling_params": {"use_activation": True}}  # vLLM 0.26's name beats the job's normalize
    rows.append({"id": "long", "prompt": " ".join(["cat"] * 60)})  # over max_model_len=48
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "hi"}]})
    rows.append({"id": "bad", "prompt": "the cat", "pooling_params": {"dimension": 8}})
    summary = job(tmp_path, bert_embedder_llm, rows, "embed", pooling={"normalize": False})
    assert summary.exit_code == 3 and summary.failed == 4 and summary.rows_done == len(rows)
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    for i in (0, 1, 4, 5):
        expected = bert_embedder_llm.embed(words[i], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
        # The job batches rows together, embed() runs one alone: fp32 sums over other batch shapes
        # may differ in the last bits (seen: 1.07e-6 on a value of 1.39 on a loaded machine).
        assert records[i]["embedding"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert records[i]["id"] == f"r{i}" and records[i]["error"] is None and records[i]["prompt_tokens"] > 2
    normed = bert_embedder_llm.embed(words[3], PoolingParams(normalize=True), use_tqdm=False)[0].outputs.embedding
    assert records[3]["embedding"] == pytest.approx(normed, abs=1e-6)  # the row's own pooling_params
    for i, message in ((2, "has no prompt"), (6, "max_model_len=48"), (7, "not chat 'messages'"), (8, "unknown pooling parameter")):
        assert records[i]["embedding"] is None and message in records[i]["error"]


def test_a_job_wide_cut_past_max_model_len_is_refused_before_any_row(tmp_path, bert_embedder_llm):
    """Every row failed with it, one error row each; now a usage error, as for generation."""
    with pytest.raises(ValueError, match=r"--truncate-prompt-tokens 100 is more than this engine's max_model_len \(48\)"):
        job(tmp_path, bert_embedder_llm, [{"prompt": "the cat"}], "embed", pooling={"truncate_prompt_tokens": 100})
    assert not (tmp_path / "out.jsonl").exists() or not read_jsonl(tmp_path / "out.jsonl")


def test_embed_rows_are_tokenized_together_as_each_alone(tmp_path, bert_embedder_llm, texts, monkeypatch):
    """The job's texts go through the tokenizer's batch path, a few calls for many rows, and each
    row gets the tokens the tokenizer gives its text alone; a row that truncates is tokenized alone."""
    tokenizer = bert_embedder_llm.llm_engine.tokenizer
    words = texts(40, seed=3)
    alone = [tokenizer(t)["input_ids"] for t in words]
    calls = []
    made = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, *a, **k: calls.append(text) or made(self, text, *a, **k))
    rows = [{"id": i, "prompt": t} for i, t in enumerate(words)]
    rows[5]["pooling_params"] = {"truncate_prompt_tokens": 4}
    summary = job(tmp_path, bert_embedder_llm, rows, "embed")
    assert summary.exit_code == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert [records[i]["prompt_tokens"] for i in range(len(rows)) if i != 5] == [len(ids) for i, ids in enumerate(alone) if i != 5]
    assert records[5]["prompt_tokens"] == 4
    assert len(calls) < len(rows) / 4, len(calls)
    assert sum(isinstance(c, list) for c in calls) >= 1 and words[5] in calls  # the batch, and the truncating row alone

def test_parquet_pooling_params_nulls_mean_not_set(tmp_path, bert_embedder_llm, texts):
    words = texts(2)
    rows = [{"prompt": words[0], "pooling_params": {"normalize": False, "dimensions": None}},
            {"prompt": words[1], "pooling_params": {"normalize": None, "dimensions": None}}]  # Arrow's fill-ins
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    summary = run_job(JobConfig(input=str(source), output=str(tmp_path / "out.jsonl"), model="tiny", task="embed",
                                progress=False, pooling={"normalize": True}), llm=bert_embedder_llm)
    assert summary.exit_code == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    for row, normalize in ((0, False), (1, True)):  # a null normalize leaves the job's value (not the model's: off)
        expected = bert_embedder_llm.embed(words[row], PoolingParams(normalize=normalize), use_tqdm=False)[0].outputs.embedding
        assert records[row]["embedding"] == pytest.approx(expected, abs=1e-6)


def test_classify_to_parquet_has_labels_and_probabilities(tmp_path, bert_classifier_llm, texts):
    words = texts(7, seed=1)
    summary = job(tmp_path, bert_classifier_llm, [{"text": t} for t in words], "classify", output="out.parquet",
                  prompt=PromptSettings(text_field="text"))
    assert summary.exit_code == 0
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("probs").type == pa.list_(pa.float32())
    assert table.schema.field("label").type == pa.string()
    records = by_row(table.to_pylist())
    expected = bert_classifier_llm.classify(words, use_tqdm=False)
    labels = ("negative", "neutral", "positive")
    for i, out in enumerate(expected):
        assert records[i]["probs"] == pytest.approx(out.outputs.probs, abs=1e-6)
        assert records[i]["label"] == labels[max(range(3), key=out.outputs.probs.__getitem__)]


def test_an_empty_text_runs_as_its_special_tokens_or_is_refused_when_it_has_none(tmp_path, bert_classifier_llm,
                                                                                  tiny_qwen3_classifier_dir):
    """A "" row runs as LLM.classify("") does (BERT: [CLS] [SEP]); with a tokenizer that adds no special
    token it is refused as the engine refuses a zero-token prompt, alone (vLLM: the prompt cannot be empty)."""
    from tokenmill import LLM

    rows = [{"id": "empty", "prompt": ""}, {"id": "text", "prompt": "the cat"}]
    assert job(tmp_path, bert_classifier_llm, rows, "classify").failed == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    (expected,) = bert_classifier_llm.classify("", use_tqdm=False)
    assert records[0]["probs"] == pytest.approx(expected.outputs.probs, abs=1e-6)
    assert records[0]["prompt_tokens"] == len(expected.prompt_token_ids) == 2
    qwen3 = LLM(str(tiny_qwen3_classifier_dir), device="cpu", dtype="float32", max_model_len=64)
    summary = job(tmp_path, qwen3, rows, "classify", output="qwen3.jsonl")
    records = by_row(read_jsonl(tmp_path / "qwen3.jsonl"))
    assert summary.failed == 1 and records[1]["error"] is None
    assert records[0]["probs"] is None and "is empty: a prompt needs at least one token" in records[0]["error"]


@pytest.mark.parametrize("model", ["cross_encoder_llm", "bert_embedder_llm"])
def test_score_rows_match_llm_score(tmp_path, request, model, texts):
    llm = request.getfixturevalue(model)
    first, second = texts(5, seed=2), texts(5, seed=3)
    rows = [{"text_1": a, "text_2": b} for a, b in zip(first, second)] + [{"text_1": "the cat"}]
    summary = job(tmp_path, llm, rows, "score")
    assert summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    expected = llm.score(first, second, use_tqdm=False)
    for i, out in enumerate(expected):
        assert records[i]["score"] == pytest.approx(out.outputs.score, abs=1e-6)
        assert records[i]["prompt_tokens"] == len(out.prompt_token_ids)
    assert records[5]["score"] is None and "'text_2'" in records[5]["error"]


@pytest.mark.parametrize("model", ["cross_encoder_llm", "bert_embedder_llm"])
def test_score_rows_cut_by_extra_kwargs_as_llm_score_and_other_tasks_refuse_them(tmp_path, request, model):
    """A row's pooling_params.extra_kwargs were accepted and never read (uncut texts: a silent wrong
    score); a score row now cuts its texts as LLM.score does, and an embed row refuses them."""
    llm = request.getfixturevalue(model)
    cuts = {"max_tokens_per_query": 2, "max_tokens_per_doc": 3}
    first, second = "the cat sat on the mat today", "a dog ran in the park all day"
    rows = [{"text_1": first, "text_2": second, "pooling_params": {"extra_kwargs": cuts}},
            {"text_1": first, "text_2": second, "pooling_params": {"extra_kwargs": {"max_tokens_per_doc": -1}}},
            {"text_1": first, "text_2": second}]
    summary = job(tmp_path, llm, rows, "score")
    assert summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    want = llm.score(first, second, pooling_params=PoolingParams(extra_kwargs=cuts), use_tqdm=False)[0]
    assert records[0]["score"] == pytest.approx(want.outputs.score, abs=1e-6)
    assert records[0]["prompt_tokens"] == len(want.prompt_token_ids) < records[2]["prompt_tokens"]
    assert records[1]["score"] is None and "extra_kwargs['max_tokens_per_doc']" in records[1]["error"]
    if model == "bert_embedder_llm":
        embed_rows = [{"prompt": first, "pooling_params": {"extra_kwargs": cuts}}, {"prompt": first, "pooling_params": {"task": "x"}},
                      {"prompt": first}]
        summary = job(tmp_path, llm, embed_rows, "embed", output="embed.jsonl")
        records = by_row(read_jsonl(tmp_path / "embed.jsonl"))
        assert summary.failed == 2 and records[2]["error"] is None
        assert "applies to --task score only" in records[0]["error"] and "not --task embed" in records[0]["error"]
        assert "unknown pooling parameter(s) ['task']" in records[1]["error"] and "'truncate_prompt_tokens'" in records[1]["error"]


def interrupted_embed_job(tmp_path, llm, rows):
    """An embed job over ``rows`` stopped after its third poll, part done: (its config, its summary)."""
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    polls = []
    config = JobConfig(input=str(source), output=str(tmp_path / "out.jsonl"), model="tiny", task="embed", progress=False)
    first = run_job(config, llm=llm, should_stop=lambda: polls.append(1) or len(polls) > 2)
    assert first.interrupted and 0 < first.rows_done < len(rows)
    return config, first


def test_interrupted_embed_job_resumes_with_every_row_once(tmp_path, bert_embedder_llm, texts):
    words = texts(12, seed=4)
    rows = [{"prompt": t} for t in words]
    config, first = interrupted_embed_job(tmp_path, bert_embedder_llm, rows)
    source, output = config.input, tmp_path / "out.jsonl"
    with pytest.raises(ResumeError, match="other settings"):
        run_job(JobConfig(input=str(source), output=str(output), model="tiny", task="classify", progress=False),
                llm=bert_embedder_llm)
    second = run_job(config, llm=bert_embedder_llm)
    assert second.complete and second.resumed_rows == first.rows_done
    records = by_row(read_jsonl(output))
    assert sorted(records) == list(range(len(rows)))
    expected = bert_embedder_llm.embed(words, use_tqdm=False)
    for i, out in enumerate(expected):
        assert records[i]["embedding"] == pytest.approx(out.outputs.embedding, abs=1e-6)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "embed", "--temperature", "0.5"], "--temperature do(es) not apply to --task embed"),
        (["--task", "embed", "--chat"], "--chat do(es) not apply to --task embed"),
        (["--dimensions", "8"], "--dimensions do(es) not apply to --task generate"),
        (["--task", "classify"], "--task classify needs --model"),
        (["--task", "score", "--text-field", "t"], "reads the pair from each row's text_1 and text_2"),
        (["--task", "embed", "--dimensions", "0"], "PoolingParams.dimensions=0 is invalid"),
        (["--task", "embed", "--normalize", "--no-use-activation"], "normalize=True and use_activation=False disagree"),
        (["--task", "classify", "--model", "m", "--normalize"], "['normalize'] do not apply to task 'classify'"),
    ],
)
def test_cli_usage_errors(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    assert main(["run", "in.jsonl", "-o", "o.jsonl", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_classify_job(tmp_path, tiny_bert_classifier_dir, bert_classifier_llm, capsys, texts):
    words = texts(4, seed=5)
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in words])
    code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--task", "classify",
                 "--model", str(tiny_bert_classifier_dir), "--dtype", "float32", "--device", "cpu", "--no-progress",
                 "--no-use-activation"])
    assert code == 0, capsys.readouterr().err
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    expected = bert_classifier_llm.classify(words, PoolingParams(use_activation=False), use_tqdm=False)
    for i, out in enumerate(expected):
        assert records[i]["probs"] == pytest.approx(out.outputs.probs, abs=1e-6)  # raw logits, as asked
    # Written as the embeddings are: each float32's shortest decimal (at most 9 digits), not float64's 17.
    written = [v for probs in re.findall(r'"probs":\[([^\]]*)\]', (tmp_path / "out.jsonl").read_text()) for v in probs.split(",")]
    assert len(written) == 3 * len(words)
    assert all(len(v.lstrip("-").split("e")[0].replace(".", "").lstrip("0")) <= 9 for v in written), written


def openai_line(custom_id, body, url="/v1/embeddings"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_embedding_lines_match_llm_embed_and_bad_lines_fail_alone(tmp_path, bert_embedder_llm, texts):
    import base64
    import struct

    words = texts(5, seed=6)
    ids = bert_embedder_llm.get_tokenizer()(words[4])["input_ids"]
    lines = [
        openai_line("one", {"model": "tiny", "input": words[0], "priority": 3}),
        openai_line("normed", {"input": words[0], "use_activation": True}),
        openai_line("many", {"input": words[1:4], "encoding_format": "base64", "user": "u"}),
        openai_line("ids", {"input": [ids, ids[:3]]}),
        openai_line("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        openai_line("empty", {"input": []}),
        openai_line("mixed", {"input": [words[0], ids]}),
        openai_line("format", {"input": words[0], "encoding_format": "bytes"}),
        openai_line("format0", {"input": words[0], "encoding_format": ""}),  # was read as "float"
        openai_line("field", {"input": words[0], "temperature": 0.5}),
        openai_line("long", {"input": " ".join(["cat"] * 60)}),  # over max_model_len=48: the engine refuses it
        openai_line("cut", {"input": " ".join(["cat"] * 60), "truncate_prompt_tokens": 16}),
    ]
    summary = job(tmp_path, bert_embedder_llm, lines, "embed")
    assert summary.rows_done == len(lines) and summary.failed == 7
    out = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(out) == sorted(line["custom_id"] for line in lines)

    def vectors(custom_id):
        response = out[custom_id]["response"]
        assert out[custom_id]["error"] is None and response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("embd-")
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert {d["object"] for d in body["data"]} == {"embedding"}
        return [d["embedding"] for d in body["data"]], body["usage"]

    def expected(prompts):
        return [o.outputs.embedding for o in bert_embedder_llm.embed(prompts, use_tqdm=False)]

    (one,), usage = vectors("one")
    assert one == pytest.approx(expected([words[0]])[0], rel=1e-5, abs=1e-6)
    assert usage["prompt_tokens"] == usage["total_tokens"] == len(bert_embedder_llm.get_tokenizer()(words[0])["input_ids"])
    (normed,), _ = vectors("normed")
    want = bert_embedder_llm.embed(words[0], PoolingParams(normalize=True), use_tqdm=False)[0].outputs.embedding
    assert normed == pytest.approx(want, abs=1e-6) and sum(x * x for x in normed) == pytest.approx(1.0, abs=1e-5)
    packed, _ = vectors("many")
    decoded = [list(struct.unpack(f"<{len(base64.b64decode(v)) // 4}f", base64.b64decode(v))) for v in packed]
    for got, want in zip(decoded, expected(words[1:4]), strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)  # float32 bytes of the same vectors
    (full, short), usage = vectors("ids")
    want_full, want_short = expected([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:3]}])
    assert full == pytest.approx(want_full, rel=1e-5, abs=1e-6) and short == pytest.approx(want_short, rel=1e-5, abs=1e-6)
    assert usage["prompt_tokens"] == len(ids) + 3
    (cut,), usage = vectors("cut")
    assert usage["prompt_tokens"] == 16
    # A line another task answers is not a request of this job (OpenAI's error-file shape); a bad body is a 400
    assert out["chat"]["response"] is None
    assert "is answered under --task generate, and this job runs --task embed" in out["chat"]["error"]["message"]
    for custom_id, message in (("empty", "body.input must be"), ("mixed", "not mixed"), ("format", "encoding_format='bytes'"),
                               ("format0", "encoding_format='' is not supported"), ("field", "['temperature']")):
        assert out[custom_id]["response"]["status_code"] == 400 and message in out[custom_id]["response"]["body"]["error"]["message"]
    refused = out["long"]["response"]
    assert refused["status_code"] == 400 and "max_model_len=48" in refused["body"]["error"]["message"]


def test_openai_embedding_lines_in_a_generation_job_and_other_tasks(tmp_path, bert_embedder_llm):
    line = openai_line("e", {"input": "a cat"})
    with pytest.raises(ValueError, match="--task classify reads rows .* --task embed for /v1/embeddings lines"):
        job(tmp_path, bert_embedder_llm, [line], "classify")
    with pytest.raises(ValueError, match="give a .jsonl output"):
        job(tmp_path, bert_embedder_llm, [line], "embed", output="out.parquet")
    from tokenmill.batch.openai_batch import build_openai_request
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.requests import RowError

    with pytest.raises(RowError, match="'/v1/embeddings' is answered under --task embed, and this job runs --task generate"):
        build_openai_request(RawRow(index=0, record=line))


def test_interrupted_openai_embedding_job_resumes_with_every_line_once(tmp_path, bert_embedder_llm, texts):
    words = texts(10, seed=8)
    lines = [openai_line(f"c{i}", {"input": [w, w.upper()]}) for i, w in enumerate(words)]
    config, first = interrupted_embed_job(tmp_path, bert_embedder_llm, lines)
    output = tmp_path / "out.jsonl"
    second = run_job(config, llm=bert_embedder_llm)
    assert second.complete and second.resumed_rows == first.rows_done and second.failed == 0
    out = read_jsonl(output)
    assert sorted(line["custom_id"] for line in out) == sorted(f"c{i}" for i in range(len(words)))
    for line in out:
        word = words[int(line["custom_id"][1:])]
        got = [d["embedding"] for d in line["response"]["body"]["data"]]
        want = [o.outputs.embedding for o in bert_embedder_llm.embed([word, word.upper()], use_tqdm=False)]
        for vector, expected_vector in zip(got, want, strict=True):
            assert vector == pytest.approx(expected_vector, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("model", ["cross_encoder_llm", "bert_embedder_llm"])
def test_openai_score_and_rerank_lines_match_llm_score(tmp_path, request, model, texts):
    llm = request.getfixturevalue(model)
    queries, docs = texts(3, seed=11), texts(4, seed=12)
    lines = [
        openai_line("one-to-n", {"queries": queries[0], "documents": docs, "model": "tiny"}, url="/v1/score"),
        openai_line("pairwise", {"text_1": queries, "text_2": docs[:3]}, url="/score"),
        openai_line("items", {"queries": [queries[1]], "items": docs[1]}, url="/v1/score"),
        openai_line("rerank", {"query": queries[2], "documents": docs, "top_n": 2}, url="/v1/rerank"),
        openai_line("rerank-all", {"query": queries[2], "documents": docs}, url="/rerank"),
        openai_line("lengths", {"data_1": queries[:2], "data_2": docs}, url="/v1/score"),
        openai_line("no-docs", {"query": queries[0], "documents": []}, url="/v1/rerank"),
        openai_line("two-queries", {"query": queries[:2], "documents": docs}, url="/v1/rerank"),
        openai_line("top", {"query": queries[0], "documents": docs, "top_n": -1}, url="/v1/rerank"),
        openai_line("top-false", {"query": queries[0], "documents": docs, "top_n": False}, url="/v1/rerank"),  # was read as 0
        openai_line("field", {"queries": queries[0], "documents": docs, "instruction": "x"}, url="/v1/score"),
        openai_line("half", {"text_1": queries[0]}, url="/v1/score"),
        openai_line("cut", {"queries": queries[0], "documents": docs, "max_tokens_per_doc": 2}, url="/v1/score"),
        openai_line("embed", {"input": "a cat"}),
    ]
    summary = job(tmp_path, llm, lines, "score")
    assert summary.rows_done == len(lines) and summary.failed == 8
    out = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}

    def body(custom_id):
        assert out[custom_id]["error"] is None and out[custom_id]["response"]["status_code"] == 200
        return out[custom_id]["response"]["body"]

    def scores(first, second):
        return [o.outputs.score for o in llm.score(first, second, use_tqdm=False)]

    for custom_id, (first, second) in {"one-to-n": (queries[0], docs), "pairwise": (queries, docs[:3]),
                                       "items": ([queries[1]], [docs[1]])}.items():
        got = body(custom_id)
        assert got["object"] == "list" and got["model"] == "tiny" and got["id"].startswith("score-")
        assert [d["index"] for d in got["data"]] == list(range(len(got["data"])))
        assert [d["score"] for d in got["data"]] == pytest.approx(scores(first, second), abs=1e-6)
    cut = llm.score(queries[0], docs, pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 2}), use_tqdm=False)
    assert [d["score"] for d in body("cut")["data"]] == pytest.approx([o.outputs.score for o in cut], abs=1e-6)
    assert [d["score"] for d in body("cut")["data"]] != pytest.approx(scores(queries[0], docs), abs=1e-6)
    want = scores(queries[2], docs)
    best = sorted(range(len(docs)), key=lambda j: -want[j])
    for custom_id, keep in (("rerank", 2), ("rerank-all", len(docs))):
        got = body(custom_id)
        assert [r["index"] for r in got["results"]] == best[:keep] and got["id"].startswith("rerank-")
        for result in got["results"]:
            assert result["document"] == {"text": docs[result["index"]]}
            assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-6)
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > len(docs)
    for custom_id, message in (("lengths", "has 2 texts and body.data_2 4"), ("no-docs", "body.documents must be a non-empty"),
                               ("two-queries", "body.query must be one text, got 2"), ("top", "body.top_n=-1 is invalid"),
                               ("top-false", "body.top_n=False is invalid"),
                               ("field", "['instruction'] are not supported"), ("half", "body.text_2 must be a non-empty")):
        assert out[custom_id]["response"]["status_code"] == 400 and message in out[custom_id]["response"]["body"]["error"]["message"]
    assert out["embed"]["response"] is None and "answered under --task embed" in out["embed"]["error"]["message"]


def test_openai_pooling_body_field_typo_says_what_was_meant():
    """A misspelt field of an embeddings line names the field it is close to, as a chat line's does."""
    from tokenmill.batch.openai_pooling import build_openai_embedding
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.requests import RowError

    line = openai_line("e", {"input": "a cat", "dimension": 8})
    with pytest.raises(RowError, match=r"\['dimension'\] are not supported for /v1/embeddings \(did you mean 'dimensions'\?\)"):
        build_openai_embedding(RawRow(index=0, record=line))
