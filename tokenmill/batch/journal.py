"""Resume state: which rows are done, how much of the output is committed, and with which settings.

Beside OUTPUT lives a sidecar folder ``OUTPUT.tokenmill/``:

    state.json     written once, atomically, before any result: the settings fingerprint (model,
                   sampling values, prompt settings, a digest of the input file...), the settings
                   themselves (to say what changed), and at the end ``complete`` plus the summary.
    journal.jsonl  one line per commit: {"start": <where its lines begin>, "end": <committed length of
                   the data file>, "rows": [...], "failed": [...], "ptok": n, "gtok": n}.
    staging.jsonl  the data file of a Parquet output (a JSONL output is its own data file).
    lock           flock'ed while a run writes, so two runs never interleave.

A first attempt that ends in an error before any row is written (a refused model or flag) removes
the folder and the empty output it made, so a refused run leaves the output location as it found it.

A commit appends the results' lines to the data file, then one journal line naming the new end.
On resume the journal is replayed up to its last complete line whose ``end`` the data file
reaches and whose ``start`` is where the line before it ended (a line deleted from the journal by
hand breaks the chain there). The data file's line that ends where the replay ended must be a
record of the last row replayed; if it is not, the output was edited (lines deleted or changed in
length) and the journal no longer describes it, so every row is read back from the output instead,
as for a lost journal. Past that end, the data file's complete lines are read back (each names its
row): lines a crash wrote before their journal entry, or everything after a journal line that was
damaged, and all of it when the journal was deleted or emptied. The first line that does not read as a result
(a half-written line, bytes lost to a power failure) ends what is trusted; the row whose lines come
just before it is dropped too (a row with n > 1 samples may be cut between them), and the file is
cut there. So every row is in the output exactly once, and a finished row is never lost to a
journal that fell behind. A missing or damaged ``state.json`` cannot be rebuilt (it holds the
settings), and the error says so.

Durability: lines reach the OS on every commit, so a killed process (even ``kill -9``) loses
nothing committed. fsync (data first, then journal) runs at most every ``fsync_interval``
seconds and at the end, which bounds what a power failure can cost.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from tokenmill.batch.writers import AppendFile, sidecar_dir, write_atomic

STATE_VERSION = 1


class ResumeError(ValueError):
    """The output cannot be resumed as asked (settings changed, not ours, in use)."""


# One output record -> (row index, failed, the row's prompt tokens, this record's generated tokens),
# or None when the record is not a result; rebuilds a lost journal from the data file.
RecordReader = Callable[[dict[str, Any]], "tuple[int, bool, int, int] | None"]


@dataclass
class Tally:
    rows: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, rows: int, failed: int, prompt_tokens: int, completion_tokens: int) -> None:
        self.rows += rows
        self.failed += failed
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens


def fingerprint(settings: dict[str, Any]) -> str:
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


class Journal:
    """The resume state of one output; use `Journal.open`."""

    def __init__(self, output: str, data_path: str, state: dict[str, Any], lock_fd: int, fsync_interval: float):
        self.output = output
        self.dir = sidecar_dir(output)
        self.data_path = data_path
        self.state = state
        self.fsync_interval = fsync_interval
        self.previous = Tally()  # rows finished by earlier attempts
        self.current = Tally()  # rows finished by this one
        self.repaired_bytes = 0  # torn or uncommitted output cut off on resume
        self.rebuilt_rows: int | None = None  # rows read back from the data file past what the journal recorded
        self._done = bytearray()
        self._lock_fd = lock_fd
        self._data: AppendFile | None = None
        self._journal: AppendFile | None = None
        self._last_sync = time.monotonic()
        # What this attempt made itself (a first attempt): removed again when it ends in an error before
        # any row was written, so a refused run leaves the output location as it found it.
        self._made: list[str] = []

    # --- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, output: str, data_path: str, settings: dict[str, Any], *, overwrite: bool = False,
             fsync_interval: float = 1.0, read_record: RecordReader | None = None) -> "Journal":
        """Start fresh, or resume what a previous attempt with the same settings left.

        ``read_record`` reads an output record back, to rebuild a journal that was deleted.
        """
        folder = sidecar_dir(output)
        made_folder = not os.path.lexists(folder)
        os.makedirs(folder, exist_ok=True)
        lock_fd = _lock(folder, output)
        try:
            state_path = os.path.join(folder, "state.json")
            if overwrite:
                _clear(output, folder)
            state = None
            if os.path.exists(state_path):
                state = _read_state(state_path)
                if not _same_settings(state, settings) and not state.get("complete") and not _has_results(folder, data_path):
                    state = None  # an attempt that wrote nothing (e.g. the model failed to load): nothing to mix
            elif _has_results(folder, os.path.join(folder, "staging.jsonl")):
                raise ResumeError(
                    f"{state_path} is missing, but {folder} holds the results of an earlier attempt: without that "
                    "file its settings are unknown, so resuming could mix results. Pass --overwrite to start over, "
                    "or write to another output"
                )
            if state is None:
                if os.path.isdir(output) or (os.path.exists(output) and os.path.getsize(output) > 0):
                    raise ResumeError(
                        f"{output} exists and was not written by a resumable tokenmill run (there is no {state_path}); "
                        "pass --overwrite to replace it, or choose another output"
                    )
                made_output = not os.path.lexists(data_path)  # (an empty output the user made is kept)
                _clear(output, folder)  # leftovers of a first attempt that died before its state
                state = {"version": STATE_VERSION, "fingerprint": fingerprint(settings), "settings": settings,
                         "created": time.time(), "complete": False, "summary": None}
                write_atomic(state_path, json.dumps(state, indent=1, default=str).encode())
                journal = cls(output, data_path, state, lock_fd, fsync_interval)
                journal._made = [path for path, made in ((data_path, made_output), (folder, made_folder)) if made]
                journal._open_files(0, 0)
                return journal
            _check_same_settings(output, state, settings)
            journal = cls(output, data_path, state, lock_fd, fsync_interval)
            if state.get("complete"):
                if not os.path.exists(output):
                    raise ResumeError(f"{output} was removed after its run completed; pass --overwrite to run again")
                journal.previous = Tally(**state["summary"])
                journal._remove_finished_files()  # a crash in mark_complete may have left them
                return journal
            journal._replay(read_record)
            return journal
        except BaseException:
            os.close(lock_fd)
            raise

    def _replay(self, read_record: RecordReader | None = None) -> None:
        journal_path = os.path.join(self.dir, "journal.jsonl")
        data_size = os.path.getsize(self.data_path) if os.path.exists(self.data_path) else 0
        committed_end, journal_end, last_row = 0, 0, -1
        if os.path.exists(journal_path):
            with open(journal_path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # torn by the crash
                    try:
                        entry = json.loads(line)
                        end, rows, failed = int(entry["end"]), entry["rows"], entry["failed"]
                        start = int(entry.get("start", committed_end))  # journals of older versions have none
                    except (ValueError, KeyError, TypeError):
                        break
                    if end > data_size or end < committed_end:
                        break  # the data never reached the disk (power loss): stop trusting here
                    if start != committed_end or not rows:
                        break  # a line was removed or repeated (edited by hand): the rest is read back
                    for index in rows:
                        self._mark(index)
                    self.previous.add(len(rows), len(failed), int(entry.get("ptok", 0)), int(entry.get("gtok", 0)))
                    committed_end, journal_end, last_row = end, journal_end + len(line), rows[-1]
        if committed_end and read_record is not None and not self._ends_with_row(read_record, committed_end, last_row):
            # The output was edited (lines deleted, or changed in length): the journal's offsets point
            # elsewhere now, and trusting them would lose rows or run them twice. The output decides.
            self._done, self.previous = bytearray(), Tally()
            committed_end = journal_end = 0
        if read_record is not None and data_size > committed_end:
            self._read_back(read_record, committed_end, journal_end, data_size, journal_lost=journal_end == 0)
            return
        self.repaired_bytes = data_size - committed_end
        self._open_files(committed_end, journal_end)

    def _read_back(self, read_record: RecordReader, start: int, journal_end: int, data_size: int,
                   journal_lost: bool) -> None:
        """The data file holds lines past what the journal recorded (from ``start``): read them back.

        Each complete line that reads as a result of a row not recorded yet counts. The first one
        that does not ends what is trusted, and the last row read before it is dropped as well (its
        samples may be cut between lines). The rows found become one journal entry, so the next
        resume replays a journal again.
        """
        found: list[list[Any]] = []  # per row, in file order: [row, failed, prompt tokens, generated tokens, offset]
        seen: set[int] = set()  # the rows in ``found``
        end, cut_short = start, False
        with open(self.data_path, "rb") as f:
            f.seek(start)
            for line in f:
                try:
                    record = read_record(json.loads(line)) if line.endswith(b"\n") else None
                except (ValueError, KeyError, TypeError):
                    record = None
                same_row = record is not None and bool(found) and record[0] == found[-1][0]
                if record is None or (not same_row and (self.is_done(record[0]) or record[0] in seen)):
                    cut_short = True  # not a result, or a row already there: nothing past here is trusted
                    break
                if same_row:  # a later sample of the row (n > 1 writes one record per sample)
                    found[-1][3] += record[3]
                else:
                    found.append([record[0], record[1], record[2], record[3], end])
                    seen.add(record[0])
                end += len(line)
        if cut_short and found:  # the row just before the cut may have lost samples: it runs again
            end = found.pop()[4]
        for row in found:
            self._mark(row[0])
        self.repaired_bytes = data_size - end
        self.rebuilt_rows = len(found) if (found or journal_lost) else None
        self._open_files(end, journal_end)
        if found:
            assert self._journal is not None
            tally = Tally(len(found), sum(bool(r[1]) for r in found), sum(r[2] for r in found), sum(r[3] for r in found))
            entry = {"start": start, "end": end, "rows": [r[0] for r in found], "failed": [r[0] for r in found if r[1]],
                     "ptok": tally.prompt_tokens, "gtok": tally.completion_tokens}
            self._journal.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
            self._journal.sync()
            self.previous.add(**asdict(tally))

    def _ends_with_row(self, read_record: RecordReader, end: int, row: int) -> bool:
        """Whether the data file's line that ends at ``end`` is a record of ``row``."""
        line = _line_before(self.data_path, end)
        try:
            record = json.loads(line) if line is not None else None
            if not isinstance(record, dict):
                return False
            is_row = getattr(read_record, "is_row", None)  # a reader that checks without reading the row
            if is_row is not None:
                return bool(is_row(record, row))
            found = read_record(record)
        except (ValueError, KeyError, TypeError):
            return False
        return found is not None and found[0] == row

    def _open_files(self, data_end: int, journal_end: int) -> None:
        self._data = AppendFile(self.data_path, data_end)
        self._journal = AppendFile(os.path.join(self.dir, "journal.jsonl"), journal_end)

    # --- queries -------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return bool(self.state.get("complete"))

    @property
    def resumed_rows(self) -> int:
        return self.previous.rows

    def is_done(self, index: int) -> bool:
        byte = index >> 3
        return byte < len(self._done) and bool(self._done[byte] & (1 << (index & 7)))

    def done_bitmap(self) -> bytes:
        """The finished rows as a bitmap (bit ``index & 7`` of byte ``index >> 3``), for replicas."""
        return bytes(self._done)

    def _mark(self, index: int) -> None:
        byte = index >> 3
        if byte >= len(self._done):
            self._done.extend(bytes(max(byte + 1 - len(self._done), len(self._done))))
        self._done[byte] |= 1 << (index & 7)

    def total(self) -> Tally:
        t = Tally(**asdict(self.previous))
        t.add(**asdict(self.current))
        return t

    # --- writing -------------------------------------------------------------------------------

    def commit(self, data: bytes, rows: list[int], failed: list[int], prompt_tokens: int, completion_tokens: int) -> None:
        """Append finished rows' lines and record them as done (see the module doc for the order)."""
        assert self._data is not None and self._journal is not None, "the journal is complete or closed"
        if not rows:
            return
        start = self._data.size
        self._data.write(data)
        due = time.monotonic() - self._last_sync >= self.fsync_interval
        if due:
            self._data.sync()
        entry = {"start": start, "end": self._data.size, "rows": rows, "failed": failed, "ptok": prompt_tokens, "gtok": completion_tokens}
        self._journal.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        if due:
            self._journal.sync()
            self._last_sync = time.monotonic()
        for index in rows:
            self._mark(index)
        self.current.add(len(rows), len(failed), prompt_tokens, completion_tokens)

    def sync(self) -> None:
        if self._data is not None and self._journal is not None:
            self._data.sync()
            self._journal.sync()
            self._last_sync = time.monotonic()

    def mark_complete(self) -> None:
        """Record the end of the job; the journal (and a Parquet staging file) are no longer needed."""
        self.sync()
        self._close_files()
        self.state["complete"] = True
        self.state["summary"] = asdict(self.total())
        write_atomic(os.path.join(self.dir, "state.json"), json.dumps(self.state, indent=1, default=str).encode())
        self._remove_finished_files()

    def _remove_finished_files(self) -> None:
        """Delete the journal and a Parquet staging file once the state says complete. A run that finds
        the job complete calls this too: one killed between the two left them, and the staging file
        is a whole second copy of the results."""
        for name in ("journal.jsonl", "staging.jsonl"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                os.remove(path)

    def close(self) -> None:
        self._close_files()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _close_files(self) -> None:
        for f in (self._data, self._journal):
            if f is not None:
                f.close()
        self._data = self._journal = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._close_files()
            self._remove_if_unused()
        self.close()

    def _remove_if_unused(self) -> None:
        """A first attempt that ends in an error before writing any row (the model is unknown, a flag
        is refused as the engine starts) removes the files and folder it made: nothing was done, so
        nothing is left to resume. Anything an earlier attempt made is never touched (``_made`` is empty
        then); still under the lock, so another run cannot have started on them."""
        if not self._made or self.current.rows or _has_results(self.dir, self.data_path):
            return
        for path in self._made:
            with contextlib.suppress(OSError):
                if os.path.isdir(path):
                    for name in os.listdir(path):
                        if name != "lock":  # unlinked last, by the folder's removal below
                            os.remove(os.path.join(path, name))
                else:
                    os.remove(path)
        if self.dir in self._made:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.dir, "lock"))
                os.rmdir(self.dir)


