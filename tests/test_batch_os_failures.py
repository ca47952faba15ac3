"""`tokenmill run` when the operating system fails it mid-run, on a tiny random Llama: a write, flush
or fsync of the output or the journal that fails (a full disk, an I/O error), an output truncated,
removed or replaced by another process, an input appended to or cut while it is read. Each stops
the job with a message naming the file, or leaves it unaffected; a rerun then loses no row and
writes none twice. (Signals: test_batch_cli.py; the lock: test_batch_journal.py.)"""

from __future__ import annotations

import errno
import json
import os

import pytest

from tokenmill.batch import journal as journal_module
from tokenmill.batch import writers

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import engine_left_clean, llm  # noqa: F401 (fixtures)
from test_batch_robust import TEXTS, job


def rows_of(path) -> list[tuple[int, int]]:
    """Every (row, sample) of an output, in file order, repeats kept: a row written twice shows."""
    return sorted((r["row"], r["sample_index"] or 0) for r in read_jsonl(path))


def after_commits(monkeypatch, count: int, action) -> list[int]:
    """Run ``action(journal)`` once, right after the job's ``count``-th commit."""
    real_commit, calls = journal_module.Journal.commit, []

    def commit(self, *args, **kwargs):
        real_commit(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == count:
            action(self)

    monkeypatch.setattr(journal_module.Journal, "commit", commit)
    return calls


# --- a write, flush or fsync that fails -----------------------------------------------------------


class FillingDisk:
    """An open file on a disk that fills up at its ``full_at``-th write: that write is short (half of
    it written), the next one fails with ENOSPC, as write(2) does."""

    def __init__(self, file, full_at: int):
        self.file, self.full_at, self.writes = file, full_at, 0

    def write(self, data):
        self.writes += 1
        if self.writes > self.full_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data[: len(data) // 2] if self.writes == self.full_at else data)

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("where", ["out.jsonl", "journal.jsonl", "fsync"])
def test_a_write_that_fails_midway_stops_the_job_and_a_rerun_finishes(tmp_path, llm, monkeypatch, where):
    """A full disk cuts a write short (part of a line written, then ENOSPC), in the output or in the
    journal; an fsync fails with EIO. The job stops with the file and the error named; the rerun
    cuts what was torn and writes every row exactly once."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    init, fsync, fsyncs = writers.AppendFile.__init__, os.fsync, []

    def on_a_filling_disk(self, file_path, expected_size):
        init(self, file_path, expected_size)
        if os.path.basename(file_path) == where:
            self._file = FillingDisk(self._file, full_at=3)  # two commits go through

    def fsync_fails(fd):
        fsyncs.append(fd)
        if len(fsyncs) == 6:  # state.json's two, then two commits' data and journal; then the third's data
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    if where == "fsync":
        monkeypatch.setattr(os, "fsync", fsync_fails)
    else:
        monkeypatch.setattr(writers.AppendFile, "__init__", on_a_filling_disk)
    with pytest.raises(ValueError) as info:
        job(tmp_path, llm, path, max_inflight=2, fsync_interval=0)
    message = str(info.value)
    assert ("Input/output error" if where == "fsync" else "No space left on device") in message, message
    assert f"cannot write {tmp_path / 'out.jsonl'}" in message and "rerun the same command" in message, message
    if where == "journal.jsonl":
        assert "out.jsonl.tokenmill/journal.jsonl" in message, message  # which of the job's files failed
    monkeypatch.undo()
    again = job(tmp_path, llm, path)
    assert again.exit_code == 0 and again.resumed_rows > 0 and again.rows_done == len(TEXTS)
    assert rows_of(tmp_path / "out.jsonl") == [(i, 0) for i in range(len(TEXTS))]


# --- the output changed by another process --------------------------------------------------------


def _truncate(journal):
    os.truncate(journal.output, 0)


def _remove(journal):
    os.remove(journal.output)


def _replace_with_a_copy(journal):  # as an editor or `sed -i` saves a file: a new file renamed over it
    with open(journal.output, "rb") as f:
        data = f.read()
    with open(journal.output + ".new", "wb") as f:
        f.write(data)
    os.replace(journal.output + ".new", journal.output)


def _append(journal):
    with open(journal.output, "ab") as f:
        f.write(b'{"note": "somebody else"}\n')


@pytest.mark.parametrize("change", [_truncate, _remove, _replace_with_a_copy, _append])
def test_an_output_changed_by_another_process_stops_the_job(tmp_path, llm, monkeypatch, change):
    """Writing on into a file that was cut (a hole of NULs where the rows were), removed or renamed
    away (the rows go nowhere anyone reads) would lose finished rows and still mark the job
    complete. The job notices at its next write, stops naming the file, and the rerun runs the
    rows that went missing."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    after_commits(monkeypatch, 2, change)
    with pytest.raises(ValueError, match=r"out\.jsonl: another process (changed|removed|replaced) it.*rerun the same command"):
        job(tmp_path, llm, path, max_inflight=2)
    monkeypatch.undo()
    again = job(tmp_path, llm, path)
    assert again.exit_code == 0 and again.rows_done == len(TEXTS)
    assert b"\0" not in (tmp_path / "out.jsonl").read_bytes()
    assert rows_of(tmp_path / "out.jsonl") == [(i, 0) for i in range(len(TEXTS))]


def test_a_journal_cut_by_another_process_stops_the_job(tmp_path, llm, monkeypatch):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in TEXTS])
    after_commits(monkeypatch, 2, lambda journal: os.truncate(os.path.join(journal.dir, "journal.jsonl"), 0))
    with pytest.raises(ValueError, match=r"another process changed .*journal\.jsonl"):
        job(tmp_path, llm, path, max_inflight=2)
    monkeypatch.undo()
    again = job(tmp_path, llm, path)
    assert again.exit_code == 0 and rows_of(tmp_path / "out.jsonl") == [(i, 0) for i in range(len(TEXTS))]
