"""Resume state and writers: commits, repair of torn tails, settings fingerprints, Parquet finalization."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from tokenmill.batch.journal import Journal, ResumeError, sidecar_dir
from tokenmill.batch.results import read_result_record
from tokenmill.batch.writers import encode_lines, jsonl_to_parquet

from support.jsonl import strict_loads

SETTINGS = {"model": "m", "sampling": {"max_tokens": 8}, "input_digest": "abc"}


def lines(rows):
    return encode_lines({"row": r, "text": f"t{r}"} for r in rows)


def read_rows(path):
    with open(path, "rb") as f:
        return [json.loads(line)["row"] for line in f]


def test_fresh_commit_and_resume(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS) as j:
        assert not j.complete and j.resumed_rows == 0
        j.commit(lines([3, 1]), [3, 1], [1], prompt_tokens=10, completion_tokens=4)
        j.commit(lines([0]), [0], [], prompt_tokens=5, completion_tokens=2)
    with Journal.open(out, out, SETTINGS) as j:
        assert j.resumed_rows == 3 and j.repaired_bytes == 0
        assert [j.is_done(i) for i in range(5)] == [True, True, False, True, False]
        assert (j.previous.failed, j.previous.prompt_tokens, j.previous.completion_tokens) == (1, 15, 6)
        j.commit(lines([2, 4]), [2, 4], [], 1, 1)
        j.mark_complete()
    assert sorted(read_rows(out)) == [0, 1, 2, 3, 4]
    assert not os.path.exists(os.path.join(sidecar_dir(out), "journal.jsonl"))
    with Journal.open(out, out, SETTINGS) as j:
        assert j.complete and j.total().rows == 5 and j.total().failed == 1


@pytest.mark.parametrize("torn", [b'{"row": 9, "te', b'{"row":9,"text":"t9"}\n', b'{"row":9,"text":"t9"}\n{"row":1'])
def test_torn_or_uncommitted_tail_is_cut(tmp_path, torn):
    """A crash between writing lines and journaling them leaves bytes the journal does not cover."""
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS) as j:
        j.commit(lines([0, 1]), [0, 1], [], 0, 0)
    committed = os.path.getsize(out)
    with open(out, "ab") as f:
        f.write(torn)
    with Journal.open(out, out, SETTINGS) as j:
        assert j.repaired_bytes == len(torn)
        assert os.path.getsize(out) == committed
        assert not j.is_done(9)
        j.commit(lines([9]), [9], [], 0, 0)
    assert read_rows(out) == [0, 1, 9]


def test_torn_journal_line_is_ignored(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS) as j:
        j.commit(lines([0]), [0], [], 0, 0)
        j.commit(lines([1]), [1], [], 0, 0)
    journal_path = os.path.join(sidecar_dir(out), "journal.jsonl")
    data = open(journal_path, "rb").read()
    with open(journal_path, "wb") as f:
        f.write(data[:-5])  # the second entry lost its end: row 1 is not committed
    with Journal.open(out, out, SETTINGS) as j:
        assert j.is_done(0) and not j.is_done(1)
        assert j.repaired_bytes > 0
    assert read_rows(out) == [0]


def test_journal_ahead_of_data_is_not_trusted(tmp_path):
    """Power loss can persist the journal but not the data: entries past the data's end are dropped."""
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS) as j:
        j.commit(lines([0]), [0], [], 0, 0)
        keep = os.path.getsize(out)
        j.commit(lines([1]), [1], [], 0, 0)
    with open(out, "r+b") as f:
        f.truncate(keep)
    with Journal.open(out, out, SETTINGS) as j:
        assert j.is_done(0) and not j.is_done(1)


def samples(row, n, completion_tokens=2):
    return encode_lines({"row": row, "sample_index": i, "text": f"t{row}.{i}", "error": None, "prompt_tokens": 5,
                         "completion_tokens": completion_tokens} for i in range(n))


def journal_path_of(out):
    return os.path.join(sidecar_dir(out), "journal.jsonl")


@pytest.mark.parametrize("damage", ["nul-in-a-middle-line", "emptied", "deleted", "entry-never-written"])
def test_finished_rows_past_the_journal_are_read_back_not_cut(tmp_path, damage):
    """Whatever the journal lost, the output's complete lines name their rows: none is cut and run again."""
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        for row in range(4):
            j.commit(samples(row, 2), [row], [], 5, 4)
    data = open(out, "rb").read()
    entries = open(journal_path_of(out), "rb").read().splitlines(keepends=True)
    if damage == "nul-in-a-middle-line":
        entries[1] = entries[1][:3] + b"\0" + entries[1][4:]
        open(journal_path_of(out), "wb").write(b"".join(entries))
    elif damage == "emptied":
        open(journal_path_of(out), "wb").close()
    elif damage == "deleted":
        os.remove(journal_path_of(out))
    else:  # a crash after the data's write and before its journal line
        open(journal_path_of(out), "wb").write(b"".join(entries[:3]))
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        assert [j.is_done(i) for i in range(5)] == [True] * 4 + [False]
        assert j.repaired_bytes == 0 and open(out, "rb").read() == data
        assert (j.previous.rows, j.previous.prompt_tokens, j.previous.completion_tokens) == (4, 20, 16)
        assert j.rebuilt_rows == {"nul-in-a-middle-line": 3, "entry-never-written": 1}.get(damage, 4)
        j.commit(samples(4, 2), [4], [], 5, 4)
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:  # the rebuilt journal replays
        assert j.rebuilt_rows is None and j.previous.rows == 5


