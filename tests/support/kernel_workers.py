"""The worker processes of ``test_kernels_interpret.py``, from the pytest side and the workers' side.

Two interpreter workers share the selected cases: each takes the next case no worker has taken yet
whenever it finishes one (a counter in a file, under a lock), so they finish together however long
each case turns out to be. A third worker compiles the sm_90 cases (``kernel_compile_sm90.py``).

A session starts them as soon as its tests are collected and runs the kernel tests last
(``conftest.py``); the workers run at the lowest priority: the in-process tests keep one core busy
and leave the other mostly idle, which the workers take meanwhile, and the kernel tests collect the
results at the end. Their output goes to files, not pipes: nobody reads a pipe while the other
tests run, and a full one would stop the worker.
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
        folder = Path(self._dir.name)
        queue = folder / "next-case"
        queue.write_text("0")
        self._procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        for i in range(min(2, len(interpreted))):
            self._start(folder / f"interpreter-{i}.log", interpreter_script, interpreted, queue, interpret=True)
        if compiled:
            self._start(folder / "compile.log", compile_script, compiled, None, interpret=False)
        self._results: dict[str, str | None] | None = None

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


def lower_priority() -> None:
    """A worker's first step: the lowest CPU priority, so that the tests running beside it keep theirs."""
    os.nice(19)


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
