"""Ranks 1..N-1 as rank 0 sees them: worker processes, their control pipes, a watchdog, shutdown.

Failure handling, in one place:
- a watchdog thread per worker waits for its process to end; an end nobody asked for is
  recorded (and, on NCCL, the group is aborted so a collective waiting on the dead rank returns);
- every announcement checks that record first, so the call after a death fails at once;
- a first Ctrl-C inside a mirrored call is held until the call ends (`held_interrupt`), so the
  ranks stay in step and the engine recovers from it between calls, as on one rank;
- a mirrored call that fails or is interrupted midway (a second Ctrl-C) leaves the ranks out of
  step, so ``step_guard`` stops every worker and raises a RuntimeError naming the cause (a dead rank,
  when one died; gloo itself notices a dead peer's closed socket within milliseconds);
- a worker that fails a mirrored call itself sends its exception (a `Failed` message) before it
  exits, and the error rank 0 raises carries it: the worker's own traceback is only on its stderr;
- stopping is idempotent and also runs when the owner is garbage-collected or the interpreter
  exits (weakref.finalize): a graceful Stop, then SIGTERM, then SIGKILL, and every process reaped.
"""

from __future__ import annotations

import dataclasses
import contextlib
import pickle
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, Iterator

from tokenmill.distributed.child_process import describe_exit, start_module, stop_children
from tokenmill.distributed.held_interrupt import sigint_held
from tokenmill.distributed.messages import Failed, Joining, Reply, RpcCall, Stop, WorkerSetup, dumps_value, receive, send
from tokenmill.distributed.process_group import abort_group, create_group, create_store

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.models.source import ModelSource

DEATH_GRACE_S = 2.0  # after a failed collective, how long to wait for the dead rank's exit to show


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone (or the workers were stopped after a failed step)."""


@dataclass
class _Shared:
    """What the watchdog threads and the finalizer share with WorkerProcesses. They must not hold
    the WorkerProcesses itself: it has to stay collectable, so that deleting the LLM stops them."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    failure: str | None = None  # why the workers can no longer run steps
    group: Any = None


