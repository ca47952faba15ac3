"""JSON Lines in and out for the batch-job tests: input files of rows (dicts, or raw lines as
strings, for the malformed-line cases) and the records a job wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """One line a row: a dict as JSON, a string as it is."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path | str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [strict_loads(line) for line in f]


def strict_loads(line: str | bytes) -> Any:
    """A JSON value, read strictly: NaN, Infinity and -Infinity (which Python's json reads, but JSON
    has not, so strict readers refuse the whole line) raise."""
    return json.loads(line, parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON: a strict reader refuses this line")
