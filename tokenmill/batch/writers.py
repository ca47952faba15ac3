"""Output files: append-only JSONL with an fsync policy, and Parquet finalized from a JSONL staging file.

Every result is appended as one or more complete JSON lines in a single write, so a crash can
only leave a torn *tail*, which the journal (journal.py) cuts off on resume.

Parquet files cannot be appended to, and a half-written one is unreadable. So a Parquet output
is written in two phases: results are appended to ``staging.jsonl`` in the job's sidecar folder,
under the same journal as a JSONL output; when every row is done, the staging file is converted
in bounded chunks to ``OUTPUT.tmp`` and renamed over OUTPUT. A crash during conversion leaves the
staging file intact and the next run converts again; OUTPUT is never seen half-written.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from tokenmill.host_cpus import usable_cpus

_PARQUET_CHUNK_ROWS = 8192


def output_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if ext in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"cannot tell the output format of {path!r} from its extension; use .jsonl or .parquet")


def check_output_path(output: str) -> None:
    """An output is one regular file: never a folder (``--overwrite`` would delete it) and never a
    symbolic link (a Parquet output is renamed into place, which would replace the link)."""
    if os.path.islink(output):
        raise ValueError(f"{output} is a symbolic link (to {os.readlink(output)}); give the real path as the output")
    if os.path.isdir(output):
        raise ValueError(f"{output} is a directory; give the output file's path (.jsonl or .parquet)")


def sidecar_dir(output: str) -> str:
    """The folder of an output's resume state (journal.py)."""
    return f"{output}.tokenmill"


def is_output_file(path: str, output: str) -> bool:
    """Whether ``path`` is one of the files a job writes for ``output`` (both spelled alike, e.g.
    absolute): the output, its Parquet ``.tmp``, its sidecar folder or a file in it."""
    sidecar = sidecar_dir(output)
    return path in (output, f"{output}.tmp", sidecar) or path.startswith(sidecar + os.sep)


def describe_file_error(error: OSError, input_path: str, output: str) -> str:
    """What failed (reading the input or writing the output), why, and what to do about it."""
    path = error.filename
    reading = path is not None and os.path.abspath(path) == os.path.abspath(input_path)
    # An error that names no file comes from a write to an open descriptor: the output's or its journal's.
    ours = path is None or is_output_file(os.path.abspath(path), os.path.abspath(output))
    what = f"cannot read {input_path}" if reading else (f"cannot write {output}" if ours else f"cannot use {path}")
    detail = error.strerror or str(error)
    if path is not None and ours and os.path.abspath(path) != os.path.abspath(output):
        detail += f" ({path})"
    if isinstance(error, FileChangedError):
        advice = "rerun the same command: the rows the file lost run again"
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = "free some space, then rerun the same command: it continues where this one stopped"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = "choose an output in a folder you can write to" if ours and not reading else "check its permissions"
    else:
        advice = "fix that, then rerun the same command: it continues where this one stopped"
    return f"{what}: {detail}; {advice}"


def encode_lines(records: Iterable[dict[str, Any]]) -> bytes:
    """Records as UTF-8 JSON lines. Text that cannot be UTF-8 (lone surrogates) is escaped, not lost.
    A float32 numpy vector anywhere in a record (an embedding) is written as ``float32_json`` makes
    it, the vectors of every record given in one pass: json.dumps leaves a placeholder for each
    (its ``default``), a string no input can hold (a fresh random nonce), replaced afterwards."""
    nonce = secrets.token_hex(8)
    vectors: list[np.ndarray] = []

    def placeholder(value: Any) -> str:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        vectors.append(value)
        return f"\x00{nonce}:{len(vectors) - 1}"

    lines: list[bytes] = []
    held: list[tuple[int, int, int]] = []  # (line, its first vector, the vector after its last)
    for record in records:
        seen = len(vectors)
        try:
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=placeholder).encode("utf-8")
        except UnicodeEncodeError:
            del vectors[seen:]
            line = json.dumps(record, separators=(",", ":"), default=placeholder).encode("ascii")
        if len(vectors) > seen:
            held.append((len(lines), seen, len(vectors)))
        lines.append(line)
    if vectors:
        texts = float32_json(vectors)
        marker = f'"\\u0000{nonce}:'.encode("ascii")  # as json.dumps escapes the placeholder's NUL
        for at, first, end in held:
            # One split a line, its placeholders in the order json.dumps met them: a replace a vector
            # rescanned the whole line each time (an OpenAI embeddings line of 2,000 vectors: 10.7 s).
            pieces = lines[at].split(marker)
            for k, i in enumerate(range(first, end), start=1):
                pieces[k] = texts[i] + pieces[k][len(b"%d\"" % i):]
            lines[at] = b"".join(pieces)
    return b"\n".join(lines) + b"\n" if lines else b""


