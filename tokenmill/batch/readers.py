"""Streaming input readers: JSONL (plain rows or the OpenAI batch format), CSV/TSV and Parquet.

A reader never loads the whole file: JSONL and CSV are read line by line, Parquet one record
batch at a time. Every input row becomes a `RawRow` with a stable index (its position among the
non-blank rows), so a resumed run can skip the rows it already finished. A row that cannot be
decoded (bad UTF-8, truncated JSON, not an object, a CSV line with the wrong number of fields),
or an OpenAI batch line reusing an earlier line's custom_id, becomes a `RawRow` with an error
instead of a record: the job writes it as an error row and goes on. Only a file that cannot be
read at all (missing, not Parquet) raises.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenmill.batch.first_seen import FirstSeen

INPUT_FORMATS = ("auto", "jsonl", "openai", "csv", "tsv", "parquet")
_EXTENSIONS = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".csv": "csv", ".tsv": "tsv",
    ".parquet": "parquet", ".pq": "parquet",
}
_PARQUET_BATCH_ROWS = 1024
_SNIFF_LINES = 32


@dataclass
class RawRow:
    """One input row: its record, or why it could not be decoded."""

    index: int  # 0-based among the rows of the file (blank JSONL lines are not rows)
    record: dict[str, Any] | None
    error: str | None = None
    where: str = ""  # "line 12" / "record 12": where a person finds it in the file


@dataclass(frozen=True)
class InputInfo:
    """What a pre-pass learned about the input: how many rows, and a digest of its bytes."""

    format: str
    rows: int | None
    size: int
    digest: str


def detect_format(path: str, requested: str = "auto") -> str:
    """The input format: the requested one, else from the extension (JSONL is sniffed for OpenAI batch lines)."""
    if requested not in INPUT_FORMATS:
        raise ValueError(f"input format {requested!r} is not supported; choose one of {INPUT_FORMATS}")
    fmt = requested
    if fmt == "auto":
        ext = os.path.splitext(path)[1].lower()
        if ext not in _EXTENSIONS:
            raise ValueError(
                f"cannot tell the format of {path!r} from its extension {ext or '(none)'!r}; "
                f"use one of {sorted(_EXTENSIONS)} or pass --input-format"
            )
        fmt = _EXTENSIONS[ext]
        if fmt == "jsonl" and _looks_like_openai_batch(path):
            fmt = "openai"
    return fmt


def _looks_like_openai_batch(path: str) -> bool:
    """True when most of the first decodable JSON objects have OpenAI batch keys (custom_id, and body
    or url): one bad line at the top must not turn a whole batch file into plain rows."""
    votes = []
    with open(path, "rb") as f:
        for _, line in zip(range(_SNIFF_LINES), f):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                votes.append("custom_id" in obj and ("body" in obj or "url" in obj))
    return sum(votes) * 2 > len(votes)


def scan_input(path: str, fmt: str) -> InputInfo:
    """One streaming pass: the row count (for progress and ETA) and a digest (for resume checks)."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    rows: int | None = 0
    # The count and digest cover the first ``size`` bytes only, as the run reads them (`ScannedInput`):
    # a producer appending meanwhile would make them describe rows the run never reads.
    scanned = None if fmt == "parquet" else size
    if fmt in ("jsonl", "openai"):
        _refuse_json_array(path)
        with _open_input(path, scanned) as f:
            for line in f:
                digest.update(line)
                if line.strip():
                    rows += 1  # type: ignore[operator]
    else:
        with _open_input(path, scanned) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if fmt == "parquet":
            rows = _parquet_file(path).metadata.num_rows
        else:
            rows = sum(1 for _ in _csv_records(path, fmt, scanned))
    return InputInfo(format=fmt, rows=rows, size=size, digest=digest.hexdigest())


