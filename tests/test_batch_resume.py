"""`tokenmill run` killed with SIGKILL (and SIGTERM) at several points, then resumed: every row exactly
once, finished rows kept, greedy text identical to an uninterrupted run; and resumed from damaged
state (a lost journal rebuilt from the output, a damaged state file named)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.journal import ResumeError

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import by_row, llm  # noqa: F401 (fixtures)
from test_batch_robust import TEXTS, job

REPO = Path(__file__).resolve().parents[1]
ROWS = 120  # ~100 rows/s on the CPU: enough left after the SIGTERM's kill point that it lands before the end
WORDS = "the cat sat on a warm mat while wind blew over its fur".split()


def engine_flags(model: Path) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--device", "cpu", "--max-model-len", "128",
            "--kv-cache-memory-bytes", str(32 * 2**20), "--max-num-seqs", "1"]


SAMPLING = ["--max-tokens", "6", "--temperature", "0", "--ignore-eos"]


def start(input_path: Path, output: Path, model: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "tokenmill.cli", "run", str(input_path), "-o", str(output),
           "--fsync-interval", "0", "--progress-interval", "0.5", *SAMPLING, *engine_flags(model)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines_in(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_until(proc: subprocess.Popen, ready, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the job ended before the kill point: {proc.communicate()}"
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.002)


@pytest.mark.slow  # six CLI processes, each importing torch and loading a model
def test_kill_and_resume_exactly_once(tmp_path, tiny_llama_dir):
    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 9))} for i in range(ROWS)]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "out.jsonl"
    state = Path(str(output) + ".tokenmill") / "state.json"

    # The uninterrupted run, in this process, with the same settings.
    whole = run_job(JobConfig(
        input=str(input_path), output=str(tmp_path / "whole.jsonl"), model=str(tiny_llama_dir),
        sampling={"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}, progress=False,
        engine={"dtype": "float32", "device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 32 * 2**20,
                "max_num_seqs": 1},
    ))
    assert whole.exit_code == 0
    expected = {json.loads(line)["id"]: json.loads(line)["text"] for line in open(tmp_path / "whole.jsonl")}

    # Kill points: before any result (model loading), after a few rows, mid-file, and a SIGTERM. Each
    # counts the lines its own attempt wrote: a kill lands some rows after its point (~100 rows/s here,
    # so a 0.1 s delay of this process is 10), and a point counted from the start of the file could be
    # passed already when the next attempt starts: a SIGTERM sent then reaches an interpreter that has
    # no handler yet (exit -15), or one that has not repaired the torn line.
    kill_points = [(None, signal.SIGKILL), (4, signal.SIGKILL), (12, signal.SIGKILL), (10, signal.SIGTERM)]
    resumed_counts = []
    for new_lines, sig in kill_points:
        proc = start(input_path, output, tiny_llama_dir)
        if new_lines is None:
            wait_until(proc, state.exists)
        else:
            at_start = lines_in(output)
            wait_until(proc, lambda: lines_in(output) >= at_start + new_lines)
        seen = lines_in(output)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
            with open(output, "ab") as f:
                f.write(b'{"row": 59, "id": "r59", "te')  # as if the kill landed mid-write
        else:
            assert proc.returncode == 130, err  # a tidy stop: summary printed, rerun continues
            assert "interrupted" in err and "rerun the same command" in err
            assert "repaired: cut" in err  # the torn line left after the previous SIGKILL
        resumed_counts.append(lines_in(output))

    proc = start(input_path, output, tiny_llama_dir)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"{ROWS}/{ROWS} rows, 0 failed" in err
    resumed = int(err.split("resumed: ")[1].split(" rows")[0])
    assert resumed >= seen  # every line seen before SIGTERM was committed
    assert "repaired:" not in err  # SIGTERM stopped cleanly, nothing torn to cut

    records = [json.loads(line) for line in open(output)]
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids)) == ROWS
    assert {r["id"]: r["text"] for r in records} == expected
    assert resumed_counts == sorted(resumed_counts)

    # Once complete, the same command does nothing (and loads no model).
    proc = start(input_path, output, tiny_llama_dir)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "already complete" in err
    assert lines_in(output) == ROWS


# --- resumed from damaged state: a lost journal, a damaged state file ----------------------------


class StopAfter:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self):
        self.steps -= 1
        return self.steps < 0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "openai"])
def test_a_deleted_journal_is_rebuilt_from_the_output(tmp_path, llm, fmt, monkeypatch):
    """The journal rebuilt from the output; for an OpenAI output that builds an id -> row table of the
    whole input (~200 bytes a line), which nothing needs once the journal is open: the resumed run
    must not hold it."""
    import gc
    import weakref

    from tokenmill.batch.openai_batch import OpenAIRecordReader

    readers: weakref.WeakSet[OpenAIRecordReader] = weakref.WeakSet()  # every reader made, while it lives
    make_reader = OpenAIRecordReader.__init__

    def noted(self: OpenAIRecordReader, *args, **kwargs) -> None:
        readers.add(self)
        make_reader(self, *args, **kwargs)

    monkeypatch.setattr(OpenAIRecordReader, "__init__", noted)

    if fmt == "openai":
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": t}}
                 for i, t in enumerate(TEXTS)]
        path = write_jsonl(tmp_path / "in.jsonl", lines)
    else:
        path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    output = "out.parquet" if fmt == "parquet" else "out.jsonl"
    first = job(tmp_path, llm, path, output=output, max_inflight=2, should_stop=StopAfter(8))
    assert first.interrupted and 0 < first.rows_done < len(TEXTS)
    sidecar = tmp_path / f"{output}.tokenmill"
    os.remove(sidecar / "journal.jsonl")
    tables = []

    def look() -> bool:  # polled once per step of the resumed run
        if any(r._rows_by_id is not None for r in list(readers)):
            gc.collect()  # (slow in a big process: only when needed) a table counts in a reader still alive
            tables.extend(len(r._rows_by_id) for r in list(readers) if r._rows_by_id is not None)
        return False

    second = job(tmp_path, llm, path, output=output, should_stop=look)
    assert second.exit_code == 0 and second.resumed_rows == first.rows_done
    assert tables == []
    if fmt == "parquet":
        records = pq.read_table(tmp_path / output).to_pylist()
    else:
        records = read_jsonl(tmp_path / output)
    if fmt == "openai":
        assert second.rebuilt_rows
        assert sorted(r["custom_id"] for r in records) == sorted(f"c{i}" for i in range(len(TEXTS)))
    else:
        assert sorted(by_row(records)) == [(i, 0) for i in range(len(TEXTS))]


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_damaged_state_file_is_named_with_what_to_do(tmp_path, llm, damage):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    job(tmp_path, llm, path, max_inflight=2, should_stop=StopAfter(6))
    state = tmp_path / "out.jsonl.tokenmill" / "state.json"
    if damage == "garbage":
        state.write_text("{not json")
    else:
        state.unlink()
    with pytest.raises(ResumeError, match=r"state\.json.*--overwrite"):
        job(tmp_path, llm, path)
    assert job(tmp_path, llm, path, overwrite=True).exit_code == 0


def test_a_second_ctrl_c_during_the_final_fsync_keeps_the_summary(tmp_path, llm, monkeypatch):
    """The tidy stop's last fsync can take a while; a second Ctrl-C there (measured: the usual place
    for a quick double press) used to end the command without its summary."""
    from tokenmill.batch import journal as journal_module

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])

    def second_ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(journal_module.Journal, "sync", second_ctrl_c)
    summary = job(tmp_path, llm, path, max_inflight=2, should_stop=StopAfter(6))
    assert summary.interrupted and summary.exit_code == 130 and 0 < summary.rows_done < len(TEXTS)
    assert len(read_jsonl(tmp_path / "out.jsonl")) == summary.rows_done


def test_a_second_ctrl_c_during_a_commits_write_keeps_the_summary_and_the_rows(tmp_path, llm, monkeypatch):
    """The second Ctrl-C's KeyboardInterrupt is raised once the write system call it arrived during has
    returned, before the job counted the bytes as written: the stop then took the lines it had just
    written for another process's doing ("another process changed its length", exit code 2, no
    summary). Found by the crash-resume chaos harness. The stop keeps its summary and exit code 130,
    and the rerun writes every row once."""
    from tokenmill.batch import writers

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    output = tmp_path / "out.jsonl"
    real_init = writers.AppendFile.__init__

    class InterruptedAfterWriting:
        """The data file's descriptor, where the third write is followed by the second Ctrl-C."""

        def __init__(self, real):
            self.real, self.writes = real, 0

        def write(self, data):
            written = self.real.write(data)
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return written

        def __getattr__(self, name):
            return getattr(self.real, name)

    def init(self, file_path, expected_size):
        real_init(self, file_path, expected_size)
        if file_path == str(output):
            self._file = InterruptedAfterWriting(self._file)

    monkeypatch.setattr(writers.AppendFile, "__init__", init)
    summary = job(tmp_path, llm, path, max_inflight=2)
    assert summary.interrupted and summary.exit_code == 130 and 0 < summary.rows_done < len(TEXTS)
    monkeypatch.undo()
    again = job(tmp_path, llm, path)
    assert again.exit_code == 0 and again.rows_done == len(TEXTS)
    assert sorted(r["row"] for r in read_jsonl(output)) == list(range(len(TEXTS)))


def test_a_second_ctrl_c_while_the_parquet_output_is_written_keeps_the_summary(tmp_path, llm, monkeypatch):
    """A second Ctrl-C while the finished job wrote its Parquet output (minutes for a large one) ended
    the command without its summary. It is a stop like any other: the summary says interrupted, exit
    code 130, and the rerun writes the output from the staging file, every row once."""
    from tokenmill.batch import job as job_module

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    real = job_module.jsonl_to_parquet

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job_module, "jsonl_to_parquet", interrupted)
    summary = job(tmp_path, llm, path, output="out.parquet")
    assert summary.interrupted and summary.exit_code == 130 and summary.rows_done == len(TEXTS)
    assert not (tmp_path / "out.parquet").exists()
    monkeypatch.setattr(job_module, "jsonl_to_parquet", real)
    again = job(tmp_path, llm, path, output="out.parquet")
    assert again.exit_code == 0 and again.resumed_rows == len(TEXTS)
    assert sorted(pq.read_table(tmp_path / "out.parquet").column("row").to_pylist()) == list(range(len(TEXTS)))
