"""`tokenmill run` against rows, files and paths meant to knock it over (issue 20), on a tiny random Llama:
poison rows fail alone and never stop a resume, broken quoting and Arrow's nulls are read as meant,
bad types and impossible bounds are error rows, bad outputs are clear errors (a lost journal rebuilt
from the output: test_batch_resume.py)."""

from __future__ import annotations

import errno
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.requests import PromptSettings

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import GREEDY, MAX_TOKENS, by_row, engine_left_clean, llm  # noqa: F401 (fixtures)

TEXTS = ["the cat sat on a warm mat", "wind blew over its fur", "the sun went down", "a mat while the cat",
         "its fur and the sun", "over the warm wind", "the cat the mat", "down went the sun"]


def job(tmp_path, llm, input_path, output="out.jsonl", should_stop=None, **overrides):
    options = dict(input=str(input_path), output=str(tmp_path / output), model="tiny", sampling=dict(GREEDY),
                   progress=False)
    options.update(overrides)
    return run_job(JobConfig(**options), llm=llm, should_stop=should_stop)


def reference(llm, texts, **sampling):
    outs = llm.generate(texts, SamplingParams(**{**GREEDY, **sampling}), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


# --- 1. rows that used to crash the engine step -------------------------------------------------


def test_poison_logprobs_rows_fail_alone_and_a_rerun_does_not_crash(tmp_path, llm):
    rows = [{"prompt": TEXTS[0]}, {"prompt": TEXTS[1], "sampling_params": {"logprobs": 100000}},
            {"prompt": TEXTS[2]}, {"prompt": TEXTS[3], "sampling_params": {"prompt_logprobs": 100000}},
            {"prompt": TEXTS[4], "sampling_params": {"logprobs": 3}}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = job(tmp_path, llm, path)
    assert summary.exit_code == 3 and summary.rows_done == 5 and summary.failed == 2
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert "logprobs=100000" in records[(1, None)]["error"] and "20" in records[(1, None)]["error"]
    assert "prompt_logprobs=100000" in records[(3, None)]["error"]
    expected = reference(llm, [TEXTS[0], TEXTS[2], TEXTS[4]])
    assert [records[(i, 0)]["text"] for i in (0, 2, 4)] == expected
    assert records[(4, 0)]["cumulative_logprob"] is not None
    again = job(tmp_path, llm, path)
    assert again.already_complete and again.exit_code == 3


def test_openai_body_logprobs_past_the_limit_is_a_400(tmp_path, llm):
    lines = [{"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": TEXTS[0], "max_tokens": 3}},
             {"custom_id": "poison", "url": "/v1/completions", "body": {"prompt": TEXTS[1], "logprobs": 100000}}]
    path = write_jsonl(tmp_path / "batch.jsonl", [{"method": "POST", **line} for line in lines])
    summary = job(tmp_path, llm, path)
    assert summary.exit_code == 3 and summary.failed == 1
    out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert out["ok"]["response"]["status_code"] == 200
    assert out["poison"]["response"]["status_code"] == 400
    assert "logprobs=100000" in out["poison"]["response"]["body"]["error"]["message"]


def test_logprobs_past_max_logprobs_is_a_clear_error_in_generate(llm, tiny_llama_dir):
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=21 .*max_logprobs \(20\)"):
            llm.generate(["the cat"], SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
    everything = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64,
                     kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2, max_logprobs=-1)
    vocab = everything.llm_engine.config.vocab_size
    with pytest.raises(ValueError, match=rf"logprobs={vocab + 1} .*vocabulary \({vocab}\)"):
        everything.generate(["the cat"], SamplingParams(max_tokens=2, logprobs=vocab + 1), use_tqdm=False)
    out = everything.generate(["the cat"], SamplingParams(max_tokens=2, temperature=0.0, logprobs=vocab), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) == vocab  # every token, as vLLM's max_logprobs=-1 allows
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(tiny_llama_dir), max_logprobs=-2)


