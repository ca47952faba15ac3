"""Input readers: every format streams, every undecodable row becomes an error row, indexes are stable."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.batch.readers import detect_format, read_rows, scan_input


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def test_jsonl_rows_and_per_line_errors(tmp_path):
    data = b"\n".join([
        b'{"prompt": "a"}',
        b"",  # blank lines are not rows
        b'{"prompt": "b"',  # truncated
        b"[1, 2]",  # not an object
        b'{"prompt": "\xff\xfe"}',  # bad UTF-8
        b"   ",
        b'{"prompt": "c"}',
        b'{"prompt": "no newline at the end"',
    ])
    path = write(tmp_path / "in.jsonl", data)
    rows = list(read_rows(path, "jsonl"))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0].record == {"prompt": "a"} and rows[0].error is None
    assert "line 3 is not valid JSON" in rows[1].error
    assert rows[2].error == "line 4 must be a JSON object, got an array"
    assert "line 5 is not valid UTF-8" in rows[3].error and "0xff" in rows[3].error
    assert rows[4].record == {"prompt": "c"}
    assert "line 8 is not valid JSON" in rows[5].error
    info = scan_input(path, "jsonl")
    assert info.rows == 6 and info.size == len(data)


def test_jsonl_bom_and_crlf(tmp_path):
    path = write(tmp_path / "in.jsonl", b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [r.record for r in read_rows(path, "jsonl")] == [{"prompt": "a"}, {"prompt": "b"}]


def test_reader_streams_instead_of_loading(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(50_000):
            f.write(json.dumps({"prompt": f"row {i}"}) + "\n")
    rows = read_rows(str(path), "jsonl")
    first = next(rows)
    assert first.record == {"prompt": "row 0"}
    # A generator that has read one row has not decoded the rest.
    assert rows.gi_frame is not None  # type: ignore[attr-defined]
    assert sum(1 for _ in rows) == 49_999


def test_digest_changes_with_content(tmp_path):
    a = write(tmp_path / "a.jsonl", b'{"prompt": "a"}\n')
    b = write(tmp_path / "b.jsonl", b'{"prompt": "b"}\n')
    assert scan_input(a, "jsonl").digest != scan_input(b, "jsonl").digest
    assert scan_input(a, "jsonl").digest == scan_input(a, "jsonl").digest


def test_detect_format(tmp_path):
    plain = write(tmp_path / "rows.jsonl", b'{"prompt": "a"}\n')
    openai = write(tmp_path / "batch.jsonl", b'not json\n{"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {}}\n')
    assert detect_format(plain) == "jsonl"
    assert detect_format(openai) == "openai"
    assert detect_format(str(tmp_path / "x.csv")) == "csv"
    assert detect_format(str(tmp_path / "x.tsv")) == "tsv"
    assert detect_format(str(tmp_path / "x.parquet")) == "parquet"
    assert detect_format(openai, "jsonl") == "jsonl"
    with pytest.raises(ValueError, match="extension"):
        detect_format(str(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="not supported"):
        detect_format(plain, "xml")


def test_openai_batch_refuses_a_custom_id_an_earlier_line_has(tmp_path):
    def line(custom_id):
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    data = "\n".join([line("a"), line("b"), "", line("a"), '{"custom_id": "c", ', line("c"), line("a")]) + "\n"
    path = write(tmp_path / "batch.jsonl", data.encode())
    rows = list(read_rows(path, "openai"))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r.record["custom_id"] if r.record else None for r in rows] == ["a", "b", None, None, "c", None]
    assert rows[2].error == ("line 4: custom_id 'a' is already used by line 1; "
                             "each request of an OpenAI batch file needs its own custom_id")
    assert "not valid JSON" in rows[3].error  # an undecodable line claims no id: line 6 keeps "c"
    assert rows[5].where == "line 7" and "'a' is already used by line 1" in rows[5].error
    # Plain JSONL rows may share any field: ids there are the user's business.
    assert all(r.error is None for r in read_rows(write(tmp_path / "rows.jsonl", ((line("a") + "\n") * 2).encode()), "jsonl"))


def test_openai_reader_remembers_custom_ids_in_fixed_size_entries(tmp_path, monkeypatch):
    """The reader must remember every custom_id for the whole run: as 24-byte array entries once
    merged (a digest and the line), never the ids themselves (a dict of the ids and their "line N"
    texts was ~200 bytes a line; bench/results/host_memory_soak.md)."""
    import functools

    import tokenmill.batch.readers as readers
    from tokenmill.batch.first_seen import FirstSeen

    monkeypatch.setattr(readers, "FirstSeen", functools.partial(FirstSeen, merge_at=64))
    long_id = "x" * 200
    lines = [json.dumps({"custom_id": f"{long_id}-{i}", "method": "POST", "url": "/v1/completions", "body": {}})
             for i in range(3000)]
    lines.append(lines[4])  # line 3001 repeats line 5's id, by now only in the arrays
    rows = read_rows(write(tmp_path / "batch.jsonl", ("\n".join(lines) + "\n").encode()), "openai")
    read = [next(rows) for _ in range(3000)]
    assert all(r.error is None for r in read)
    seen = rows.gi_frame.f_locals["first_seen"]  # the reader's memory of the ids, between two rows
    assert isinstance(seen, FirstSeen) and len(seen) == 3000
    assert len(seen.recent) <= 3000 // 8 and all(type(k) is bytes and len(k) == 16 for k in seen.recent)
    assert seen.high.nbytes + seen.low.nbytes + seen.values.nbytes == 24 * (3000 - len(seen.recent))
    repeat = next(rows)
    assert repeat.error.startswith("line 3001: custom_id 'xxx") and "is already used by line 5;" in repeat.error


def test_first_seen_answers_as_a_dict_across_merges():
    """setdefault gives the value a key was first stored with, whether it is still in the dict of new
    keys or merged into the sorted arrays (merge_at=4: many merges, buckets of every size)."""
    import random

    from tokenmill.batch.first_seen import FirstSeen

    rng = random.Random(0)
    keys = [f"id-{i}" for i in range(600)] + ["", "\ud800 lone surrogate", "é", "x" * 10_000]
    seen, expected = FirstSeen(merge_at=4), {}
    for value in range(5000):
        key = rng.choice(keys)
        assert seen.setdefault(key, value) == expected.setdefault(key, value)
    assert len(seen) == len(expected) and seen.high is not None


def test_csv_rows_quotes_and_errors(tmp_path):
    path = tmp_path / "in.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "prompt"])
        w.writerow(["a", "multi\nline, with comma"])
        w.writerow(["b", "x", "extra"])
        w.writerow([])
        w.writerow(["c", "ünïcödé"])
    with open(path, "ab") as f:
        f.write(b'd,"bad \xff byte"\r\n')
        f.write(b'e,"unterminated\r\n')
    rows = list(read_rows(str(path), "csv"))
    assert rows[0].record == {"id": "a", "prompt": "multi\nline, with comma"}
    assert "has 3 fields but the header has 2" in rows[1].error
    assert rows[2].record == {"id": "c", "prompt": "ünïcödé"}
    assert "not valid UTF-8" in rows[3].error
    assert rows[4].error is not None and "quote that never closes" in rows[4].error
    assert [r.index for r in rows] == list(range(len(rows)))
    assert scan_input(str(path), "csv").rows == len(rows)


def test_csv_quote_that_swallows_rows_fails_its_own_line_only(tmp_path):
    """A 100-row file with one unterminated quote still has 100 rows: the quote's line is the error,
    the lines it would have swallowed are rows again (at the end of the file, or up to a later quote)."""
    lines = ["id,prompt"] + [f"{i},prompt {i}" for i in range(100)]
    lines[4] = '3,"the quote never closes'
    lines[60] = '59,"a stray quote'
    lines[70] = '69,"another "one"'  # where the stray quote of line 61 would have stopped
    lines[100] = '99,"at the end'  # this one runs to the end of the file
    path = tmp_path / "in.csv"
    path.write_text("\n".join(lines) + "\n")
    rows = list(read_rows(str(path), "csv"))
    assert len(rows) == 100 == scan_input(str(path), "csv").rows
    errors = {r.index: r.error for r in rows if r.error is not None}
    assert sorted(errors) == [3, 59, 69, 99]
    assert errors[3].startswith("line 5 is not valid CSV") and "ran on to line 61" in errors[3]
    assert errors[59].startswith("line 61 is not valid CSV") and "ran on to line 71" in errors[59]
    assert errors[99] == "line 101 has a quote that never closes (the field would run to the end of the file)"
    assert all(r.record == {"id": str(r.index), "prompt": f"prompt {r.index}"} for r in rows if r.index not in errors)


def test_json_error_message_reads_well(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "unterminated')
    (row,) = read_rows(str(path), "jsonl")
    assert row.error == "line 1 is not valid JSON: Unterminated string starting at (column 12)"


def test_json_error_column_of_a_line_cut_short(tmp_path):
    """A line cut short (a truncated write, a missing brace) is followed by its newline: the error is at
    the end of that line's text, not at 'column 1' of the line after, which json's own numbering gives."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 5\n{"prompt": "b"}\r\n{"prompt": "c", "x": 1\r\n')
    rows = read_rows(str(path), "jsonl")
    assert [r.error for r in rows] == [
        "line 1 is not valid JSON: Expecting ',' delimiter (column 32, the end of the line: is it cut short?)",
        None,
        "line 3 is not valid JSON: Expecting ',' delimiter (column 23, the end of the line: is it cut short?)",
    ]


