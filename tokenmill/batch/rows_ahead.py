"""The rows a job has not submitted yet, read ahead of the engine with their prompts made in large batches.

    input rows ──► skip those the journal has ──► batches of ``chunk`` rows: requests built,
                                                  prompts made together (`row_prompts.prepare_rows`)
                   ready rows (input order) ◄─────┘  at most ``rows`` rows / ``tokens`` prompt tokens
                        │
                        └─► take(k): the loop's refill, as slots free in the engine

Why ahead. A refill used to make the prompts of the rows that had just left the engine, a few
hundred between two steps, so the tokenizer's work and the engine's steps took turns all job
long; made in batches of thousands, the tokenizer runs warm for a while and most refills only
hand over rows already made (docs/perf.md 87).

What it keeps. Nothing read ahead is written or journaled: a stop drops the ready rows as it drops
the running ones, and a resumed run reads them again (the journal says which rows are done, so
nothing is lost or done twice). A row whose request or prompt could not be made in its batch
goes on as a plain row, made alone when submitted (`JobLoop._submit`), which writes its own
error. Memory stays bounded whatever the input: at most ``rows`` rows and about ``tokens``
prompt tokens are held, past the rows in the engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tokenmill.batch.readers import RawRow

# What a prepared row carries: its request and prompt, or None when it is made alone at submission.
Prepared = tuple[RawRow, Any]

# The read-ahead's bounds: this many times the rows the job keeps in flight, and about this many
# prompt tokens (~40 MB of token ids as Python ints); ``CHUNK`` rows a prepare call (one tokenizer
# call each: past a few hundred rows a call its cost per row is flat, docs/perf.md 87).
PER_INFLIGHT = 4
TOKENS = 1 << 20
CHUNK = 512
STOP_POLL_S = 0.5  # a stop (SIGTERM, Ctrl-C) waits about this long at most for a read-ahead


class RowsAhead:
    """Input rows not yet done, in input order, each with what ``prepare`` made for it."""

    def __init__(self, rows: Iterator[RawRow], is_done: Callable[[int], bool],
                 prepare: Callable[[list[RawRow]], dict[int, Any]], max_inflight: int, should_stop: Callable[[], bool],
                 *, rows_ahead: int | None = None, tokens_ahead: int = TOKENS, chunk: int = CHUNK,
                 stop_poll_s: float = STOP_POLL_S):
        """``prepare``: a batch of rows' requests and prompts by row index (rows left out are made
        alone). Read ahead when no row is ready: ``chunk`` rows a ``prepare`` call, until
        ``rows_ahead`` rows (``PER_INFLIGHT`` x ``max_inflight``) or ``tokens_ahead`` prompt tokens
        are ready; a read-ahead that has run ``stop_poll_s`` asks ``should_stop`` after each chunk."""
        self._rows, self._is_done, self._prepare = rows, is_done, prepare
        self._rows_ahead = max(1, rows_ahead if rows_ahead is not None else PER_INFLIGHT * max_inflight)
        self._tokens_ahead, self._chunk = tokens_ahead, max(1, chunk)
        self._should_stop, self._stop_poll_s = should_stop, stop_poll_s
        self._ready: deque[Prepared] = deque()
        self._input_done = False

    @property
    def finished(self) -> bool:
        """Every row of the input was taken (or was done already)."""
        return self._input_done and not self._ready

    def take(self, count: int) -> list[Prepared]:
        """Up to ``count`` rows, in input order; fewer only at the end of the input or when the job
        stops during a read-ahead (then those read so far stay, and the loop stops)."""
        taken: list[Prepared] = []
        while len(taken) < count:
            if not self._ready:
                if self._input_done or not self._read_ahead():
                    break
                continue
            taken.append(self._ready.popleft())
        return taken

    def _read_ahead(self) -> bool:
        """Batches of ``chunk`` rows until the bounds, each batch's prompts made in one call; False
        when cut short because the job stops. A short read-ahead never asks (the loop asks once a
        step); a long one (long prompts, a slow tokenizer) asks once it has run ``stop_poll_s``, so
        that a stop waits for one more chunk at most."""
        started, tokens = time.monotonic(), 0
        while not self._input_done and len(self._ready) < self._rows_ahead and tokens < self._tokens_ahead:
            batch: list[RawRow] = []
            while len(batch) < min(self._chunk, self._rows_ahead - len(self._ready)):
                raw = next(self._rows, None)
                if raw is None:
                    self._input_done = True
                    break
                if not self._is_done(raw.index):
                    batch.append(raw)
            made = self._prepare(batch) if batch else {}
            for raw in batch:
                built = made.get(raw.index)
                tokens += _prompt_tokens(built)
                self._ready.append((raw, built))
            if time.monotonic() - started >= self._stop_poll_s and self._should_stop():
                return False
        return True


def _prompt_tokens(built: Any) -> int:
    """A prepared row's prompt length in tokens (0 for one made alone later): the read-ahead's memory."""
    if built is None:
        return 0
    prompt = built[1]
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return len(prompt["prompt_token_ids"])
    return len(prompt) // 4 if isinstance(prompt, str) else 0  # text kept as text: ~4 characters a token