def test_job_wide_logprobs_above_the_engine_limit_are_a_usage_error(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS[:2]])
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} 21 is more than this engine allows \\(20"):
            job(tmp_path, llm, path, sampling={**GREEDY, name: 21})
        assert not (tmp_path / "out.jsonl").exists() or not read_jsonl(tmp_path / "out.jsonl")  # no row ran


def test_a_row_that_fails_inside_a_step_fails_alone(tmp_path, llm, monkeypatch):
    """Whatever slips past validation and raises inside an engine step fails only its own row."""
    executor = llm.llm_engine.executor
    execute = executor.execute_model

    def poisoned(plan, *args, **kwargs):
        if any(item.seq.request.request_id == "row-5" for item in plan.scheduled):
            raise RuntimeError("selected index k out of range")
        return execute(plan, *args, **kwargs)

    monkeypatch.setattr(executor, "execute_model", poisoned)
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    summary = job(tmp_path, llm, path)
    monkeypatch.undo()
    assert summary.exit_code == 3 and summary.rows_done == len(TEXTS) and summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert "selected index k out of range" in records[(5, None)]["error"]
    good = [i for i in range(len(TEXTS)) if i != 5]
    assert [records[(i, 0)]["text"] for i in good] == reference(llm, [TEXTS[i] for i in good])


def test_the_last_row_failing_alone_is_blamed_only_after_rows_finished(tmp_path, llm, monkeypatch):
    """A row failing alone with no row after it is an error row when the engine finished rows
    before it; when it finished none, nothing says the row is at fault: the job stops, writing none."""
    from tokenmill.batch.job import EngineFailure

    executor = llm.llm_engine.executor
    execute = executor.execute_model
    poisoned_ids = {f"row-{len(TEXTS) - 1}"}

    def poisoned(plan, *args, **kwargs):
        if any(item.seq.request.request_id in poisoned_ids for item in plan.scheduled):
            raise RuntimeError("selected index k out of range")
        return execute(plan, *args, **kwargs)

    monkeypatch.setattr(executor, "execute_model", poisoned)
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS]))
    assert summary.exit_code == 3 and summary.rows_done == len(TEXTS) and summary.failed == 1
    assert "selected index k out of range" in by_row(read_jsonl(tmp_path / "out.jsonl"))[(len(TEXTS) - 1, None)]["error"]
    poisoned_ids = {"row-0"}
    with pytest.raises(EngineFailure, match="finished no row"):
        job(tmp_path, llm, write_jsonl(tmp_path / "one.jsonl", [{"prompt": TEXTS[0]}]), output="one_out.jsonl")
    monkeypatch.undo()
    assert not (tmp_path / "one_out.jsonl").exists() or read_jsonl(tmp_path / "one_out.jsonl") == []


def test_an_engine_that_fails_on_every_row_stops_the_job(tmp_path, llm, monkeypatch):
    """Row after row failing alone means the engine, not the rows: stop (finished rows kept) rather
    than write the whole file as error rows, and blame none of them: a row that fails alone becomes
    an error row only once another row has finished on the same engine."""
    from tokenmill.batch.job import EngineFailure

    def broken(plan, *args, **kwargs):
        raise RuntimeError("internal error")

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS * 3])
    monkeypatch.setattr(llm.llm_engine.executor, "execute_model", broken)
    with pytest.raises(EngineFailure, match="internal error"):
        job(tmp_path, llm, path)
    monkeypatch.undo()
    assert not (tmp_path / "out.jsonl").exists() or read_jsonl(tmp_path / "out.jsonl") == []


# --- 2-6. rows read as meant ------------------------------------------------------------------


def test_csv_with_an_unterminated_quote_loses_no_row(tmp_path, llm):
    lines = ["id,prompt"] + [f"{i},{t}" for i, t in enumerate(TEXTS)]
    lines[4] = '3,"the cat sat on a mat'  # the quote never closes: it would swallow every later line
    path = tmp_path / "in.csv"
    path.write_text("\n".join(lines) + "\n")
    summary = job(tmp_path, llm, path)
    assert summary.rows_total == len(TEXTS) == summary.rows_done and summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert "line 5" in records[(3, None)]["error"] and "quote" in records[(3, None)]["error"]
    good = [i for i in range(len(TEXTS)) if i != 3]
    assert [records[(i, 0)]["text"] for i in good] == reference(llm, [TEXTS[i] for i in good])


