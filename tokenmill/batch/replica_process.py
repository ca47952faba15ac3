"""One replica of `tokenmill run --replicas N`: ``python -m tokenmill.batch.replica_process FD``.

A replica is the ordinary job loop (`loop.JobLoop`: bounded in-flight requests, a commit per step)
with its own engine, over its shard of the input (the rows whose index % N is its number). Only
the journal and the progress line are not its own: a commit is sent to the parent, which is the
one writer of the output and the journal, and progress calls are forwarded to the parent's line.

The replica ends when its shard is done, when the parent asks it to stop (it then commits what
finished, like a job stopped by Ctrl-C), when the parent's end of the pipe closes, or when the
parent process disappears (a killed parent cannot stop it, so it stops itself).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, Iterator

from tokenmill.batch.replica_messages import (
    Commit, Failed, Finished, ProgressEvents, ProgressRecorder, Ready, ReplicaSetup, StopReplica,
)
from tokenmill.distributed.child_process import exit_with_parent
from tokenmill.distributed.messages import receive, send

_PROGRESS_FLUSH_S = 0.5


class ParentLink(ProgressRecorder):
    """The replica's stand-in for the job's Journal (commits go to the parent) and Progress (its
    calls are forwarded), and its stop flag."""

    def __init__(self, conn: Connection, done: bytes):
        super().__init__(_PROGRESS_FLUSH_S)
        self.conn = conn
        self.done = done
        self.stop_requested = False

    # --- Journal ---------------------------------------------------------------------------------
    def is_done(self, index: int) -> bool:
        byte = index >> 3
        return byte < len(self.done) and bool(self.done[byte] & (1 << (index & 7)))

    def commit(self, data: bytes, rows: list[int], failed: list[int], prompt_tokens: int, completion_tokens: int) -> None:
        self.flush()
        send(self.conn, Commit(data, rows, failed, prompt_tokens, completion_tokens))

    # --- Progress (the rest is ProgressRecorder's) ----------------------------------------------
    def maybe_draw(self) -> None:
        if self.flush_due():
            self.flush()

    def flush(self) -> None:
        events = self.take()
        if events:
            send(self.conn, ProgressEvents(events))

    # --- stop --------------------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """Polled once per step: the parent asked to stop, or its end of the pipe closed."""
        try:
            while not self.stop_requested and self.conn.poll():
                self.stop_requested = isinstance(receive(self.conn), StopReplica)
        except (EOFError, OSError):
            self.stop_requested = True
        return self.stop_requested


def shard_rows(rows: Iterator[Any], shard: int, shards: int) -> Iterator[Any]:
    return (raw for raw in rows if raw.index % shards == shard)


def main(argv: list[str]) -> int:
    # A SIGINT reaching a replica was sent to every process of the job (a scheduler's stop signal to
    # them all; a Ctrl-C at the terminal reaches the parent only: replicas run in their own session).
    # The parent stops the replicas after their step; a KeyboardInterrupt here would have reported
    # the stop as this replica's failure (exit code 1) and dropped its finished rows.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    exit_with_parent(int(argv[1]))
    try:
        setup: ReplicaSetup = receive(conn)
    except (EOFError, OSError):
        return 1  # the parent went away before sending the set-up
    sys.path.extend(p for p in setup.sys_path if p not in sys.path)
    try:
        return run_replica(conn, setup)
    except (BrokenPipeError, ConnectionResetError):
        return 1  # the parent is gone: nothing to report to


def run_replica(conn: Connection, setup: ReplicaSetup) -> int:
    from tokenmill.batch.job_engine import load_llm
    from tokenmill.batch.loop import JobLoop
    from tokenmill.batch.readers import read_rows
    from tokenmill.batch.stall_watchdog import StallWatchdog

    config = setup.config
    link = ParentLink(conn, setup.done)
    try:
        if setup.num_threads is not None:
            import torch

            torch.set_num_threads(setup.num_threads)
        llm = load_llm(config)
        send(conn, Ready())
        watchdog = StallWatchdog(config.stall_timeout) if config.stall_timeout > 0 else None  # the parent restarts us
        loop = JobLoop(config, llm, link, link, setup.input_format, setup.output_shape,  # type: ignore[arg-type]
                     setup.job_key, link.should_stop, new_llm=lambda: load_llm(config), watchdog=watchdog)
        del llm  # the loop's alone: a replaced engine's memory must be freeable
        with watchdog or contextlib.nullcontext():
            complete = loop.run(shard_rows(read_rows(config.input, setup.input_format, setup.input_size), setup.shard, setup.shards))
        if not complete:
            loop.abort()
        link.flush()
        send(conn, Finished(complete, loop.errors))
        return 0
    except (BrokenPipeError, ConnectionResetError):
        raise
    except BaseException as e:
        send(conn, Failed(type(e).__name__, str(e), traceback.format_exc()))
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
