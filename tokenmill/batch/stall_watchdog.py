"""Ends a `tokenmill run` process whose engine step does not return: a hung kernel, driver or
collective would otherwise hold an expensive machine idle for as long as nobody looks.

A step that never returns cannot be interrupted from Python, so the watchdog (a thread) prints why
and ends the process (exit code 1), as a ``kill -9`` would: the journal makes that safe (every
finished row reached the operating system at its commit; the rows in flight run again when the
same command is rerun), and tensor-parallel workers and replicas stop themselves when their parent
is gone. The limit is ``--stall-timeout`` or ten times the longest step seen so far, whichever is
longer, so a job whose steps are slow (a large model on a CPU) is not cut short by its own pace.
Only steps are timed: the job's own work between them (reading rows, writing results) is not.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

EXIT_STALLED = 1  # the CLI's "the engine failed; finished rows kept, rerun to continue"
_SLOW_STEP_FACTOR = 10.0


class StallWatchdog:
    """Each engine step runs inside ``step()``; only a step is watched (reading and skipping rows on
    a resume, writing results or loading a replacement engine may take what they take). Started and
    stopped as a context manager."""

    def __init__(self, timeout_s: float, stream: TextIO | None = None, exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic, poll_s: float | None = None):
        self.timeout_s = timeout_s
        self.stream, self.exit, self.clock = stream, exit, clock
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.longest_step_s = 0.0
        self._started: float | None = None  # when the step in progress began (None: no step)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tokenmill-stall-watchdog", daemon=True)

    def __enter__(self) -> "StallWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def limit_s(self) -> float:
        return max(self.timeout_s, _SLOW_STEP_FACTOR * self.longest_step_s)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one engine step."""
        self._started = self.clock()
        try:
            yield
        finally:
            self.longest_step_s = max(self.longest_step_s, self.clock() - self._started)
            self._started = None

    def check(self) -> None:
        """End the process if the step in progress has run past the limit (the thread calls this)."""
        started = self._started
        if started is None:
            return
        waited = self.clock() - started
        if waited < self.limit_s:
            return
        print(f"tokenmill run: error: an engine step has not returned for {waited:.0f} s (the limit: "
              f"--stall-timeout {self.timeout_s:g} s, or ten times the longest step so far); the device, its "
              "driver or a tensor-parallel collective looks hung, so the job stops here. The finished rows are "
              "kept: rerun the same command to continue", file=self.stream or sys.stderr, flush=True)
        self.exit(EXIT_STALLED)

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            self.check()