def _lock(folder: str, output: str) -> int:
    fd = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ResumeError(f"another tokenmill run is writing {output} right now") from None
    return fd


def _line_before(path: str, end: int) -> bytes | None:
    """The line of ``path`` that ends (with its newline) at byte ``end``; None if no line ends there."""
    with open(path, "rb") as f:
        f.seek(end - 1)
        if f.read(1) != b"\n":
            return None
        chunks, pos = [], end - 1
        while pos > 0:
            size = min(1 << 16, pos)
            f.seek(pos - size)
            chunk = f.read(size)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                chunks.append(chunk[newline + 1:])
                break
            chunks.append(chunk)
            pos -= size
        return b"".join(reversed(chunks))


def _read_state(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            state = json.load(f)
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ResumeError(
            f"{path} is damaged ({e}), so the settings of the earlier attempt are unknown and resuming could mix "
            "results. Pass --overwrite to start over, or write to another output"
        ) from None
    return state


def _clear(output: str, folder: str) -> None:
    if os.path.isdir(output):  # an output is one file: never delete a folder the user pointed at
        raise ResumeError(f"{output} is a directory; give the output file's path (.jsonl or .parquet)")
    if os.path.exists(output):
        os.remove(output)
    for name in os.listdir(folder):
        if name != "lock":
            path = os.path.join(folder, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _has_results(folder: str, data_path: str) -> bool:
    journal = os.path.join(folder, "journal.jsonl")
    return any(os.path.exists(p) and os.path.getsize(p) > 0 for p in (journal, data_path))


def recorded_settings(output: str) -> dict[str, Any] | None:
    """The settings an earlier attempt at ``output`` recorded, if any (read without the lock)."""
    try:
        with open(os.path.join(sidecar_dir(output), "state.json"), "rb") as f:
            return json.load(f).get("settings")
    except (OSError, ValueError, AttributeError):
        return None


def _same_settings(state: dict[str, Any], settings: dict[str, Any]) -> bool:
    return state.get("version") == STATE_VERSION and state.get("fingerprint") == fingerprint(settings)


_INPUT_KEYS = ("input_digest", "input_size")  # job.job_settings' record of the input file


def _check_same_settings(output: str, state: dict[str, Any], settings: dict[str, Any]) -> None:
    if _same_settings(state, settings):
        return
    before = state.get("settings") or {}
    differs = [key for key in sorted(set(before) | set(settings))
               if json.dumps(before.get(key), default=str, sort_keys=True) != json.dumps(settings.get(key), default=str, sort_keys=True)]
    changed = [f"{key}: {before.get(key)!r} -> {settings.get(key)!r}" for key in differs if key not in _INPUT_KEYS]
    if any(key in _INPUT_KEYS for key in differs):  # a digest pair says nothing: say what it means
        changed.insert(0, f"the input file is not the one the earlier attempt read ({before.get('input_size')} -> "
                          f"{settings.get('input_size')} bytes; rows are matched to the output by their position, so rows "
                          "added, removed, reordered or edited would mix results)")
    changed = changed or ["the resume state was written by another tokenmill version"]
    raise ResumeError(
        f"{output} was started with other settings, so resuming would mix results: "
        + "; ".join(changed[:8])
        + ". Rerun with the original settings to resume, or pass --overwrite to start over."
    )