def test_csv_long_field_is_not_a_reader_error(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("prompt\n" + "x" * 300_000 + "\nshort\n")
    rows = list(read_rows(str(path), "csv"))
    assert len(rows[0].record["prompt"]) == 300_000 and rows[1].record == {"prompt": "short"}


def test_tsv(tmp_path):
    path = write(tmp_path / "in.tsv", "id\tprompt\n1\thello, world\n".encode())
    assert [r.record for r in read_rows(path, "tsv")] == [{"id": "1", "prompt": "hello, world"}]


def test_csv_duplicate_header_is_refused(tmp_path):
    path = write(tmp_path / "in.csv", b"prompt,prompt\na,b\n")
    with pytest.raises(ValueError, match="repeats"):
        list(read_rows(path, "csv"))


def test_parquet_streams_by_batches(tmp_path):
    path = str(tmp_path / "in.parquet")
    table = pa.table({
        "id": list(range(2500)),
        "prompt": [f"p{i}" for i in range(2500)],
        "messages": [[{"role": "user", "content": f"m{i}"}] for i in range(2500)],
    })
    pq.write_table(table, path, row_group_size=1000)
    rows = list(read_rows(path, "parquet"))
    assert len(rows) == 2500 and rows[2499].index == 2499
    assert rows[7].record == {"id": 7, "prompt": "p7", "messages": [{"role": "user", "content": "m7"}]}
    assert scan_input(path, "parquet").rows == 2500


def test_not_parquet_is_a_clear_error(tmp_path):
    path = write(tmp_path / "in.parquet", b"this is not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        list(read_rows(path, "parquet"))


def test_json_python_will_not_hold_is_a_row_error(tmp_path):
    """An integer past Python's 4,300-digit limit is valid JSON that json.loads refuses: that line fails."""
    path = write(tmp_path / "in.jsonl", b'{"prompt": "a"}\n{"prompt": "b", "n": ' + b"9" * 5000 + b'}\n{"prompt": "c"}\n')
    rows = list(read_rows(path, "jsonl"))
    assert [r.record for r in rows] == [{"prompt": "a"}, None, {"prompt": "c"}]
    assert rows[1].error.startswith("line 2 cannot be read:") and "4300" in rows[1].error


def test_a_parquet_value_python_cannot_hold_fails_its_row_only(tmp_path):
    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "ts": pa.array([0, 10**12, 5], type=pa.timestamp("s"))}), path)
    rows = list(read_rows(path, "parquet"))
    assert [r.record["prompt"] if r.record else None for r in rows] == ["a", None, "c"]
    assert rows[1].error.startswith("record 1: column 'ts' holds a value Python cannot represent")