def test_parquet_struct_nulls_mean_not_set(tmp_path, llm):
    rows = [{"prompt": TEXTS[0], "sampling_params": {"max_tokens": 3, "temperature": None}},
            {"prompt": TEXTS[1], "sampling_params": {"max_tokens": None, "temperature": 0.0}}]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert pq.read_table(path).to_pylist()[1]["sampling_params"]["max_tokens"] is None  # Arrow's fill-in
    summary = job(tmp_path, llm, path)
    assert summary.exit_code == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert records[(0, 0)]["completion_tokens"] == 3 and records[(1, 0)]["completion_tokens"] == MAX_TOKENS


def test_a_delta_or_final_only_row_still_gets_its_whole_output(tmp_path, llm):
    rows = [{"prompt": TEXTS[0], "sampling_params": {"output_kind": 1}},
            {"prompt": TEXTS[1], "sampling_params": {"output_kind": 2}}]
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", rows))
    assert summary.exit_code == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert [records[(i, 0)]["text"] for i in (0, 1)] == reference(llm, TEXTS[:2])
    assert all(records[(i, 0)]["completion_tokens"] == MAX_TOKENS for i in (0, 1))


BAD_VALUES = [
    ('{"max_tokens": true}', "SamplingParams.max_tokens=True"),
    ('{"ignore_eos": "no"}', "SamplingParams.ignore_eos='no'"),
    ('{"temperature": Infinity}', "SamplingParams.temperature=inf"),
    ('{"top_p": NaN}', "SamplingParams.top_p=nan"),
    ('{"logprobs": "3"}', "SamplingParams.logprobs='3'"),  # (true is vLLM's 1)
    ('{"seed": 1.5}', "SamplingParams.seed=1.5"),
    ('{"max_tokens": 1e12}', "SamplingParams.max_tokens=1000000000000.0"),
    ('{"truncate_prompt_tokens": 500}', "SamplingParams.truncate_prompt_tokens=500 is invalid: must be -1 or at most max_model_len (128)"),
    ('{"n": 1000000, "temperature": 1.0}', "max_num_seqs (4)"),  # (sampled: n > 1 is refused under greedy)
    ('{"n": 2, "best_of": 1000, "temperature": 1.0}', "max_num_seqs (4)"),
    ('{"skip_special_tokens": 0}', "SamplingParams.skip_special_tokens=0"),
]


def test_bad_types_and_impossible_bounds_are_error_rows(tmp_path, llm):
    lines = [json.dumps({"prompt": TEXTS[0]})]
    lines += ['{"prompt": "%s", "sampling_params": %s}' % (TEXTS[1], value) for value, _ in BAD_VALUES]
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", lines))
    assert summary.rows_done == len(lines) and summary.failed == len(BAD_VALUES)
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert records[(0, 0)]["text"] == reference(llm, TEXTS[:1])[0]
    for row, (value, needle) in enumerate(BAD_VALUES, start=1):
        assert needle in records[(row, None)]["error"], (value, records[(row, None)]["error"])