@pytest.mark.parametrize("tail", [b'{"row":2,"sample_index":2,"te', b"\0" * 40 + b"\n"])
def test_a_row_cut_between_its_samples_runs_again(tmp_path, tail):
    """n = 3: a crash (or a power failure's zeros) after two of row 2's sample lines: row 2 is
    dropped whole, rows 0 and 1 read back."""
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        j.commit(samples(0, 3), [0], [], 5, 6)
    with open(out, "ab") as f:  # row 1 whole and row 2's first two samples, unjournaled, then the cut
        f.write(samples(1, 3) + samples(2, 2) + tail)
    keep = os.path.getsize(out) - len(tail) - len(samples(2, 2))
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        assert [j.is_done(i) for i in range(3)] == [True, True, False]
        assert os.path.getsize(out) == keep and j.repaired_bytes == len(samples(2, 2)) + len(tail)
        assert j.rebuilt_rows == 1 and j.previous.completion_tokens == 12


def test_a_row_journaled_twice_in_the_data_stops_the_read_back(tmp_path):
    """Lines past the journal that repeat a recorded row are not results of this attempt: cut."""
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        j.commit(samples(0, 1), [0], [], 5, 2)
    with open(out, "ab") as f:
        f.write(samples(1, 1) + samples(0, 1) + samples(2, 1))
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        assert [j.is_done(i) for i in range(3)] == [True, False, False]  # row 1 came just before the cut
        assert read_rows(out) == [0]


@pytest.mark.parametrize("edit", ["output-line-deleted", "output-line-shortened", "first-output-line-deleted",
                                  "journal-line-deleted", "journal-line-repeated"])
def test_an_output_or_journal_edited_by_hand_is_read_back_from_the_output(tmp_path, edit):
    """Edits that leave the journal's offsets pointing elsewhere: the output decides what is done, so
    a deleted row runs again, and no row is lost, written twice or left with a torn line."""
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        for row in range(4):
            j.commit(samples(row, 1), [row], [], 5, 2)
    data = open(out, "rb").read().splitlines(keepends=True)
    entries = open(journal_path_of(out), "rb").read().splitlines(keepends=True)
    if edit == "output-line-deleted":
        del data[1]
    elif edit == "first-output-line-deleted":  # every line as long as the others: the offsets still fall between lines
        del data[0]
    elif edit == "output-line-shortened":
        data[1] = data[1].replace(b'"t1.0"', b'"x"')
    elif edit == "journal-line-deleted":
        del entries[1]
    else:
        entries.insert(2, entries[1])
    open(out, "wb").write(b"".join(data))
    open(journal_path_of(out), "wb").write(b"".join(entries))
    kept = {"output-line-deleted": [0, 2, 3], "first-output-line-deleted": [1, 2, 3]}.get(edit, [0, 1, 2, 3])
    with Journal.open(out, out, SETTINGS, read_record=read_result_record) as j:
        assert [i for i in range(5) if j.is_done(i)] == kept
        assert j.repaired_bytes == 0 and j.rebuilt_rows
        missing = [i for i in range(5) if not j.is_done(i)]
        j.commit(b"".join(samples(i, 1) for i in missing), missing, [], 5, 2)
    assert sorted(read_rows(out)) == [0, 1, 2, 3, 4]


def test_an_openai_output_edited_by_hand_is_read_back(tmp_path):
    from tokenmill.batch.openai_batch import OpenAIRecordReader
    from tokenmill.batch.openai_lines import stable_id

    def openai_lines(rows):
        return encode_lines({"id": stable_id("batch_req_", "job", r), "custom_id": f"c{r}", "error": None,
                             "response": {"status_code": 200, "body": {"usage": {}}}} for r in rows)

    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS, read_record=OpenAIRecordReader("job", 4)) as j:
        for row in range(3):
            j.commit(openai_lines([row]), [row], [], 0, 0)
    data = open(out, "rb").read().splitlines(keepends=True)
    open(out, "wb").write(data[1] + data[2])  # the first line deleted; the lines are all as long
    with Journal.open(out, out, SETTINGS, read_record=OpenAIRecordReader("job", 4)) as j:
        assert [i for i in range(4) if j.is_done(i)] == [1, 2]