def _refuse_json_array(path: str) -> None:
    """A file that opens with ``[`` is one JSON array (a .json export), not one object a line: every
    line would become a bad row after the model loaded. Refuse it at once, saying how to convert."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        raise ValueError(f"{path} holds a JSON array, not JSON Lines (one object a line): convert it first, "
                         f"e.g. jq -c '.[]' {path} > rows.jsonl")


def read_rows(path: str, fmt: str, size: int | None = None) -> Iterator[RawRow]:
    """Yield every row of the input, in file order, decoding one row at a time. With ``size`` (the
    scan's, `InputInfo.size`), a JSONL or CSV input is read up to that byte only (`ScannedInput`)."""
    if fmt == "jsonl":
        return _jsonl_rows(path, size)
    if fmt == "openai":
        return _unique_custom_ids(_numbered_jsonl_rows(path, size))
    if fmt in ("csv", "tsv"):
        return _csv_rows(path, fmt, size)
    if fmt == "parquet":
        return _parquet_rows(path)
    raise ValueError(f"input format {fmt!r} is not supported; choose one of {INPUT_FORMATS[1:]}")


class ScannedInput(io.RawIOBase):
    """The input's first ``size`` bytes: those the scan before the run counted and digested.

    The job runs the input it scanned. Rows a producer appends while it runs are not counted, and
    the resume digest does not cover them; the line it is halfway through writing would be read as
    a bad row and written as failed for good. So reading stops at ``size``. An input that ends
    before it was cut while the job ran: that raises, before the line cut in two is read as a row
    (written as failed, a rerun on the restored input would never run it again)."""

    def __init__(self, path: str, size: int):
        super().__init__()
        self._file = open(path, "rb", buffering=0)
        self._path, self._size, self._left = path, size, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            return 0
        count = self._file.readinto(memoryview(buffer).cast("B")[: self._left])
        if not count:
            now = os.fstat(self._file.fileno()).st_size
            raise ValueError(f"{self._path} is shorter ({now} bytes) than when the job started ({self._size} bytes): "
                             "it was changed while the job ran. The finished rows are kept; restore the input and "
                             "rerun the same command to run the rest")
        self._left -= count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_input(path: str, size: int | None) -> Any:
    """The input as a buffered binary file: all of it, or its first ``size`` bytes (`ScannedInput`)."""
    return open(path, "rb") if size is None else io.BufferedReader(ScannedInput(path, size))


# --- JSONL -------------------------------------------------------------------------------------


def _jsonl_rows(path: str, size: int | None = None) -> Iterator[RawRow]:
    return (raw for _, raw in _numbered_jsonl_rows(path, size))


def _numbered_jsonl_rows(path: str, size: int | None = None) -> Iterator[tuple[int, RawRow]]:
    """Each row with its line number."""
    index = 0
    with _open_input(path, size) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines separate nothing and are not rows
            yield line_no, _decode_jsonl_line(index, line_no, raw)
            index += 1


def _unique_custom_ids(rows: Iterator[tuple[int, RawRow]]) -> Iterator[RawRow]:
    """OpenAI batch lines whose custom_id an earlier line already has become bad rows. Results are
    matched to requests by custom_id, so two results under one id could not be told apart (OpenAI
    refuses such a file). The earlier line runs. Every process of a job sees every line in file
    order (replicas shard after reading), so a resumed or sharded run decides the same way.
    Every id read is remembered for the whole run, in ~30 bytes whatever its length (`FirstSeen`)."""
    first_seen = FirstSeen()  # custom_id -> the line it was first on
    for line_no, raw in rows:
        custom_id = raw.record.get("custom_id") if raw.record is not None else None
        if isinstance(custom_id, str) and custom_id:
            first = first_seen.setdefault(custom_id, line_no)
            if first != line_no:
                raw = RawRow(raw.index, None, f"{raw.where}: custom_id {custom_id!r} is already used by line {first}; "
                             "each request of an OpenAI batch file needs its own custom_id", raw.where)
        yield raw


def _decode_jsonl_line(index: int, line_no: int, raw: bytes) -> RawRow:
    where = f"line {line_no}"
    if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark some editors write
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRow(index, None, f"{where} is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})", where)
    # Without its line break: json would place an error at the end of a line cut short at "column 1"
    # of the line after it.
    text = text.rstrip("\r\n")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        at_end = ", the end of the line: is it cut short?" if e.pos >= len(text) else ""
        return RawRow(index, None, f"{where} is not valid JSON: {e.msg} (column {e.colno}{at_end})", where)
    except ValueError as e:  # valid JSON Python will not hold, e.g. an integer of more than 4,300 digits
        return RawRow(index, None, f"{where} cannot be read: {e}", where)
    except RecursionError:
        return RawRow(index, None, f"{where} is not valid JSON: nested too deeply", where)
    if not isinstance(obj, dict):
        return RawRow(index, None, f"{where} must be a JSON object, got {_json_type(obj)}", where)
    return RawRow(index, obj, None, where)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


# --- CSV / TSV ---------------------------------------------------------------------------------


class _Lines:
    """A text file's lines for csv.reader, numbered, keeping those of the record being read so that
    they can be read again."""

    def __init__(self, file: Any):
        self._file = file
        self._again: list[tuple[int, str]] = []  # lines to read again, the next one last
        self._next_number = 1
        self.taken: list[tuple[int, str]] = []  # (line number, text) of the current record

    def __iter__(self) -> "_Lines":
        return self

    def __next__(self) -> str:
        if self._again:
            number, text = self._again.pop()
        else:
            text = next(self._file)
            number, self._next_number = self._next_number, self._next_number + 1
        self.taken.append((number, text))
        return text

    def read_again(self, lines: list[tuple[int, str]]) -> None:
        self._again.extend(reversed(lines))


def _csv_records(path: str, fmt: str, size: int | None = None) -> Iterator[tuple[int, list[str] | None, str | None]]:
    """Raw CSV records after the header: (line number, fields or None, error or None).

    A record that is not valid CSV is an error on its first line, and the lines after that one are
    read again as records of their own: an unterminated quote would otherwise swallow every line
    up to the next quote (or the end of the file) into one bad record, and those rows would vanish.
    """
    # Undecodable bytes survive as surrogates so that one bad row does not stop the file.
    with io.TextIOWrapper(_open_input(path, size), encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        lines = _Lines(f)
        reader = csv.reader(lines, delimiter="\t" if fmt == "tsv" else ",", strict=True)
        _raise_field_limit()
        try:
            next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise ValueError(f"{path}: cannot read the CSV header: {e}") from None
        while True:
            lines.taken = []
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                (line_no, _), *swallowed = lines.taken
                yield line_no, None, _csv_error(line_no, e, swallowed)
                lines.read_again(swallowed)
                continue
            if fields:  # csv yields [] for a blank line
                yield lines.taken[0][0], fields, None


def _csv_error(line_no: int, error: csv.Error, swallowed: list[tuple[int, str]]) -> str:
    if str(error) == "unexpected end of data":
        return f"line {line_no} has a quote that never closes (the field would run to the end of the file)"
    ran_on = f" (a quoted field ran on to line {swallowed[-1][0]})" if swallowed else ""
    return f"line {line_no} is not valid CSV: {error}{ran_on}"


def _raise_field_limit() -> None:
    # The default (128 KiB) turns long prompts into errors; a very long prompt should reach the
    # engine and fail there with "longer than max_model_len", which says what to change.
    csv.field_size_limit(1 << 30)


# JSONL has no schema: the keys of its first rows stand for one (a field none of them has is a typo).
JSONL_SAMPLE_ROWS = 100


def input_columns(path: str, fmt: str) -> list[str] | None:
    """The columns every row has (the CSV header, the Parquet schema); for JSONL the keys its first
    ``JSONL_SAMPLE_ROWS`` rows have between them (None if none of them is an object); None for
    OpenAI batch files, whose lines are requests."""
    if fmt in ("csv", "tsv"):
        return _csv_header(path, fmt)
    if fmt == "parquet":
        return list(_parquet_file(path).schema_arrow.names)
    if fmt == "jsonl":
        keys: dict[str, None] = {}
        for raw in itertools.islice(_jsonl_rows(path), JSONL_SAMPLE_ROWS):
            keys.update(dict.fromkeys(raw.record or ()))
        return list(keys) if keys else None
    return None


def _csv_header(path: str, fmt: str) -> list[str]:
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        try:
            header = next(csv.reader(f, delimiter="\t" if fmt == "tsv" else ","))
        except StopIteration:
            return []
    bad = [h for h in header if _has_surrogates(h)]
    if bad:
        raise ValueError(f"{path}: the CSV header is not valid UTF-8")
    if len(set(header)) != len(header):
        dupes = sorted({h for h in header if header.count(h) > 1})
        raise ValueError(f"{path}: the CSV header repeats column(s) {dupes}")
    return header


def _csv_rows(path: str, fmt: str, size: int | None = None) -> Iterator[RawRow]:
    header = _csv_header(path, fmt)
    for index, (line_no, fields, error) in enumerate(_csv_records(path, fmt, size)):
        where = f"line {line_no}"
        if error is not None:
            yield RawRow(index, None, error, where)
        elif len(fields) != len(header):  # type: ignore[arg-type]
            yield RawRow(index, None, f"{where} has {len(fields)} fields but the header has {len(header)}", where)  # type: ignore[arg-type]
        elif any(_has_surrogates(v) for v in fields):  # type: ignore[union-attr]
            yield RawRow(index, None, f"{where} is not valid UTF-8", where)
        else:  # an empty cell is a missing value, as a null is in Parquet or JSON
            yield RawRow(index, {name: value if value != "" else None for name, value in zip(header, fields)}, None, where)  # type: ignore[arg-type]


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# --- Parquet -----------------------------------------------------------------------------------


def _parquet_file(path: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError flavours
        raise ValueError(f"{path} is not a readable Parquet file: {e}") from None


def _parquet_rows(path: str) -> Iterator[RawRow]:
    index = 0
    for batch in _parquet_file(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for record, error in _batch_records(batch):
            where = f"record {index}"
            yield RawRow(index, record, f"{where}: {error}" if error else None, where)
            index += 1


def _batch_records(batch: Any) -> list[tuple[dict[str, Any] | None, str | None]]:
    """A record batch's rows as dicts; when a value has no Python form (a timestamp past the year
    9999, say), the batch is converted a row at a time and only the rows holding one fail."""
    try:
        return [(record, None) for record in batch.to_pylist()]
    except (ValueError, OverflowError, TypeError):
        pass
    rows: list[tuple[dict[str, Any] | None, str | None]] = []
    for i in range(batch.num_rows):
        record: dict[str, Any] = {}
        for name, column in zip(batch.schema.names, batch.columns):
            try:
                record[name] = column[i].as_py()
            except (ValueError, OverflowError, TypeError) as e:
                rows.append((None, f"column {name!r} holds a value Python cannot represent ({type(e).__name__}: {e})"))
                break
        else:
            rows.append((record, None))
    return rows