def test_max_tokens_past_the_context_is_capped_as_generate_caps_it(tmp_path, llm):
    # LLM.generate (and vLLM's) accepts max_tokens above max_model_len and stops the sequence when it
    # fills the context; a job's rows, and its --max-tokens, are the same requests.
    rows = [{"prompt": TEXTS[0]}, {"prompt": TEXTS[1], "sampling_params": {"max_tokens": 1000000000000}}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = job(tmp_path, llm, path, sampling={**GREEDY, "max_tokens": 1000, "ignore_eos": True})
    assert summary.exit_code == 0 and summary.failed == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    expected = llm.generate(TEXTS[:2], SamplingParams(**{**GREEDY, "max_tokens": 1000, "ignore_eos": True}), use_tqdm=False)
    for row, out in enumerate(expected):
        assert records[(row, 0)]["text"] == out.outputs[0].text
        assert records[(row, 0)]["finish_reason"] == "length"
        assert records[(row, 0)]["prompt_tokens"] + records[(row, 0)]["completion_tokens"] == 128  # max_model_len


def test_an_openai_lines_max_tokens_past_the_context_stays_a_400(tmp_path, llm):
    # vLLM's server (and so its run-batch) refuses such a request rather than capping it.
    line = {"custom_id": "big", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": TEXTS[0], "max_tokens": 1000}}
    path = write_jsonl(tmp_path / "in.jsonl", [line])
    job(tmp_path, llm, path)
    response = read_jsonl(tmp_path / "out.jsonl")[0]["response"]
    assert response["status_code"] == 400 and "max_tokens=1000" in response["body"]["error"]["message"]
    with pytest.raises(ValueError, match=r"--max-tokens 1000 is more than this engine's max_model_len \(128\)"):
        job(tmp_path, llm, path, output="other.jsonl", sampling={**GREEDY, "max_tokens": 1000})
    assert not (tmp_path / "other.jsonl").exists() and not (tmp_path / "other.jsonl.tokenmill").exists()


def test_an_openai_line_whose_prompt_and_max_tokens_pass_the_context_is_a_400(tmp_path, llm):
    # vLLM's server refuses prompt tokens + max_tokens > max_model_len; the line that just fits runs.
    room = 128 - len(llm.get_tokenizer()(TEXTS[0])["input_ids"])
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": TEXTS[0], "max_tokens": asked, "temperature": 0, "ignore_eos": True}}
             for name, asked in (("over", room + 1), ("fits", room))]
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny", "messages": [{"role": "user", "content": TEXTS[0]}], "max_completion_tokens": 128}})
    job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", lines))
    out = {line["custom_id"]: line["response"] for line in read_jsonl(tmp_path / "out.jsonl")}
    assert out["over"]["status_code"] == 400
    assert f"max_tokens={room + 1} is too large" in out["over"]["body"]["error"]["message"]
    assert f"leaving {room}" in out["over"]["body"]["error"]["message"]
    assert out["fits"]["status_code"] == 200 and out["fits"]["body"]["usage"]["completion_tokens"] == room
    assert out["chat"]["status_code"] == 400 and "max_tokens=128 is too large" in out["chat"]["body"]["error"]["message"]


def test_job_wide_values_past_the_engine_are_refused_before_any_row(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS[:2]])
    # Every row would fail with it (vLLM refuses a cut longer than max_model_len).
    with pytest.raises(ValueError, match=r"--truncate-prompt-tokens 500 is more than this engine's max_model_len \(128\)"):
        job(tmp_path, llm, path, sampling={**GREEDY, "truncate_prompt_tokens": 500})
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").stat().st_size == 0


# --- 7. outputs that cannot be written ---------------------------------------------------------


def test_output_under_a_file_is_a_clear_error(tmp_path, llm):
    (tmp_path / "file").write_text("x")
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": TEXTS[0]}])
    with pytest.raises(ValueError, match=r"cannot write .*file/out\.jsonl"):
        job(tmp_path, llm, path, output="file/out.jsonl")


def test_disk_full_is_a_clear_error_and_a_rerun_finishes(tmp_path, llm, monkeypatch):
    from tokenmill.batch import writers

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    write = writers.AppendFile.write
    calls = []

    def full_after_two(self, data):
        calls.append(len(data))
        if len(calls) > 4:  # two commits (data + journal each), then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, data)

    monkeypatch.setattr(writers.AppendFile, "write", full_after_two)
    with pytest.raises(ValueError, match=r"out\.jsonl.*No space left on device.*rerun"):
        job(tmp_path, llm, path, max_inflight=2)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()  # the failed attempt dropped what it ran
    summary = job(tmp_path, llm, path)
    assert summary.exit_code == 0 and summary.resumed_rows > 0
    assert sorted(by_row(read_jsonl(tmp_path / "out.jsonl"))) == [(i, 0) for i in range(len(TEXTS))]


