"""Progress on stderr while the job runs, and the summary when it ends.

The ETA counts tokens, not rows: rows differ wildly in length, so "half the rows are done" says
little about time. Each row's generation is bounded by its max_tokens; a row is expected to use
the fraction of its bound that finished rows used, and a row still running past that is expected
to use what the finished rows that ran that long used, or its whole bound if none did. The time
left is the largest of three estimates, each at this run's recent rate:

    prompt tokens left / prompt tokens per second
    generated tokens left / generated tokens per second
    the longest running row's tokens left / steps per second   (one token per row per step)

(With several engines side by side, ``--replicas``, their steps add up: a row advances at one
engine's step rate, the total over ``engines``.)

The last one matters at the tail, when the few long rows left decide the time. On a terminal the
line is redrawn in place a few times a second; otherwise (a log file, CI) a plain line is printed
every ``log_interval`` seconds.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, TextIO

_RATE_WINDOW_S = 30.0  # rates over the last half minute: they follow the run as its mix of work changes
_FRACTIONS_KEPT = 1024  # finished rows whose use of their bound refines the estimate (memory stays flat)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


@dataclass
class Snapshot:
    rows_done: int  # including rows finished by earlier attempts
    rows_total: int | None
    failed: int
    prompt_tps: float
    generated_tps: float
    eta_s: float | None


@dataclass
class _Row:
    """A row inside the engine: its generation bound, and what it did so far."""

    bound: int  # tokens it may generate at most (max_tokens x samples)
    samples: int
    prompt: int = 0
    generated: int = 0


class Progress:
    def __init__(self, total_rows: int | None, resumed_rows: int = 0, stream: TextIO | None = None,
                 enabled: bool = True, log_interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 engines: int = 1):
        self.total_rows = total_rows
        self.engines = max(engines, 1)  # engines whose steps are counted (replicas)
        self.resumed_rows = resumed_rows
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.25 if self.tty else log_interval
        self.rows_done = 0  # this run, failed ones included
        self.failed = 0
        self.prompt_tokens = 0  # prompts processed (counted once a request produced output)
        self.generated_tokens = 0  # all generated, in flight or finished
        self.steps = 0
        self.rows: dict[Any, _Row] = {}  # in flight
        self._bounds = [0.0, 0.0, 0]  # submitted rows: sum of bounds, sum of bounds per sample, count
        self._prompts = [0, 0]  # sum and count of prompt lengths seen
        self._fractions: deque[float] = deque(maxlen=_FRACTIONS_KEPT)  # finished rows: generated / bound
        self.start = clock()

    @property
    def start(self) -> float:
        return self._start

    @start.setter
    def start(self, value: float) -> None:
        """(Re)start the clock: rates are measured from here (the job sets it once the model is loaded)."""
        self._start = self._last_draw = value
        self._history: deque[tuple[float, int, int, int]] = deque([(value, self.prompt_tokens, self.generated_tokens, self.steps)])

    @property
    def inflight(self) -> int:
        return len(self.rows)

    # --- events from the job -------------------------------------------------------------------

    def on_submitted(self, key: Any, bound: int, samples: int = 1) -> None:
        """A row entered the engine; it may generate ``bound`` tokens at most (0 for pooling rows)."""
        row = self.rows[key] = _Row(bound, max(samples, 1))
        self._bounds[0] += bound
        self._bounds[1] += bound / row.samples
        self._bounds[2] += 1

    def on_tokens(self, key: Any, prompt: int, generated: int) -> None:
        """Tokens an in-flight row processed this step (``prompt`` once, at its first output)."""
        row = self.rows.get(key)
        if row is not None:
            row.prompt += prompt
            row.generated += generated
        if prompt:
            self._prompts[0] += prompt
            self._prompts[1] += 1
        self.prompt_tokens += prompt
        self.generated_tokens += generated

    def on_step(self) -> None:
        self.steps += 1

    def on_row_done(self, key: Any, failed: bool) -> None:
        """A row finished (``key`` None: it never reached the engine, e.g. a row that failed to parse)."""
        self.rows_done += 1
        self.failed += failed
        row = self.rows.pop(key, None)
        if row is not None and not failed and row.bound > 0:
            self._fractions.append(min(row.generated / row.bound, 1.0))

    def on_dropped(self, key: Any) -> None:
        """A row was taken out of the engine unfinished (to run again): its work is left again."""
        self.rows.pop(key, None)

    # --- figures -------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        now = self.clock()
        elapsed = max(now - self.start, 1e-9)
        rates = self._rates(now)
        return Snapshot(
            rows_done=self.resumed_rows + self.rows_done,
            rows_total=self.total_rows,
            failed=self.failed,
            prompt_tps=self.prompt_tokens / elapsed,
            generated_tps=self.generated_tokens / elapsed,
            eta_s=self._eta(rates),
        )

    def _rates(self, now: float) -> tuple[float, float, float] | None:
        """Prompt tokens, generated tokens and steps per second over the last ``_RATE_WINDOW_S``."""
        totals = (self.prompt_tokens, self.generated_tokens, self.steps)
        history = self._history
        if now - history[-1][0] >= 1.0:
            history.append((now, *totals))
        while len(history) > 1 and now - history[1][0] >= _RATE_WINDOW_S:
            history.popleft()
        then, *before = history[0]
        span = now - then
        if span <= 0 or totals[2] == before[2]:
            return None
        return tuple((t - b) / span for t, b in zip(totals, before))  # type: ignore[return-value]

    def _eta(self, rates: tuple[float, float, float] | None) -> float | None:
        if self.total_rows is None:
            return None
        not_started = self.total_rows - self.resumed_rows - self.rows_done - self.inflight
        if not_started + self.inflight <= 0:
            return 0.0
        if rates is None:
            return None
        prompt_rate, generated_rate, step_rate = rates
        step_rate /= self.engines
        expected = _Expectation(self._fractions)
        generated_left, longest = 0.0, 0.0
        for row in self.rows.values():
            left = max(expected.fraction_after(row.generated / row.bound) * row.bound - row.generated, 0.0) if row.bound else 0.0
            generated_left += left
            longest = max(longest, left / row.samples)
        if not_started and self._bounds[2]:  # rows not submitted yet: like the average submitted one
            new = expected.fraction_after(0.0) / self._bounds[2]
            generated_left += not_started * new * self._bounds[0]
            longest = max(longest, new * self._bounds[1])
        unprefilled = not_started + sum(1 for row in self.rows.values() if not row.prompt)
        prompt_left = unprefilled * (self._prompts[0] / self._prompts[1] if self._prompts[1] else 0.0)
        estimates = [0.0]
        for work, rate in ((prompt_left, prompt_rate), (generated_left, generated_rate), (longest, step_rate)):
            if work > 0:
                if rate <= 0:
                    return None
                estimates.append(work / rate)
        return max(estimates)

    def line(self) -> str:
        s = self.snapshot()
        if s.rows_total:
            rows = f"rows {s.rows_done}/{s.rows_total} ({100.0 * s.rows_done / s.rows_total:.1f}%)"
        else:
            rows = f"rows {s.rows_done}"
        eta = "--" if s.eta_s is None else format_duration(s.eta_s)
        failed = f" | failed {s.failed}" if s.failed else ""
        return f"{rows}{failed} | prompt {s.prompt_tps:,.0f} tok/s | gen {s.generated_tps:,.1f} tok/s | ETA {eta}"

    # --- drawing -------------------------------------------------------------------------------

    def counts_due(self) -> bool:
        """Whether the next ``maybe_draw`` draws: the job then tells the running rows' tokens first."""
        return self.enabled and self.clock() - self._last_draw >= self.interval

    def maybe_draw(self) -> None:
        now = self.clock()
        if self.enabled and now - self._last_draw >= self.interval:
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        self._write("\r\x1b[2K" + self.line() if self.tty else self.line() + "\n")

    def close(self) -> None:
        if self.enabled and self.tty:
            self._draw()
            self._write("\n")

    def _write(self, text: str) -> None:
        """A progress line is a courtesy: a stream that went away (a closed pipe, a log shipper that
        restarted) turns the lines off instead of stopping the job."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # ValueError: the stream was closed
            self.enabled = False


def tell(message: str, stream: TextIO) -> None:
    """A line for the person watching (a notice, the summary); a stream that went away (a closed
    pipe, a log shipper that restarted) does not stop the job."""
    try:
        print(message, file=stream, flush=True)
    except (OSError, ValueError):  # ValueError: the stream was closed
        pass


class _Expectation:
    """How much of its bound a row uses, from the finished rows: overall, or given it ran this far."""

    def __init__(self, fractions: deque[float]):
        self.sorted = sorted(fractions)
        self.sums = [0.0, *itertools.accumulate(self.sorted)]

    def fraction_after(self, used: float) -> float:
        """The expected final fraction of a row that has used ``used`` of its bound and goes on: the
        mean over finished rows that went further, or the whole bound when none did."""
        first = bisect.bisect_right(self.sorted, used) if used > 0 else 0
        count = len(self.sorted) - first
        return (self.sums[-1] - self.sums[first]) / count if count else 1.0
