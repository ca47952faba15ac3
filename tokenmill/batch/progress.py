"""Progress on stderr while the job runs, and the summary when it ends.

The ETA counts tokens, not rows: rows differ wildly in length, so "half the rows are done"
says little about time. The work left is estimated in prompt tokens and in generated tokens (the
rows left times what a finished row cost on average, minus what the in-flight rows already did),
each divided by this run's rate for that kind of token. On a terminal the line is redrawn in place a few times a second;
otherwise (a log file, CI) a plain line is printed every ``log_interval`` seconds.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO


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


class Progress:
    def __init__(self, total_rows: int | None, resumed_rows: int = 0, stream: TextIO | None = None,
                 enabled: bool = True, log_interval: float = 10.0, clock=time.monotonic):
        self.total_rows = total_rows
        self.resumed_rows = resumed_rows
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.clock = clock
        self.start = clock()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.25 if self.tty else log_interval
        self._last_draw = self.start
        self.rows_done = 0  # this run, failed ones included
        self.failed = 0
        self.prompt_tokens = 0  # prompts processed (counted once a request produced output)
        self.generated_tokens = 0  # all generated, in flight or finished
        self.inflight = 0  # requests inside the engine
        self.inflight_prefilled = 0  # ... whose prompt is done
        self.inflight_generated = 0  # ... tokens they generated so far
        self.finished_ok = 0
        self.finished_prompt = 0
        self.finished_generated = 0

    # --- events from the job -------------------------------------------------------------------

    def on_submitted(self) -> None:
        self.inflight += 1

    def on_tokens(self, prompt: int, generated: int) -> None:
        """Tokens an in-flight row processed this step (``prompt`` once, at its first output)."""
        if prompt:
            self.inflight_prefilled += 1
        self.prompt_tokens += prompt
        self.generated_tokens += generated
        self.inflight_generated += generated

    def on_row_done(self, failed: bool, prompt: int = 0, generated: int = 0, was_inflight: bool = False) -> None:
        """A row finished; ``prompt``/``generated`` are what `on_tokens` reported for it."""
        self.rows_done += 1
        self.failed += failed
        if was_inflight:
            self.inflight -= 1
            self.inflight_prefilled -= prompt > 0
            self.inflight_generated -= generated
        if not failed:
            self.finished_ok += 1
            self.finished_prompt += prompt
            self.finished_generated += generated

    # --- figures -------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        elapsed = max(self.clock() - self.start, 1e-9)
        return Snapshot(
            rows_done=self.resumed_rows + self.rows_done,
            rows_total=self.total_rows,
            failed=self.failed,
            prompt_tps=self.prompt_tokens / elapsed,
            generated_tps=self.generated_tokens / elapsed,
            eta_s=self._eta(elapsed),
        )

    def _eta(self, elapsed: float) -> float | None:
        """Prompt work left at the prompt rate, generation left at the generation rate: the larger.

        Both rates are measured over the same steps, so while the mix of work stays as it was the
        two estimates agree; when it shifts (all prompts admitted, only decoding left) the one
        that still has work left decides.
        """
        if self.total_rows is None or self.finished_ok <= 0:
            return None
        not_started = self.total_rows - self.resumed_rows - self.rows_done - self.inflight
        if not_started + self.inflight <= 0:
            return 0.0
        avg_prompt = self.finished_prompt / self.finished_ok
        avg_generated = self.finished_generated / self.finished_ok
        prompt_left = (not_started + self.inflight - self.inflight_prefilled) * avg_prompt
        generated_left = max((not_started + self.inflight) * avg_generated - self.inflight_generated, 0.0)
        estimates = [0.0]
        if self.prompt_tokens:
            estimates.append(prompt_left * elapsed / self.prompt_tokens)
        if self.generated_tokens:
            estimates.append(generated_left * elapsed / self.generated_tokens)
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

    def maybe_draw(self) -> None:
        now = self.clock()
        if self.enabled and now - self._last_draw >= self.interval:
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