def test_directory_output_is_refused_even_with_overwrite(tmp_path, llm):
    folder = tmp_path / "out.jsonl"
    folder.mkdir()
    (folder / "precious.txt").write_text("keep me")
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": TEXTS[0]}])
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="is a directory"):
            job(tmp_path, llm, path, overwrite=overwrite)
    assert (folder / "precious.txt").read_text() == "keep me"


def test_symlinked_output_is_refused(tmp_path, llm):
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("somebody's data\n")
    (tmp_path / "out.jsonl").symlink_to(target)
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": TEXTS[0]}])
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="symbolic link"):
            job(tmp_path, llm, path, overwrite=overwrite)
    assert target.read_text() == "somebody's data\n" and (tmp_path / "out.jsonl").is_symlink()


def test_cli_output_errors_exit_2(tmp_path, capsys):
    from tokenmill.cli import main

    (tmp_path / "file").write_text("x")
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": TEXTS[0]}])
    code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "file" / "out.jsonl"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write" in err and "Traceback" not in err


# --- 13. glitches ------------------------------------------------------------------------------


def test_error_messages_name_the_row_once(tmp_path, llm):
    lines = ['{"prompt": "x", "sampling_params": {"temperature": -1}}', '{"prompt": "unterminated']
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", lines))
    assert summary.failed == 2
    report = summary.report()
    assert "row 0: row 0" not in report and "line 1: line 1" not in report and "at at" not in report
    assert "line 1: " in report and "line 2" in report


def test_the_summary_counts_the_failures_it_does_not_show(tmp_path, llm):
    lines = ['{"prompt": "unterminated'] * 8 + ['{"prompt": "x"}']
    summary = job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", lines))
    assert summary.failed == 8
    report = summary.report()
    assert sum("is not valid JSON" in line for line in report.splitlines()) == 5
    assert f"and 3 more (every failed row is in {tmp_path / 'out.jsonl'} with its 'error' field set)" in report


def test_an_empty_input_says_so(tmp_path, llm):
    path = tmp_path / "in.jsonl"
    path.write_text("\n\n")
    summary = job(tmp_path, llm, path)
    assert summary.rows_done == 0 and "no rows" in summary.report()


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_a_missing_column_fails_before_the_model_loads(tmp_path, fmt):
    rows = [{"title": "a"}, {"title": "b"}]
    path = tmp_path / f"in.{fmt}"
    if fmt == "csv":
        path.write_text("title\na\nb\n")
    elif fmt == "jsonl":  # no schema: a field none of the first rows has (a bad line among them is no row)
        path.write_text('{"title": "a"}\nnot json\n{"title": "b"}\n')
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    base = dict(input=str(path), output=str(tmp_path / "out.jsonl"), model="/nonexistent/model", progress=False)
    for prompt, needle in [(PromptSettings(text_field="body"), "'body'"),
                           (PromptSettings(prompt_template="About {title} and {body}"), "'body'"),
                           (PromptSettings(id_field="sku"), "'sku'"),
                           (PromptSettings(), "'prompt'")]:
        with pytest.raises(ValueError, match=needle) as info:
            run_job(JobConfig(prompt=prompt, **base))
        assert "title" in str(info.value)  # the columns there are


def test_a_read_only_output_folder_exits_2_with_advice(tmp_path, capsys, monkeypatch):
    """As a read-only folder answers (faked: root may write anywhere): EACCES for whatever the job
    creates in it. Exit 2, the file named, what to do, no traceback."""
    from tokenmill.cli import main

    folder = tmp_path / "readonly"
    folder.mkdir()
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": TEXTS[0]}])
    mkdir, open_ = os.mkdir, os.open

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(folder)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return (open_ if refuse.call == "open" else mkdir)(path, *args, **kwargs)

    for call, real in (("mkdir", mkdir), ("open", open_)):
        refuse.call = call
        monkeypatch.setattr(os, call, refuse)
        code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(folder / "out.jsonl"), "--no-progress"])
        monkeypatch.setattr(os, call, real)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert f"cannot write {folder / 'out.jsonl'}" in err and "folder you can write to" in err, err


