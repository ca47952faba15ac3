"""`tokenmill run --replicas N`: N engine processes on one host, one output, one journal.

    parent (this process)                        replica k (tokenmill.batch.replica_process)
      Journal: the only writer of the output ◄──── Commit: encoded lines + the rows they finish
      Progress line                         ◄──── ProgressEvents
      restarts a replica that dies                 JobLoop over rows with index % N == k, own LLM

Each replica runs the ordinary job loop over its shard of the input (rows whose index % N is its
number) and sends every commit to the parent, which writes it to the output and the journal
exactly as a single-process job does. So the resume guarantee is the job's own: a row is in the
output once its commit is journaled, and only then.

- The parent is killed (even ``kill -9``): the replicas notice within a second and exit; a rerun
  replays the journal and starts new replicas for the rows not done.
- A replica dies: the parent reads every complete message it sent before dying (a frame cut short
  by the kill is dropped whole), then starts a replacement for the same shard with the journal's
  current set of finished rows, so the rows the dead one had in flight run again, once. After
  ``MAX_RESTARTS`` deaths of one shard the job stops with an error (a rerun continues).
- Ctrl-C / SIGTERM: every replica is told to stop after its current step; each commits what
  finished and exits, as a single-process job does. One still loading its model (no row run yet)
  is stopped at once.

Devices: on a GPU host replica k gets its own GPUs (``CUDA_VISIBLE_DEVICES``: tensor_parallel_size
of them each); on the CPU each replica gets cores // N torch threads, so N replicas do not fight
over the cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, TextIO

from tokenmill.batch.job_engine import check_tensor_parallel_fits
from tokenmill.batch.replica_messages import (
    Commit, Failed, Finished, ProgressEvents, Ready, ReplicaError, ReplicaSetup, StopReplica, replay_progress,
)
from tokenmill.distributed.child_process import STOP_GRACE_S, describe_exit, start_module, stop_children
from tokenmill.distributed.messages import receive, send
from tokenmill.host_cpus import usable_cpus

if TYPE_CHECKING:
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.journal import Journal
    from tokenmill.batch.progress import Progress

MAX_RESTARTS = 3  # deaths of one shard's replica before the job gives up
_POLL_S = 0.25
_SHOWN_ERRORS = 5  # as many row failures as the single-process summary shows
# Exceptions a replica reports that are the user's mistake (a bad model, bad options): the CLI's usage errors.
_USER_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError,
                "FileNotFoundError": FileNotFoundError, "ResumeError": ValueError, "RowError": ValueError}


@dataclass(frozen=True)
class ReplicaPlan:
    """Where one replica runs: its engine options, environment and torch threads."""

    engine: dict[str, Any]
    env: dict[str, str]
    num_threads: int | None


def plan_replicas(engine: dict[str, Any], count: int) -> list[ReplicaPlan]:
    """One plan per replica: its own GPUs (tensor_parallel_size each) on a GPU host, else its share of the cores."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"--replicas={count!r} is invalid: must be an integer >= 1")
    device = str(engine.get("device") or "auto")
    if device == "cpu" or (device == "auto" and not _cuda_available()):
        threads = max(1, usable_cpus() // count)  # this process's CPUs (its container's or taskset's), not the host's
        return [ReplicaPlan({**engine, "device": "cpu"}, {}, threads) for _ in range(count)]
    if device not in ("auto", "cuda"):
        raise ValueError(f"--replicas gives each replica its own GPUs, so --device {device} cannot apply; "
                         "use --device cuda (or auto)")
    tp = int(engine.get("tensor_parallel_size") or 1)
    visible = _visible_gpus()
    if count * tp > len(visible):
        raise ValueError(f"--replicas {count} with tensor_parallel_size {tp} needs {count * tp} GPUs, "
                         f"but {len(visible)} are visible ({', '.join(visible) or 'none'})")
    return [ReplicaPlan({**engine, "device": "cuda"}, {"CUDA_VISIBLE_DEVICES": ",".join(visible[k * tp:(k + 1) * tp])}, None)
            for k in range(count)]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@dataclass
class _Replica:
    shard: int
    plan: ReplicaPlan
    proc: subprocess.Popen | None = None
    conn: Connection | None = None
    ready: bool = False
    finished: bool = False
    restarts: int = 0


class ReplicaPool:
    """Runs a job on N replica processes; the same interface as the job's own loop (run, abort, errors)."""

    def __init__(self, config: "JobConfig", journal: "Journal", progress: "Progress", input_format: str,
                 output_shape: str, job_key: str, should_stop: Callable[[], bool] | None = None,
                 stderr: TextIO | None = None, input_size: int | None = None):
        self.config, self.journal, self.progress = config, journal, progress
        self.input_format, self.output_shape, self.job_key = input_format, output_shape, job_key
        self.should_stop = should_stop or (lambda: False)
        self.stderr = stderr if stderr is not None else sys.stderr
        self.input_size = input_size  # the scan's: replicas read that much of the input (readers.ScannedInput)
        plans = plan_replicas(config.engine, config.replicas)
        check_tensor_parallel_fits(config)  # here, rather than in every replica's LLM() once it started
        self.replicas = [_Replica(shard, plan) for shard, plan in enumerate(plans)]
        self.errors: list[str] = []
        self._stopping = False
        self._all_ready = False

    def run(self, rows: Any = None) -> bool:
        """Until every shard is done; False when stopped early by ``should_stop``. (``rows`` is
        unused: each replica reads its own shard of the input.)"""
        try:
            for replica in self.replicas:
                self._start(replica)
            while not all(r.finished for r in self.replicas):
                if not self._stopping and self.should_stop():
                    self._stop_all()
                live = {r.conn: r for r in self.replicas if not r.finished and r.conn is not None}
                for conn in wait(list(live), timeout=_POLL_S):
                    if live[conn].conn is conn:  # not closed meanwhile (a stop met while reading this turn's)
                        self._receive(live[conn])  # type: ignore[index]
                self.progress.maybe_draw()
            return not self._stopping
        finally:
            self._close_all()

    def abort(self) -> None:
        """Stop at once (a second Ctrl-C): what the replicas had not committed runs again next time."""
        self._close_all()

    # --- replicas --------------------------------------------------------------------------------
    def _start(self, replica: _Replica) -> None:
        env = {**os.environ, **replica.plan.env}
        replica.proc, replica.conn = start_module("tokenmill.batch.replica_process", env)
        replica.ready = False
        config = dataclasses.replace(self.config, engine=replica.plan.engine, replicas=1, ray_address=None)
        send(replica.conn, ReplicaSetup(
            config=config, shard=replica.shard, shards=len(self.replicas), input_format=self.input_format,
            output_shape=self.output_shape, job_key=self.job_key, done=self.journal.done_bitmap(),
            num_threads=replica.plan.num_threads, sys_path=list(sys.path), input_size=self.input_size,
        ))

    def _receive(self, replica: _Replica) -> None:
        assert replica.conn is not None
        try:
            message = receive(replica.conn)
        except (EOFError, OSError):  # dead (a frame cut short by the kill lands here too: dropped whole)
            self._on_death(replica)
            return
        if isinstance(message, Commit):
            self._commit(replica, message)
        elif isinstance(message, ProgressEvents):
            replay_progress(message.events, self.progress)
        elif isinstance(message, Ready):
            replica.ready = True
            if all(r.ready or r.finished for r in self.replicas) and not self._all_ready:
                self._all_ready = True
                self.progress.start = time.monotonic()  # rates and the summary's throughput leave loading out
        elif isinstance(message, Finished):
            replica.finished = True
            self.errors.extend(message.errors[: max(0, _SHOWN_ERRORS - len(self.errors))])
            self._close(replica, wait_s=STOP_GRACE_S)  # it exits by itself now
        elif isinstance(message, Failed):
            raise self._failure(replica, message)

    def _commit(self, replica: _Replica, commit: Commit) -> None:
        twice = [row for row in commit.rows if self.journal.is_done(row)]
        if twice:  # shards are disjoint and a replacement starts from the journal: this cannot happen
            raise ReplicaError(f"replica {replica.shard} sent rows that are already in the output: {twice[:5]}; "
                               "nothing was written twice. Rerun to continue")
        self.journal.commit(commit.data, commit.rows, commit.failed, commit.prompt_tokens, commit.completion_tokens)

    def _on_death(self, replica: _Replica) -> None:
        assert replica.proc is not None
        pid = replica.proc.pid
        code = replica.proc.wait()
        self._close(replica)
        shards = len(self.replicas)  # its rows in flight left with it: their work is left again
        for key in [key for key in self.progress.rows if key % shards == replica.shard]:
            self.progress.on_dropped(key)
        if not self._stopping and self.should_stop():
            # A stop signal sent to every process of the job (Slurm signals them all) killed it before
            # the parent's own was looked at: that is the stop, not a crash to recover from.
            self._stop_all()
        if self._stopping:
            replica.finished = True  # its unfinished rows run in the next attempt
            return
        replica.restarts += 1
        what = f"replica {replica.shard} (pid {pid}) died: {describe_exit(code)}"
        if replica.restarts > MAX_RESTARTS:
            raise ReplicaError(f"{what}, for the {replica.restarts}th time; giving up. Finished rows are kept: "
                               "rerun the same command to continue")
        print(f"tokenmill run: {what}; starting a replacement for its unfinished rows "
              f"(restart {replica.restarts} of {MAX_RESTARTS})", file=self.stderr, flush=True)
        self._start(replica)

    def _failure(self, replica: _Replica, failed: Failed) -> Exception:
        where = "while loading the model" if not replica.ready else "while running"
        if failed.error_type in _USER_ERRORS:
            return _USER_ERRORS[failed.error_type](failed.message)
        return ReplicaError(f"replica {replica.shard} failed {where}: {failed.error_type}: {failed.message}\n"
                            f"{failed.traceback}")

    def _stop_all(self) -> None:
        """Ask every replica to stop after its step. One still loading its model has run no row (it
        says Ready first), so it is stopped now rather than after a load that can take minutes."""
        self._stopping = True
        for replica in self.replicas:
            while replica.conn is not None and not replica.ready and not replica.finished and replica.conn.poll():
                self._receive(replica)  # what it sent meanwhile (Ready, or its death) first
            if replica.conn is None or replica.finished:
                continue
            if not replica.ready:
                self._close(replica)
                replica.finished = True  # its rows run in the next attempt
                continue
            try:
                send(replica.conn, StopReplica())
            except OSError:
                pass  # dead: noticed when its pipe is read

    def _close(self, replica: _Replica, wait_s: float = 0.0) -> None:
        if replica.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.proc.wait(timeout=wait_s)
            stop_children([replica.proc], [replica.conn] if replica.conn is not None else [])
        replica.proc, replica.conn = None, None

    def _close_all(self) -> None:
        for replica in self.replicas:
            self._close(replica)
