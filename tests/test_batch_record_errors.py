"""`tokenmill run`: a row whose finished output cannot be turned into output records (a bug that a
strange output triggers, injected here) is written as a failed row naming its line and the error;
every other row finishes, none is blamed or run again, and a rerun neither loses nor repeats rows."""

from __future__ import annotations

import pytest

import tokenmill.batch.loop as loop_module
from tokenmill import SamplingParams
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.pooling import PoolingRows

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import GREEDY, by_row, engine_left_clean, llm  # noqa: F401 (fixtures)

TEXTS = ["the cat sat on a warm mat", "wind blew over its fur", "the sun went down", "a mat while the cat",
         "its fur and the sun", "over the warm wind"]
BROKEN_ROW = 2  # on line 3 of the input


def job(tmp_path, llm, input_path, should_stop=None, **overrides):
    options = dict(input=str(input_path), output=str(tmp_path / "out.jsonl"), model="tiny", sampling=dict(GREEDY),
                   progress=False)
    config = JobConfig(**{**options, **overrides})
    return run_job(config, llm=llm, should_stop=should_stop)


def break_one_row(monkeypatch, builder: str, error: Exception, owner: object = loop_module) -> None:
    """Make ``builder`` (a function of the loop's, or a method of ``owner``) raise for row BROKEN_ROW:
    result_from_output or PoolingRows.result, as its finished output becomes a result (the engine
    step), or a record builder, as the result becomes output records (the commit; its error row,
    once made, is built as usual)."""
    real = getattr(owner, builder)

    def broken(*args, **kwargs):
        first = args[1] if owner is not loop_module else args[0]  # the row's index, its result or its request
        index, failed = (first, False) if isinstance(first, int) else (first.index, getattr(first, "failed", False))
        if index == BROKEN_ROW and not failed:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, builder, broken)


@pytest.mark.parametrize("builder", ["result_from_output", "generic_records"])
def test_a_row_whose_output_cannot_become_records_fails_alone(tmp_path, llm, monkeypatch, builder):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    break_one_row(monkeypatch, builder, ValueError("no record for this output"))
    summary = job(tmp_path, llm, path)
    monkeypatch.undo()
    assert summary.exit_code == 3 and summary.rows_done == len(TEXTS) and summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    good = [i for i in range(len(TEXTS)) if i != BROKEN_ROW]
    assert sorted(records) == sorted([(i, 0) for i in good] + [(BROKEN_ROW, None)])
    error = records[(BROKEN_ROW, None)]["error"]
    assert error.startswith("line 3: ") and "could not be written: ValueError: no record for this output" in error
    assert summary.errors == [error]
    outs = llm.generate([TEXTS[i] for i in good], SamplingParams(**GREEDY), use_tqdm=False)
    assert [records[(i, 0)]["text"] for i in good] == [o.outputs[0].text for o in outs]
    again = job(tmp_path, llm, path)
    assert again.already_complete and again.rows_done == len(TEXTS) and again.failed == 1


def test_a_rerun_after_a_stop_keeps_the_failed_row_once(tmp_path, llm, monkeypatch):
    """Stopped once the broken row is committed, then resumed without the fault: the row stays the
    failed row the journal recorded, and every row is in the output exactly once."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS * 3])
    output = tmp_path / "out.jsonl"
    break_one_row(monkeypatch, "generic_records", ValueError("no record for this output"))
    first = job(tmp_path, llm, path, should_stop=lambda: output.exists() and f'"row":{BROKEN_ROW},' in output.read_text())
    monkeypatch.undo()
    assert first.interrupted and first.failed == 1 and first.rows_done < len(TEXTS) * 3
    second = job(tmp_path, llm, path)
    assert second.complete and second.resumed_rows == first.rows_done and second.failed == 1
    records = by_row(read_jsonl(output))
    assert sorted(row for row, _ in records) == list(range(len(TEXTS) * 3))
    assert "no record for this output" in records[(BROKEN_ROW, None)]["error"]


def test_an_openai_row_whose_output_cannot_be_written_is_a_failed_line(tmp_path, llm, monkeypatch):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": t, "max_tokens": 3, "temperature": 0.0}} for i, t in enumerate(TEXTS[:4])]
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    break_one_row(monkeypatch, "openai_record", KeyError("choices"))
    summary = job(tmp_path, llm, path)
    monkeypatch.undo()
    assert summary.exit_code == 3 and summary.rows_done == 4 and summary.failed == 1
    out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(out) == ["c0", "c1", "c2", "c3"]
    # The engine's side failed, not the request: OpenAI's 500 (vLLM's run-batch: 500 InternalServerError)
    assert [out[f"c{i}"]["response"]["status_code"] for i in range(4)] == [200, 200, 500, 200]
    error = out["c2"]["response"]["body"]["error"]
    assert "KeyError: 'choices'" in error["message"] and error["type"] == "server_error"


@pytest.mark.parametrize("builder, owner", [("result", PoolingRows), ("pooling_records", loop_module)])
def test_a_pooling_row_whose_output_cannot_be_written_fails_alone(tmp_path, bert_embedder_llm, random_sentences,
                                                                  monkeypatch, builder, owner):
    texts = random_sentences(5, 0, high=15)
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in texts])
    break_one_row(monkeypatch, builder, ValueError("no embedding record"), owner)
    summary = job(tmp_path, bert_embedder_llm, path, task="embed", sampling={})
    monkeypatch.undo()
    assert summary.exit_code == 3 and summary.rows_done == len(texts) and summary.failed == 1
    records = {r["row"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(records) == list(range(len(texts)))
    assert records[BROKEN_ROW]["embedding"] is None
    assert records[BROKEN_ROW]["error"] == ("line 3: the row finished but its output could not be written: "
                                            "ValueError: no embedding record")
    assert all(records[i]["embedding"] and records[i]["error"] is None for i in records if i != BROKEN_ROW)