# --- 8. what the session of 2026-12-06's audit found ----------------------------------------------


def test_an_input_linked_to_the_output_is_refused_even_with_overwrite(tmp_path, llm):
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": t} for t in TEXTS[:2]])
    os.symlink(data, tmp_path / "in.jsonl")
    with pytest.raises(ValueError, match=r"must not be the input file \(.*in\.jsonl is .*data\.jsonl\)"):
        job(tmp_path, llm, tmp_path / "in.jsonl", output="data.jsonl", overwrite=True)
    assert len(read_jsonl(data)) == 2
    # A name that merely starts with the output's is another file: it runs.
    backup = write_jsonl(tmp_path / "res.jsonl.bak", [{"prompt": TEXTS[0]}])
    assert job(tmp_path, llm, backup, output="res.jsonl", input_format="jsonl").complete


def test_rows_missing_at_the_end_are_not_marked_complete(tmp_path, llm, monkeypatch):
    """An input that shrank while the job ran (or a row the loop lost) is not a finished job: the
    rows done stay, the error says what happened, and a rerun on the restored input finishes."""
    from tokenmill.batch import job as job_module

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS[:4]])
    real_read_rows = job_module.read_rows
    monkeypatch.setattr(job_module, "read_rows", lambda p, fmt, size: (r for r in real_read_rows(p, fmt, size) if r.index < 2))
    with pytest.raises(ValueError, match=r"gave 2 rows where the scan before the run counted 4.*rerun"):
        job(tmp_path, llm, path)
    monkeypatch.setattr(job_module, "read_rows", real_read_rows)
    again = job(tmp_path, llm, path)
    assert again.complete and again.resumed_rows == 2 and again.rows_done == 4
    assert sorted(by_row(read_jsonl(tmp_path / "out.jsonl"))) == [(i, 0) for i in range(4)]


def test_a_lone_surrogate_id_does_not_stop_a_parquet_output(tmp_path, llm):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "the cat"}\n{"id": "b\\udc80", "prompt": "the sun"}\n')
    summary = job(tmp_path, llm, path, output="out.parquet")
    assert summary.complete and summary.rows_done == 2
    assert sorted(pq.read_table(tmp_path / "out.parquet").column("id").to_pylist()) == ["a", "b\\udc80"]


def test_a_closed_stderr_turns_the_progress_off_not_the_job(tmp_path, llm):
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            pass

        def isatty(self):
            return False

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS[:3]])
    options = dict(input=str(path), output=str(tmp_path / "out.jsonl"), model="tiny", sampling=dict(GREEDY),
                   log_interval=0)
    summary = run_job(JobConfig(**options), llm=llm, stderr=ClosedPipe())
    assert summary.complete and summary.rows_done == 3


def test_a_file_error_elsewhere_is_not_blamed_on_the_output():
    from tokenmill.batch.writers import describe_file_error

    message = describe_file_error(PermissionError(errno.EACCES, "Permission denied", "/models/x/config.json"),
                                  "in.jsonl", "out.jsonl")
    assert message.startswith("cannot use /models/x/config.json: Permission denied") and "check its permissions" in message
    message = describe_file_error(OSError(errno.ENOSPC, "No space left on device"), "in.jsonl", "out.jsonl")
    assert message.startswith("cannot write out.jsonl: No space left on device; free some space")


def test_a_conversation_error_names_the_line_a_person_finds(tmp_path, llm):
    """Errors found while a row's conversation is rendered say "line N", as its other errors do (the
    0-based row index was one less), and a null content is rendered empty, as vLLM does."""
    path = tmp_path / "in.jsonl"
    path.write_text("\n" + "\n".join(json.dumps(r) for r in [
        {"prompt": TEXTS[0]},
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
        {"messages": [{"role": "user", "content": None}]}]) + "\n")
    summary = job(tmp_path, llm, path, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert summary.failed == 1
    assert "line 3 messages[1].tool_calls[0].function.arguments must be JSON" in records[(1, None)]["error"]
    assert records[(2, 0)]["error"] is None