def test_openai_batch_is_told_by_most_lines_not_the_first(tmp_path):
    lines = [{"method": "POST", "url": "/v1/completions", "body": {"prompt": "no custom_id"}}]
    lines += [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}} for i in range(3)]
    path = write(tmp_path / "in.jsonl", "\n".join(json.dumps(x) for x in lines).encode())
    assert detect_format(path) == "openai"
    plain = write(tmp_path / "rows.jsonl", b'{"prompt": "a", "url": "u", "body": "b"}\n{"prompt": "b"}\n')
    assert detect_format(plain) == "jsonl"  # web-page rows with url and body fields are not batch requests


def test_an_empty_csv_cell_is_a_missing_value(tmp_path):
    path = write(tmp_path / "in.csv", b'id,prompt,messages\n,hello,\nx7,,"[]"\n')
    rows = list(read_rows(path, "csv"))
    assert rows[0].record == {"id": None, "prompt": "hello", "messages": None}
    assert rows[1].record == {"id": "x7", "prompt": None, "messages": "[]"}


@pytest.mark.parametrize("data", [b'[{"prompt": "a"},\n {"prompt": "b"}]\n', b'\xef\xbb\xbf\n  [\n{"prompt": "a"}]'])
def test_a_json_array_is_refused_before_any_row_runs(tmp_path, data):
    path = write(tmp_path / "in.json", data)
    with pytest.raises(ValueError, match=r"holds a JSON array, not JSON Lines.*jq -c"):
        scan_input(path, detect_format(path))
