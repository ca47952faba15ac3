"""Ends a `tokenmill run` process whose engine stopped making steps: a hung kernel, driver or
collective would otherwise hold an expensive machine idle for as long as nobody looks.

A step that never returns cannot be interrupted from Python, so the watchdog (a thread) prints why
and ends the process (exit code 1), as a ``kill -9`` would: the journal makes that safe (every
finished row reached the operating system at its commit; the rows in flight run again when the
same command is rerun), and tensor-parallel workers and replicas stop themselves when their parent
is gone. The limit is ``--stall-timeout`` or ten times the longest step seen so far, whichever is
longer, so a job whose steps are slow (a large model on a CPU) is not cut short by its own pace.
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
    """``beat()`` after every engine step; ``paused()`` around work that is not a step (loading a
    new engine). Started and stopped as a context manager."""

    def __init__(self, timeout_s: float, stream: TextIO | None = None, exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic, poll_s: float | None = None):
        self.timeout_s = timeout_s
        self.stream, self.exit, self.clock = stream, exit, clock
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.longest_step_s = 0.0
        self._last = clock()
        self._paused = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tokenmill-stall-watchdog", daemon=True)

    def __enter__(self) -> "StallWatchdog":
        self._last = self.clock()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def limit_s(self) -> float:
        return max(self.timeout_s, _SLOW_STEP_FACTOR * self.longest_step_s)

    def beat(self) -> None:
        """A step returned."""
        now = self.clock()
        self.longest_step_s = max(self.longest_step_s, now - self._last)
        self._last = now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = self.clock()

    def check(self) -> None:
        """End the process if no step returned within the limit (the thread calls this)."""
        waited = self.clock() - self._last
        if self._paused or waited < self.limit_s:
            return
        print(f"tokenmill run: error: the engine has finished no step for {waited:.0f} s (the limit: "
              f"--stall-timeout {self.timeout_s:g} s, or ten times the longest step so far); the device, its "
              "driver or a tensor-parallel collective looks hung, so the job stops here. The finished rows are "
              "kept: rerun the same command to continue", file=self.stream or sys.stderr, flush=True)
        self.exit(EXIT_STALLED)

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            self.check()
