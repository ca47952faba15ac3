"""`tokenmill run`: a row whose finished output cannot be turned into output records (a bug that a
strange output triggers, injected here) is written as a failed row naming its line and the error;
every other row finishes, none is blamed or run again, and a rerun neither loses nor repeats rows."""

from __future__ import annotations

import pytest

import tokenmill.batch.loop as loop_module
from tokenmill import SamplingParams
from tokenmill.batch.job import JobConfig, run_job

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import GREEDY, by_row, engine_left_clean, llm  # noqa: F401 (fixtures)

TEXTS = ["the cat sat on a warm mat", "wind blew over its fur", "the sun went down", "a mat while the cat",
         "its fur and the sun", "over the warm wind"]
BROKEN_ROW = 2  # on line 3 of the input


def job(tmp_path, llm, input_path, fmt="jsonl", should_stop=None):
    config = JobConfig(input=str(input_path), output=str(tmp_path / f"out.{fmt}"), model="tiny", sampling=dict(GREEDY),
                       progress=False)
    return run_job(config, llm=llm, should_stop=should_stop)


def break_one_row(monkeypatch, stage: str) -> None:
    """Make turning row BROKEN_ROW's output into records raise: while its finished output becomes a
    result (the engine step), or while the result becomes output records (the commit)."""
    if stage == "result":
        real_result = loop_module.result_from_output

        def result(index, *args, **kwargs):
            if index == BROKEN_ROW:
                raise ValueError("no result for this output")
            return real_result(index, *args, **kwargs)

        monkeypatch.setattr(loop_module, "result_from_output", result)
    else:
        real_records = loop_module.generic_records

        def records(result, *args, **kwargs):
            if result.index == BROKEN_ROW and result.error is None:
                raise ValueError("no record for this output")
            return real_records(result, *args, **kwargs)

        monkeypatch.setattr(loop_module, "generic_records", records)


@pytest.mark.parametrize("stage", ["result", "records"])
def test_a_row_whose_output_cannot_become_records_fails_alone(tmp_path, llm, monkeypatch, stage):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    break_one_row(monkeypatch, stage)
    summary = job(tmp_path, llm, path)
    monkeypatch.undo()
    assert summary.exit_code == 3 and summary.rows_done == len(TEXTS) and summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    good = [i for i in range(len(TEXTS)) if i != BROKEN_ROW]
    assert sorted(records) == sorted([(i, 0) for i in good] + [(BROKEN_ROW, None)])
    error = records[(BROKEN_ROW, None)]["error"]
    assert error.startswith("line 3: ") and "could not be written" in error and "ValueError: no re" in error
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
    break_one_row(monkeypatch, "records")
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
    real_record = loop_module.openai_record

    def record(result, *args, **kwargs):
        if result.index == BROKEN_ROW and result.error is None:
            raise KeyError("choices")
        return real_record(result, *args, **kwargs)

    monkeypatch.setattr(loop_module, "openai_record", record)
    summary = job(tmp_path, llm, path)
    monkeypatch.undo()
    assert summary.exit_code == 3 and summary.rows_done == 4 and summary.failed == 1
    out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(out) == ["c0", "c1", "c2", "c3"]
    assert [out[f"c{i}"]["response"]["status_code"] for i in range(4)] == [200, 200, 400, 200]
    assert "KeyError: 'choices'" in out["c2"]["response"]["body"]["error"]["message"]
