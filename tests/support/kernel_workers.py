"""The worker processes of ``test_kernels_interpret.py``, from the pytest side and the workers' side.

The interpreter workers share the selected cases: each takes the next case no worker has taken yet
whenever it finishes one (a counter in a file, under a lock), so they finish together however long
each case turns out to be. Another worker compiles the sm_90 cases (``kernel_compile_sm90.py``).

A session starts one interpreter worker and the compile worker as soon as its tests are collected,
and runs the kernel tests last (``conftest.py``): the other tests run one torch thread and leave
the second core mostly idle, which the worker takes meanwhile. When the kernel tests' turn comes, a
second interpreter worker joins for the cases left. (One worker beside the tests, not two at a lower
priority: a niced worker starves on a machine that other jobs keep busy.) Their output goes to
files, not pipes: nobody reads a pipe while the other tests run, and a full one would stop the worker.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

RESULT_PREFIX = "KERNEL-RESULTS:"
_REPO = Path(__file__).resolve().parents[2]


class KernelWorkers:
    """The running workers of one session's cases; ``results()`` waits for them and reads their reports."""

    def __init__(self, interpreted: list[str], compiled: list[str], interpreter_script: Path, compile_script: Path) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="tokenmill-kernel-workers-")
        self._folder = Path(self._dir.name)
        self._queue = self._folder / "next-case"
        self._queue.write_text("0")
        self._interpreted, self._interpreter_script = interpreted, interpreter_script
        self._procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        if interpreted:
            self._start_interpreter()
        if compiled:
            self._start(self._folder / "compile.log", compile_script, compiled, None, interpret=False)
        self._results: dict[str, str | None] | None = None

    def _start_interpreter(self) -> None:
        log = self._folder / f"interpreter-{len(self._procs)}.log"
        self._start(log, self._interpreter_script, self._interpreted, self._queue, interpret=True)

    def _start(self, log: Path, script: Path, names: list[str], queue: Path | None, interpret: bool) -> None:
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = "1"
        command = [sys.executable, str(script), "--worker", json.dumps(names), *([str(queue)] if queue else [])]
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=_REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)
        self._procs.append((proc, log))

    def results(self, timeout: float = 900) -> dict[str, str | None]:
        """Each case's traceback, None where it passed ("SKIP: ..." where it skipped), once every
        worker has finished (``timeout``: seconds from this call)."""
        if self._results is None:
            if int(self._queue.read_text()) < len(self._interpreted):  # cases left: a second worker takes some
                self._start_interpreter()
            results: dict[str, str | None] = {}
            for proc, log in self._procs:
                proc.wait(timeout=timeout)
                output = log.read_text(errors="replace")
                line = next((ln for ln in reversed(output.splitlines()) if ln.startswith(RESULT_PREFIX)), None)
                if line is None:
                    raise RuntimeError(f"kernel worker died (rc {proc.returncode}):\n{output[-4000:]}")
                results.update(json.loads(line[len(RESULT_PREFIX):]))
            self._results = results
        return self._results

    def stop(self) -> None:
        """End the workers still running (a session stopped early) and remove their files."""
        for proc, _ in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._dir.cleanup()


def claimed(names: list[str], queue: Path | None) -> Iterator[str]:
    """The cases a worker runs: one at a time, the next of ``names`` that no worker has taken yet
    (``queue`` holds the index of that one; workers take it under a file lock); without a queue, all."""
    if queue is None:
        yield from names
        return
    while True:
        with queue.open("r+") as counter:
            fcntl.flock(counter, fcntl.LOCK_EX)
            index = int(counter.read())
            counter.seek(0)
            counter.write(str(index + 1))
            counter.truncate()
        if index >= len(names):
            return
        yield names[index]
