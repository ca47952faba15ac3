"""Children started by `start_module` (TP workers, `--replicas` replicas) stop when their parent is
gone, also when it died before they began to watch it: by then init is their parent, so the pid to
watch must come from the parent, not from ``os.getppid()``. Stopping them, even when a Ctrl-C
interrupts it, leaves none running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The child: waits until its parent is gone (so it starts watching too late, as a replica still
# reading its set-up would), says which pid it was told to watch, then watches it.
PROBE = """
import os, sys, time
from tokenmill.distributed.child_process import exit_with_parent

while os.getppid() == int(sys.argv[2]):
    time.sleep(0.01)
with open(os.environ["PROBE_OUT"], "w") as f:
    f.write(sys.argv[2])
exit_with_parent(int(sys.argv[2]), poll_s=0.05)
time.sleep(60)
"""

PARENT = """
import os, sys, time
from tokenmill.distributed.child_process import start_module

proc, conn = start_module("orphan_probe", env={**os.environ, "PYTHONPATH": sys.argv[1]})
print(proc.pid, flush=True)
time.sleep(60)
"""


def test_child_exits_when_its_parent_died_before_it_watched(tmp_path):
    (tmp_path / "orphan_probe.py").write_text(textwrap.dedent(PROBE))
    told = tmp_path / "told.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROBE_OUT": str(told)}
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PARENT), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not told.exists() or Path(f"/proc/{child}").exists() and _state(child) not in ("Z", "X"):
        assert time.monotonic() < deadline, f"child {child} outlived its killed parent {parent.pid}"
        time.sleep(0.05)
    assert told.read_text() == str(parent.pid)  # the parent's own pid, passed on its command line


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_stopping_interrupted_by_ctrl_c_still_kills_and_reaps_every_child():
    """A Ctrl-C while `stop_children` waits out a child's grace period (a `del llm` or a failed step
    stopping the workers) must not leave the children running: their owner marks them stopped
    before it calls, so nothing would try again. They are killed and reaped, then the interrupt goes on."""
    import signal
    import socket
    from multiprocessing.connection import Connection

    from tokenmill.distributed.child_process import stop_children

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # Children that ignore the stop message, so stopping them waits out the grace period.
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    pairs = [socket.socketpair() for _ in procs]
    conns = [Connection(mine.detach()) for mine, _ in pairs]
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        try:
            stop_children(procs, conns, lambda conn: conn.send_bytes(b"stop"))
        except KeyboardInterrupt:
            # Read before the clean-up below kills what is left.
            codes, closed = [proc.poll() for proc in procs], [conn.closed for conn in conns]
        else:
            raise AssertionError("the interrupt was swallowed")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _, theirs in pairs:
            theirs.close()
    assert time.monotonic() - started < 3
    assert codes == [-signal.SIGKILL, -signal.SIGKILL] and closed == [True, True]