def test_changed_settings_refuse_to_resume(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS) as j:
        j.commit(lines([0]), [0], [], 0, 0)
    changed = {**SETTINGS, "sampling": {"max_tokens": 16}}
    with pytest.raises(ResumeError, match=r"sampling: .*8.* -> .*16.*--overwrite"):
        Journal.open(out, out, changed)
    with Journal.open(out, out, changed, overwrite=True) as j:
        assert j.resumed_rows == 0 and os.path.getsize(out) == 0


def test_changed_settings_after_an_attempt_that_wrote_nothing_start_fresh(tmp_path):
    """E.g. the first attempt named a model that failed to load: there is nothing to mix up."""
    out = str(tmp_path / "out.jsonl")
    Journal.open(out, out, SETTINGS).close()
    changed = {**SETTINGS, "model": "other"}
    with Journal.open(out, out, changed) as j:
        assert j.state["settings"]["model"] == "other"
        j.commit(lines([0]), [0], [], 0, 0)
    with pytest.raises(ResumeError):
        Journal.open(out, out, SETTINGS)


def test_foreign_output_is_not_overwritten(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"precious": true}\n')
    with pytest.raises(ResumeError, match="not written by a resumable tokenmill run"):
        Journal.open(str(out), str(out), SETTINGS)
    assert out.read_text() == '{"precious": true}\n'
    with Journal.open(str(out), str(out), SETTINGS, overwrite=True) as j:
        assert j.resumed_rows == 0
    assert out.read_text() == ""


def test_two_runs_cannot_share_an_output(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS):
        with pytest.raises(ResumeError, match="another tokenmill run"):
            Journal.open(out, out, SETTINGS)


def test_removed_complete_output_is_reported(tmp_path):
    out = str(tmp_path / "out.jsonl")
    with Journal.open(out, out, SETTINGS) as j:
        j.commit(lines([0]), [0], [], 0, 0)
        j.mark_complete()
    os.remove(out)
    with pytest.raises(ResumeError, match="removed"):
        Journal.open(out, out, SETTINGS)


class Crash(BaseException):
    """A kill -9 at that point: nothing after it runs."""


def test_a_crash_after_the_state_says_complete_leaves_no_journal_or_staging_copy(tmp_path, monkeypatch):
    """Killed between writing the complete state.json and deleting the journal and the Parquet staging
    file (a whole second copy of the results): the next run, which finds the job complete, deletes them
    (found by the crash-resume chaos harness)."""
    out = str(tmp_path / "out.parquet")
    staging = os.path.join(sidecar_dir(out), "staging.jsonl")
    with Journal.open(out, staging, SETTINGS) as j:
        j.commit(lines([0, 1]), [0, 1], [], 0, 0)
        jsonl_to_parquet(staging, out)

        def killed(path):
            raise Crash

        monkeypatch.setattr(os, "remove", killed)
        with pytest.raises(Crash):
            j.mark_complete()
        monkeypatch.undo()
    assert sorted(os.listdir(sidecar_dir(out))) == ["journal.jsonl", "lock", "staging.jsonl", "state.json"]
    with Journal.open(out, staging, SETTINGS) as j:
        assert j.complete and j.total().rows == 2
    assert sorted(os.listdir(sidecar_dir(out))) == ["lock", "state.json"]


def test_many_rows_bitmap(tmp_path):
    out = str(tmp_path / "out.jsonl")
    done = list(range(0, 100_000, 7))
    with Journal.open(out, out, SETTINGS) as j:
        j.commit(lines(done), done, [], 0, 0)
    with Journal.open(out, out, SETTINGS) as j:
        assert all(j.is_done(i) == (i % 7 == 0) for i in range(100_000))
        assert not any(j.is_done(i) for i in range(100_000, 100_100))


def test_encode_lines_survives_lone_surrogates():
    data = encode_lines([{"text": "ok \ud800 bad"}, {"text": "ünï"}])
    first, second = data.splitlines()
    assert json.loads(first)["text"] == "ok \ud800 bad"
    assert json.loads(second)["text"] == "ünï"