class WorkerProcesses:
    def __init__(
        self, config: "EngineConfig", source: "ModelSource", load_format: str, device: "torch.device", num_threads: int
    ):
        """Start ranks 1..N-1 and join the process group with them; returns once joined."""
        self.world_size = config.tensor_parallel_size
        self._shared = _Shared()
        self.procs, self.conns = self._shared.procs, self._shared.conns
        self._next_call_id = 0
        self._last_words: dict[int, str] = {}  # rank -> the exception of the mirrored call it failed (`Failed`)
        self._finalizer = weakref.finalize(self, _stop_workers, self._shared)
        try:
            store = create_store(self.world_size)
            # Only rank 0 samples, so only it builds logits processors (a class defined in the user's
            # __main__ could not be unpickled in a worker anyway).
            worker_config = dataclasses.replace(config, logits_processors=())
            for rank in range(1, self.world_size):
                self._start(WorkerSetup(rank, worker_config, source, load_format, store.port, num_threads, list(sys.path)))
            # Rank 0 joins last: joining blocks until every rank has, so a worker that failed
            # first must be noticed here, not after the collective timeout.
            self._receive_all("start-up", lambda message: isinstance(message, (Joining, Reply)))
            try:
                self.group = self._shared.group = create_group(store, 0, self.world_size, device)
            except Exception as exc:
                # A worker that failed while joining leaves rank 0 waiting out the collective timeout
                # for it; the store's "wait timeout" says nothing of why, the worker's pipe does.
                reported = self._start_up_failure()
                if reported is None:
                    raise
                raise RuntimeError(reported) from exc
        except BaseException:
            self.stop(graceful=False)
            raise

    @property
    def failure(self) -> str | None:
        return self._shared.failure

    def _start_up_failure(self) -> str | None:
        """Why a worker could not start, as its pipe tells it without waiting: its error, or its death."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            for message in _messages_waiting(conn):
                if isinstance(message, Reply) and not message.ok:
                    return f"start-up failed on tensor-parallel rank {rank}:\n{message.error}"
            if proc.poll() is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during start-up: {describe_exit(proc.returncode)}"
        return None

    def _start(self, setup: WorkerSetup) -> None:
        proc, conn = start_module("tokenmill.distributed.worker_process")
        self.procs.append(proc)
        self.conns.append(conn)
        send(conn, setup)
        watchdog = threading.Thread(
            target=_watch, args=(self._shared, setup.rank, proc), name=f"tokenmill-watch-rank{setup.rank}", daemon=True
        )
        watchdog.start()

    # ---- start-up and collective_rpc ------------------------------------------------------
    def wait_until_ready(self) -> None:
        """Wait for every worker to report its shard loaded (or raise with its traceback)."""
        self._receive_all("start-up", lambda reply: isinstance(reply, Reply) and reply.call_id == -1)

    def send_rpc(self, method: Any, args: tuple, kwargs: dict) -> int:
        payload = dumps_value((method, args, kwargs), f"collective_rpc method {method!r} with its arguments")
        self._next_call_id += 1
        self._send_all(RpcCall(self._next_call_id, payload), "collective_rpc")
        return self._next_call_id

    def collect_rpc(self, call_id: int, timeout: float | None, what: str) -> list[Any]:
        """The results of ranks 1..N-1 for call ``call_id``, in rank order."""
        replies = self._receive_all(what, lambda reply: isinstance(reply, Reply) and reply.call_id == call_id, timeout)
        return [pickle.loads(reply.payload) for reply in replies]

    def _receive_all(self, what: str, accept: Callable[[Any], bool], timeout: float | None = None) -> list[Any]:
        """One accepted message from each worker, in rank order; others (late replies to a call
        that timed out) are dropped. A Reply that reports an error raises it, with its traceback."""
        deadline = None if timeout is None else time.monotonic() + timeout
        found: dict[int, Any] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns, start=1)}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), timeout=left)
            if not ready:
                raise TimeoutError(f"{what}: no answer from ranks {sorted(pending.values())} within {timeout} s")
            for conn in ready:
                rank = pending[conn]
                try:
                    message = receive(conn)
                except (EOFError, OSError):
                    self._raise_dead(rank, f"during {what}")
                if isinstance(message, Failed):  # it failed a mirrored call after rank 0's part of it ended
                    self._last_words[rank] = message.error
                elif accept(message):
                    found[rank] = message
                    del pending[conn]
        for rank, message in sorted(found.items()):
            if isinstance(message, Reply) and not message.ok:
                raise RuntimeError(f"{what} failed on tensor-parallel rank {rank}:\n{message.error}")
        return [found[rank] for rank in sorted(found)]

    # ---- mirrored calls -------------------------------------------------------------------
    def announce(self, message: Any) -> None:
        """Tell every worker which call comes next (its tensors follow by broadcast)."""
        self._send_all(message, "a step")

    def _send_all(self, message: Any, what: str) -> None:
        self.check_alive()
        data = pickle.dumps(message)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError:
                self._raise_dead(rank, f"before {what}")

    @contextlib.contextmanager
    def step_guard(self) -> Iterator[None]:
        """Around one mirrored call: a first Ctrl-C waits for its end (`sigint_held`); if it fails
        or is interrupted midway (a second Ctrl-C), stop every worker."""
        with sigint_held():
            try:
                yield
            except BaseException as exc:
                if isinstance(exc, WorkerDiedError):
                    self.stop(graceful=False)
                    raise
                if not isinstance(exc, KeyboardInterrupt):
                    self._wait_for_failure(DEATH_GRACE_S)  # a collective may fail before the exit is seen
                if self.failure is None:
                    self._shared.failure = (
                        "a tensor-parallel step was interrupted" if isinstance(exc, KeyboardInterrupt)
                        else f"a tensor-parallel step failed on rank 0: {exc!r}"
                    )
                error = self._stop_failed()
                if isinstance(exc, Exception):
                    raise error from exc
                raise

    def _stop_failed(self) -> WorkerDiedError:
        """Stop every worker after a failure; returns the error that says why, with the exception of
        any worker that failed a mirrored call (read before the pipes close)."""
        if not self._shared.stopping.is_set():
            self._read_last_words()
        self.stop(graceful=False)
        reason = self.failure or ""
        for rank, error in sorted(self._last_words.items()):
            reason += f"; rank {rank} failed a mirrored call with {error} (its traceback is on its stderr)"
        return WorkerDiedError(_dead_message(reason))

    def _read_last_words(self) -> None:
        """Keep the `Failed` messages the workers sent before exiting (without waiting for any)."""
        for rank, conn in enumerate(self.conns, start=1):
            for message in _messages_waiting(conn):
                if isinstance(message, Failed):
                    self._last_words[rank] = message.error

    def check_alive(self) -> None:
        if self.failure is not None:
            raise self._stop_failed()

    def _wait_for_failure(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _raise_dead(self, rank: int, when: str) -> None:
        proc = self.procs[rank - 1]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=DEATH_GRACE_S)
        if self.failure is None:
            code = proc.returncode
            state = describe_exit(code) if code is not None else "its control pipe closed"
            self._shared.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died {when}: {state}"
        raise self._stop_failed()

    # ---- shutdown -------------------------------------------------------------------------
    def stop(self, graceful: bool = True) -> None:
        """Stop and reap every worker (idempotent)."""
        self._finalizer.detach()
        _stop_workers(self._shared, graceful)
        if self._shared.failure is None:
            self._shared.failure = "the tensor-parallel workers were shut down"


def _watch(shared: _Shared, rank: int, proc: subprocess.Popen) -> None:
    """Watchdog thread: record a worker's death unless it was told to stop."""
    code = proc.wait()
    if shared.stopping.is_set() or shared.failure is not None:
        return
    shared.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died: {describe_exit(code)}"
    with contextlib.suppress(Exception):
        abort_group(shared.group)


def _stop_workers(shared: _Shared, graceful: bool = True) -> None:
    """A Stop message (when graceful), then SIGTERM, then SIGKILL; every process reaped."""
    if shared.stopping.is_set():
        return
    shared.stopping.set()
    stop_children(shared.procs, shared.conns, (lambda conn: send(conn, Stop())) if graceful else None)


def _messages_waiting(conn: Connection) -> Iterator[Any]:
    """The messages already in a worker's pipe, without waiting for more; a pipe that breaks (the
    worker died mid-message) ends them."""
    with contextlib.suppress(EOFError, OSError, pickle.UnpicklingError):
        while conn.poll():
            yield receive(conn)


def _dead_message(reason: str) -> str:
    return f"{reason}. The tensor-parallel workers are stopped and this LLM cannot run more steps; create a new LLM"