def float32_json(vectors: list["np.ndarray"]) -> list[bytes]:
    """Each float32 vector as a JSON array of its values' shortest decimals that read back as the same
    float32s, made by Arrow for all the vectors at once: ~3x faster than json.dumps of their Python
    floats, whose float64 decimals run to 17 digits, and 40% fewer bytes (docs/perf.md 106). Exact
    integers keep a ".0" (JSON readers see floats); NaN and infinities, which JSON cannot hold, are
    written null, as pydantic's JSON (vLLM's run-batch) writes them (the job never gets here with
    one: such a row fails, batch/pooling.py). Many vectors are cast in slices on several threads (Arrow releases the
    GIL; one thread's cast was ~30% of an embedding job's host time a row: docs/perf.md 107)."""
    flat = [np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for v in vectors]
    if flat and np.isfinite(np.concatenate(flat)).all():
        finite = [True] * len(flat)
    else:
        finite = [bool(np.isfinite(v).all()) for v in flat]
    kept = [v for v, ok in zip(flat, finite) if ok]
    values = sum(len(v) for v in kept)
    threads = min(usable_cpus(), _MOST_THREADS, values // _VALUES_A_THREAD, len(kept))
    if threads <= 1:
        arrays = _arrow_json(kept)
    else:
        from concurrent.futures import ThreadPoolExecutor

        bounds = np.linspace(0, len(kept), threads + 1).astype(int)  # slices of whole vectors, in order
        with ThreadPoolExecutor(threads) as pool:
            arrays = [text for part in pool.map(_arrow_json, [kept[a:b] for a, b in zip(bounds, bounds[1:])]) for text in part]
    made = iter(arrays)
    return [next(made) if ok else _with_nulls(v) for v, ok in zip(flat, finite)]


def _with_nulls(vector: "np.ndarray") -> bytes:
    """A vector holding NaN or infinities as JSON: those values null (rare: one Python float a value)."""
    return json.dumps([x if math.isfinite(x) else None for x in vector.tolist()], separators=(",", ":")).encode("ascii")


_VALUES_A_THREAD = 1 << 16  # ~2-4 ms of Arrow's cast: worth a thread of its own
_MOST_THREADS = 8


def _arrow_json(vectors: list["np.ndarray"]) -> list[bytes]:
    """Finite float32 vectors as JSON arrays, in one Arrow pass (made as bytes: no text decoded)."""
    if not vectors:
        return []
    import pyarrow as pa
    import pyarrow.compute as pc

    values = np.concatenate(vectors)
    text = pc.cast(pa.array(values), pa.string())
    if (values == np.trunc(values)).any():  # Arrow writes 1.0 as "1"
        text = pc.if_else(pc.match_substring_regex(text, r"^-?[0-9]+$"), pc.binary_join_element_wise(text, ".0", ""), text)
    offsets = pa.array(np.cumsum([0] + [len(v) for v in vectors]), pa.int64())
    raw = pa.large_binary()
    joined = pc.binary_join(pa.LargeListArray.from_arrays(offsets, text.cast(raw)), pa.scalar(b",", raw))
    return pc.binary_join_element_wise(pa.scalar(b"[", raw), joined, pa.scalar(b"]", raw), pa.scalar(b"", raw)).to_pylist()


class FileChangedError(OSError):
    """A file the job appends to was cut, extended, removed or replaced by another process."""


class AppendFile:
    """A file opened for appending at a known length; `sync` is fsync.

    An OSError from a write or an fsync names the file (the data file's or the journal's: the
    message says which). Before each write and fsync the file at ``path`` must still be the one
    opened, at the length this process wrote: another process that cut it would leave a hole of
    NULs where the rows were, one that removed or renamed it would leave the rows written on where
    nobody reads them, and the journal would still say they are there. One stat a call, beside a
    commit's writes."""

    def __init__(self, path: str, expected_size: int):
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        stat = os.fstat(fd)
        if stat.st_size != expected_size:
            os.ftruncate(fd, expected_size)  # cut a torn or uncommitted tail
        os.lseek(fd, expected_size, os.SEEK_SET)
        self._file = os.fdopen(fd, "wb", buffering=0)
        self._identity = (stat.st_dev, stat.st_ino)
        self.size = expected_size

    def write(self, data: bytes) -> None:
        self._check_unchanged()
        view = memoryview(data)
        try:
            while view:  # an unbuffered write may be short
                written = self._file.write(view)
                view = view[written:]
        except OSError as e:
            raise _naming(e, self.path) from None
        except BaseException:
            # An interrupt (a second Ctrl-C) is raised once the write call it arrived during has returned,
            # so bytes may have reached the file uncounted. They are ours: count what the file holds, or
            # the stop's last fsync would take them for another process's change. Uncommitted bytes
            # are cut or read back by the next run's replay, like a crash's.
            self.size = os.fstat(self._file.fileno()).st_size
            raise
        self.size += len(data)

    def sync(self) -> None:
        self._check_unchanged()
        try:
            os.fsync(self._file.fileno())
        except OSError as e:
            raise _naming(e, self.path) from None

    def _check_unchanged(self) -> None:
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            raise FileChangedError(None, "another process removed it while the job ran", self.path) from None
        if (named.st_dev, named.st_ino) != self._identity:
            raise FileChangedError(None, "another process replaced it (renamed another file over it) while the job "
                                         "ran", self.path)
        # The length through our own descriptor: the file we write, not a name's possibly cached attributes.
        size = os.fstat(self._file.fileno()).st_size
        if size != self.size:
            raise FileChangedError(None, f"another process changed its length while the job ran ({size} "
                                         f"bytes, where the job had written {self.size})", self.path)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _naming(error: OSError, path: str) -> OSError:
    """``error`` with ``path`` as its file: a write to a descriptor names none."""
    return error if error.filename is not None else OSError(error.errno, error.strerror or str(error), path)


def iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def generic_parquet_schema(with_lora: bool = False) -> Any:
    """The generation records' schema; ``with_lora`` (a job with LoRA adapters) adds ``lora``."""
    import pyarrow as pa

    return pa.schema([
        ("row", pa.int64()), ("id", pa.string()), ("sample_index", pa.int32()), ("text", pa.string()),
        ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
        ("cumulative_logprob", pa.float64()), ("prompt_logprob", pa.float64()),
        ("prompt_token_logprobs", pa.list_(pa.float32())), ("error", pa.string()),  # float32 at the source: exact
        *([("lora", pa.string())] if with_lora else []),
    ])


def jsonl_to_parquet(staging: str, output: str, schema: Any = None) -> int:
    """Convert records from a staging JSONL into a Parquet file, atomically; returns rows written.

    ``schema`` defaults to the generic (generation) one. ``id`` is stored as a string (ids may be
    ints in one row and strings in another).
    """
    import pyarrow.parquet as pq

    schema = schema if schema is not None else generic_parquet_schema()
    tmp = f"{output}.tmp"
    written = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        chunk: list[dict[str, Any]] = []
        for record in iter_jsonl(staging):
            if record.get("id") is not None:
                record["id"] = str(record["id"])
            chunk.append(record)
            if len(chunk) >= _PARQUET_CHUNK_ROWS:
                writer.write_table(_parquet_table(chunk, schema))
                written += len(chunk)
                chunk = []
        if chunk or written == 0:
            writer.write_table(_parquet_table(chunk, schema))
            written += len(chunk)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)
    fsync_dir(os.path.dirname(os.path.abspath(output)))
    return written


def _parquet_table(records: list[dict[str, Any]], schema: Any) -> Any:
    """Records as an Arrow table. Parquet strings are UTF-8: a lone surrogate (an id or an input
    value quoted in an error, read from a file that was not valid UTF-8) is written escaped, as
    ``\\udc80``, instead of making the output impossible to finish."""
    import pyarrow as pa

    try:
        return pa.Table.from_pylist(records, schema=schema)
    except UnicodeEncodeError:
        return pa.Table.from_pylist([{k: _utf8(v) for k, v in r.items()} for r in records], schema=schema)


def _utf8(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