def test_float32_vectors_are_written_as_the_shortest_decimals_that_read_back_exactly():
    """Embedding vectors (float32 numpy arrays, at any depth of a record) are written by Arrow: every
    value reads back as the same float32 (Python's json and a float32 cast), exact integers stay
    floats, NaN and infinities (which JSON cannot hold) are written null as pydantic's JSON writes them
    (vLLM's run-batch), and the other fields (text that
    looks like the writer's placeholder among them) are untouched, in their order."""
    import numpy as np

    gen = np.random.default_rng(0)
    wide = (gen.standard_normal(2000) * 10.0 ** gen.integers(-40, 38, 2000)).astype(np.float32)
    edges = np.array([0.0, -0.0, 1.0, -3.0, 16777216.0, 1e-45, -1e-38, 3.4028235e38, 0.1, 123456789.0], dtype=np.float32)
    vectors = [wide, edges, np.array([0.5, np.nan, np.inf, -np.inf], dtype=np.float32), np.zeros(0, dtype=np.float32)]
    records = [{"row": i, "id": f"é\x00{i}:0", "embedding": v, "error": None} for i, v in enumerate(vectors)]
    records.append({"response": {"body": {"data": [{"index": 0, "embedding": edges}]}}, "error": None})  # an OpenAI line
    # An OpenAI line of several inputs: its vectors, each in its own place.
    records.append({"response": {"body": {"data": [{"index": k, "embedding": v} for k, v in enumerate(vectors)]}}})
    lines = encode_lines(records).decode("utf-8").splitlines()
    assert len(lines) == 6
    assert json.loads(lines[4])["response"]["body"]["data"][0]["embedding"] == json.loads(lines[1])["embedding"]
    several = json.loads(lines[5])["response"]["body"]["data"]
    assert [d["index"] for d in several] == [0, 1, 2, 3]
    assert [d["embedding"] for d in several] == [json.loads(line)["embedding"] for line in lines[:4]]
    for i, (line, vector) in enumerate(zip(lines, vectors)):
        back = json.loads(line, parse_constant=float)
        assert list(back) == ["row", "id", "embedding", "error"] and back["id"] == f"é\x00{i}:0"
        if i == 2:
            assert back["embedding"] == [0.5, None, None, None]
            continue
        assert all(isinstance(x, float) for x in back["embedding"])
        np.testing.assert_array_equal(np.array(back["embedding"], dtype=np.float32), vector)
        assert np.array_equal(np.signbit(np.array(back["embedding"], dtype=np.float32)), np.signbit(vector))
    assert len(lines[0]) < len(json.dumps(wide.tolist())) * 0.75  # shorter than float64's 17 digits
    assert all(strict_loads(line) for line in lines)


def test_many_vectors_cast_in_slices_on_threads_read_back_in_order(monkeypatch):
    """A commit's many vectors go to Arrow in slices of whole vectors on several threads: every
    vector comes back in its place, exact (integers in one slice only, NaN and empty vectors
    between), as the one-thread pass writes it."""
    import numpy as np

    from tokenmill.batch import writers

    gen = np.random.default_rng(1)
    vectors = [(gen.standard_normal(int(gen.integers(0, 40))) / 7).astype(np.float32) for _ in range(300)]
    vectors[5] = np.array([2.0, -7.0, 0.25], dtype=np.float32)
    vectors[17] = np.array([np.nan, 1.5], dtype=np.float32)
    vectors[250] = np.zeros(0, dtype=np.float32)
    slices: list[int] = []
    arrow_json = writers._arrow_json
    monkeypatch.setattr(writers, "_arrow_json", lambda part: slices.append(len(part)) or arrow_json(part))
    monkeypatch.setattr(writers, "usable_cpus", lambda: 4)
    monkeypatch.setattr(writers, "_VALUES_A_THREAD", 64)
    sliced = writers.float32_json(vectors)
    assert len(slices) == 4 and sum(slices) == len(vectors) - 1  # the NaN vector is written apart, its NaN null
    monkeypatch.setattr(writers, "_MOST_THREADS", 1)
    assert sliced == writers.float32_json(vectors) and len(slices) == 5
    for text, vector in zip(sliced, vectors):
        back = np.array(json.loads(text), dtype=np.float32)  # null reads back as NaN
        np.testing.assert_array_equal(back, vector)
    assert sliced[5] == b"[2.0,-7.0,0.25]" and sliced[250] == b"[]"


def test_parquet_finalization(tmp_path):
    staging = str(tmp_path / "staging.jsonl")
    records = [
        {"row": i, "id": i if i % 2 else f"s{i}", "sample_index": 0, "text": f"t{i}", "finish_reason": "stop",
         "prompt_tokens": 3, "completion_tokens": 2, "cumulative_logprob": None, "error": None}
        for i in range(20_000)
    ]
    records.append({"row": 20_000, "id": None, "sample_index": None, "text": None, "finish_reason": None,
                    "prompt_tokens": 0, "completion_tokens": 0, "cumulative_logprob": None, "error": "bad"})
    with open(staging, "wb") as f:
        f.write(encode_lines(records))
    out = str(tmp_path / "out.parquet")
    assert jsonl_to_parquet(staging, out) == 20_001
    table = pq.read_table(out)
    assert table.num_rows == 20_001
    assert table.column("id").to_pylist()[:3] == ["s0", "1", "s2"]
    assert table.column("error").to_pylist()[-1] == "bad"
    assert not os.path.exists(out + ".tmp")