# --- the input changed while it is read -----------------------------------------------------------

PAD = "x" * 3000  # rows larger than the reader's buffer: a change lands where the job has not read yet
ROWS = 24


def _padded_input(tmp_path, fmt: str):
    rows = [(TEXTS[i % len(TEXTS)], PAD) for i in range(ROWS)]
    if fmt == "csv":
        path = tmp_path / "in.csv"
        path.write_text("prompt,pad\n" + "".join(f"{text},{pad}\n" for text, pad in rows))
        return path
    return write_jsonl(tmp_path / "in.jsonl", [{"prompt": text, "pad": pad} for text, pad in rows])


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_rows_appended_to_the_input_while_it_runs_are_not_its_rows(tmp_path, llm, monkeypatch, capsys, fmt):
    """The job runs the input it scanned (the rows it counted, the bytes its resume digest covers):
    rows a producer appends meanwhile, and a line it has half written, are left for another job
    (a half line read as a bad row would be written as failed for good), and the job says so."""
    path = _padded_input(tmp_path, fmt)
    scanned = path.read_bytes()
    more = f"new row,{PAD}\nhalf a ro" if fmt == "csv" else json.dumps({"prompt": "new row", "pad": PAD}) + '\n{"prompt": "half a ro'

    def append(journal):
        with open(path, "ab") as f:
            f.write(more.encode())

    after_commits(monkeypatch, 1, append)
    summary = job(tmp_path, llm, path, max_inflight=2)
    assert summary.complete and summary.failed == 0 and summary.rows_done == ROWS
    assert rows_of(tmp_path / "out.jsonl") == [(i, 0) for i in range(ROWS)]
    assert path.read_bytes().startswith(scanned)
    assert f"in.{fmt} grew while the job ran; only the rows it held when the job started were run" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_input_cut_while_it_runs_stops_the_job_and_fails_no_row(tmp_path, llm, monkeypatch, fmt):
    """An input cut in the middle of a line: that half line is no bad row of the input (written as
    failed, a rerun on the restored input would never run it), the job stops saying the input
    changed, and the rerun on the restored input runs every row once."""
    path = _padded_input(tmp_path, fmt)
    whole = path.read_bytes()
    after_commits(monkeypatch, 1, lambda journal: os.truncate(path, len(whole) * 2 // 3 + 100))
    with pytest.raises(ValueError, match=rf"in\.{fmt} is shorter .* than when the job started.*restore the input"):
        job(tmp_path, llm, path, max_inflight=2)
    monkeypatch.undo()
    assert all(r["error"] is None for r in read_jsonl(tmp_path / "out.jsonl"))
    path.write_bytes(whole)
    again = job(tmp_path, llm, path)
    assert again.exit_code == 0 and again.failed == 0
    assert rows_of(tmp_path / "out.jsonl") == [(i, 0) for i in range(ROWS)]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_the_scan_counts_and_digests_only_the_bytes_the_run_reads(tmp_path, monkeypatch, fmt):
    """A producer appending while the scan runs: the row count and the resume digest cover the input
    as it was when the scan measured it, the bytes the run will read (`readers.ScannedInput`)."""
    from tokenmill.batch import readers

    lines = [json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(10)] if fmt == "jsonl" else \
        ["prompt\n"] + [f"row {i}\n" for i in range(10)]
    head = "".join(lines[: 7 if fmt == "csv" else 6]).encode()
    grown, first = tmp_path / f"grown.{fmt}", tmp_path / f"first.{fmt}"
    grown.write_bytes("".join(lines).encode())
    first.write_bytes(head)
    want = readers.scan_input(str(first), fmt)
    monkeypatch.setattr(readers.os.path, "getsize", lambda path: len(head))  # measured before the rest arrived
    got = readers.scan_input(str(grown), fmt)
    assert (got.rows, got.size, got.digest) == (want.rows, want.size, want.digest) == (6, len(head), want.digest)
