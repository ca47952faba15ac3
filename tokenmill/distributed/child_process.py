"""Child processes that run a tokenmill module in a fresh interpreter, joined by a socket pair.

Used by the tensor-parallel workers (``tokenmill.distributed.worker_process``) and by the
replicas of ``tokenmill run --replicas`` (``tokenmill.batch.replica_process``). A fresh
interpreter (``python -m MODULE FD``) rather than multiprocessing's spawn: the user's main module
is not re-imported in the child (scripts without an ``if __name__ == "__main__"`` guard work, and
so do notebooks), and no resource tracker process is left behind. The child gets its end of the
pair as file descriptor FD; messages are pickled explicitly (see ``messages.send``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterable

STOP_GRACE_S = 5.0  # a child told to stop exits at once; this bounds one that does not


def start_module(module: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -m module FD PID`` (PID: this process, the parent the child watches with
    `exit_with_parent`); returns the process and this side's end of the pipe.

    The child runs the tokenmill that runs here (its folder goes first on PYTHONPATH), in a new
    session, so a Ctrl-C at the terminal reaches only this process, which stops children in order.
    """
    mine, theirs = socket.socketpair()
    package_root = str(Path(__file__).resolve().parents[2])
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    with theirs:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            env=child_env,
            start_new_session=True,
        )
    return proc, Connection(mine.detach())


def stop_children(procs: Iterable[subprocess.Popen], conns: Iterable[Connection],
                  send_stop: Callable[[Connection], None] | None = None) -> None:
    """``send_stop`` on each pipe (when given) and a grace period, then SIGTERM, then SIGKILL;
    every process is reaped and every pipe closed.

    Interrupted while it waits (a Ctrl-C), it kills and reaps what is left before the interrupt goes
    on: callers mark their children stopped first, so nobody would stop them later."""
    procs, conns = list(procs), list(conns)
    try:
        if send_stop is not None:
            for conn in conns:
                with contextlib.suppress(OSError):
                    send_stop(conn)
        deadline = time.monotonic() + (STOP_GRACE_S if send_stop is not None else 0.0)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:  # only when interrupted: the loop above reaped every process
                proc.kill()
                proc.wait()
        for conn in conns:
            conn.close()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """In a child: exit when the parent process is gone, even if the main thread is stuck (in a
    collective, a model step...). A killed parent cannot stop its children, so they stop themselves.
    ``parent`` is the pid the parent passed (`start_module`), not ``os.getppid()`` read here: a parent
    killed before the child got this far has made init the child's parent already, which never goes."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True).start()

