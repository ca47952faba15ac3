"""`tokenmill run --ray ADDRESS`: the same job on a Ray cluster, one engine per Ray actor.

    driver (this process)                                   replicas (Ray actors, one LLM each)
      reads the input a batch at a time, skipping rows ──► batch (≤ 256 rows) ──► JobReplica.run_batch
      the journal has; ≤ 2 batches out per replica                                        │
      Journal: the only writer of the output ◄──────── commit units (encoded lines + rows) ◄┘

Each replica runs the job's own loop (`loop.JobLoop`) over the rows of each batch it is given, so a
row becomes exactly the records a single-process run writes (prompt settings, per-row seeds,
OpenAI format, pooling tasks, error rows). The driver commits what comes back through the same
journal, so a killed driver resumes like any job: the rerun skips the journaled rows.

The input streams: the driver reads the next batch only when a replica has room for it (two
batches queued at each, so its engine never waits for the driver), and a batch leaves Ray's object
store once its results are committed. So what the driver and the object store hold is bounded by
replicas x 2 + 1 batches of 256 rows (the one read next included), whatever the input's size. The input needs to be readable where the
command runs, not on the cluster's nodes. For data already in cluster storage use
`tokenmill.ray.build_llm_processor` (docs/scale-out.md).

A replica that dies (its node lost, its process killed) is restarted by Ray, which runs the batches
it held again; the driver never commits a row twice. A batch whose replica dies ``MAX_RETRIES`` + 1
times stops the job (a row that kills its engine's process), as `--replicas` does. A stop request
(Ctrl-C, SIGTERM) is looked at every second, also while the replicas load their models.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterator

from tokenmill.batch.replica_messages import Commit, ProgressRecorder, ReplicaError, replay_progress

if TYPE_CHECKING:
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.journal import Journal
    from tokenmill.batch.progress import Progress
    from tokenmill.batch.readers import RawRow

_BATCH_ROWS = 256  # rows per replica call at most (the job's loop drains the engine at the end of each)
_QUEUED_PER_REPLICA = 2  # batches sent to a replica ahead: the next one waits there when one ends
_POLL_S = 1.0  # how often a stop request is looked at while results are awaited
_START_S = 600  # every replica up by then, or the cluster cannot place them: the job stops saying so
MAX_RETRIES = 3  # reruns of a batch whose replica died (--replicas' MAX_RESTARTS)
_SHOWN_ERRORS = 5  # as many row failures as the single-process summary shows


class RayJobLoop:
    """The job loop on a Ray cluster: the interface of `loop.JobLoop` (run, abort, errors)."""

    def __init__(self, config: "JobConfig", journal: "Journal", progress: "Progress", input_format: str,
                 output_shape: str, job_key: str, should_stop: Callable[[], bool] | None = None):
        self.config, self.journal, self.progress = config, journal, progress
        self.input_format, self.output_shape, self.job_key = input_format, output_shape, job_key
        self.should_stop = should_stop or (lambda: False)
        self.errors: list[str] = []
        self._connected = False
        self._replicas: list[Any] = []  # actor handles
        from tokenmill.ray.processor import import_ray

        try:
            self.ray = import_ray()
        except ImportError as e:
            raise ValueError(f"--ray: {e}") from None  # a usage error: say how to install it

    def run(self, rows: Iterator["RawRow"]) -> bool:
        ray = self.ray
        if not ray.is_initialized():
            address = self.config.ray_address
            try:
                ray.init(address=None if address == "local" else address)
            except ConnectionError as e:  # an OSError, but no file's: a usage error, not a failed write
                raise ValueError(f"--ray {address}: found no Ray cluster to join ({e}) Start one (ray start --head), "
                                 "give its address (--ray ray://HOST:10001), or run one inside this job with "
                                 "--ray local") from None
            self._connected = True
        try:
            return self._stream(rows)
        finally:
            self.abort()

    def abort(self) -> None:
        """End the replicas (the batches they hold run again on a rerun) and disconnect from the
        cluster if this job connected."""
        for actor in self._replicas:
            with contextlib.suppress(Exception):  # gone already
                self.ray.kill(actor)
        self._replicas = []
        if self._connected:
            self.ray.shutdown()
            self._connected = False

    def _stream(self, rows: Iterator["RawRow"]) -> bool:
        """Send batches as replicas have room, commit each batch's results as it returns."""
        ray = self.ray
        placement = self._placement()
        batches = self._batches(rows, placement[0])
        batch = next(batches, None)
        if batch is None:
            return True  # nothing left to run: no replica is started
        if not self._start_replicas(*placement):
            return False
        room = deque(actor for _ in range(_QUEUED_PER_REPLICA) for actor in self._replicas)  # one slot a queued batch
        sent: dict[Any, tuple[Any, int, int]] = {}  # result ref -> (replica, first and last row)
        while True:
            while room and batch is not None:
                actor = room.popleft()
                sent[actor.run_batch.remote(batch)] = (actor, batch[0].index, batch[-1].index)
                batch = next(batches, None)
            if not sent:
                return True
            ready, _ = ray.wait(list(sent), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                actor, first, last = sent.pop(ref)
                self._take(ref, first, last)
                room.append(actor)
            self.progress.maybe_draw()
            if self.should_stop():
                return False

    def _batches(self, rows: Iterator["RawRow"], replicas: int) -> Iterator[list["RawRow"]]:
        """The rows still to do, read as the batches are asked for. A small job still reaches every replica."""
        total = self.progress.total_rows
        todo = None if total is None else total - self.journal.resumed_rows
        size = _BATCH_ROWS if todo is None else max(1, min(_BATCH_ROWS, -(-todo // replicas)))
        batch: list[RawRow] = []
        for raw in rows:
            if not self.journal.is_done(raw.index):
                batch.append(raw)
                if len(batch) == size:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def _start_replicas(self, replicas: int, num_gpus: float, num_cpus: float, threads: int | None) -> bool:
        """Start the replica actors and wait until every one has loaded its model (False: stopped meanwhile)."""
        ray = self.ray
        # Restarted when they die, their queued batches run again (MAX_RETRIES times at most).
        remote = ray.remote(JobReplica).options(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=-1,
                                                max_task_retries=MAX_RETRIES)
        for _ in range(replicas):  # one at a time: an interrupt between two leaves abort() each one started
            self._replicas.append(remote.remote(self.config, self.input_format, self.output_shape, self.job_key, threads))
        loading = [actor.ready.remote() for actor in self._replicas]
        deadline = time.monotonic() + _START_S
        while loading:
            ready, loading = ray.wait(loading, num_returns=len(loading), timeout=_POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:  # its model did not load (the error says why)
                    raise ReplicaError(f"a Ray replica could not start: {e}") from None
            if self.should_stop():
                return False
            if loading and time.monotonic() > deadline:
                raise ReplicaError(f"{len(loading)} of {replicas} Ray replicas did not start within {_START_S} s: "
                                   f"the cluster may not have {num_gpus:g} GPU(s) and {num_cpus:g} CPU(s) free for "
                                   "each; --replicas sets how many run")
        return True

    def _take(self, ref: Any, first: int, last: int) -> None:
        """Commit one batch's results and replay its progress."""
        ray = self.ray
        try:
            units, events, errors = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise ReplicaError(f"the replicas running rows {first}..{last} died {MAX_RETRIES + 1} times ({e}); the "
                               "finished rows are kept: rerun to continue") from None
        replay_progress(events, self.progress)
        self.errors.extend(errors[: max(0, _SHOWN_ERRORS - len(self.errors))])
        for unit in units:
            self._commit(unit)

    def _placement(self) -> tuple[int, float, float, int | None]:
        """(replicas, GPUs and CPUs per replica, torch threads of a CPU replica)."""
        import ray

        resources = ray.cluster_resources()
        gpus, cpus = resources.get("GPU", 0), resources.get("CPU", 1)
        tp = int(self.config.engine.get("tensor_parallel_size") or 1)
        device = str(self.config.engine.get("device") or "auto")
        if gpus > 0 and device != "cpu":
            replicas = self.config.replicas if self.config.replicas > 1 else max(1, int(gpus // tp))
            return replicas, float(tp), 1.0, None
        replicas = max(1, self.config.replicas)
        share = max(1, int(cpus // replicas))
        return replicas, 0.0, float(share), share

    def _commit(self, unit: Commit) -> None:
        done = [row for row in unit.rows if self.journal.is_done(row)]
        if len(done) == len(unit.rows):
            return  # a retried batch whose results already arrived: written once, as it should be
        if done:
            raise ReplicaError(f"a replica sent rows that are partly in the output already: {done[:5]}; "
                               "nothing was written twice. Rerun to continue")
        self.journal.commit(unit.data, unit.rows, unit.failed, unit.prompt_tokens, unit.completion_tokens)


class _CollectedCommits(ProgressRecorder):
    """The replica's stand-in for the Journal (commits kept, to be returned) and the Progress."""

    def __init__(self) -> None:
        super().__init__()
        self.units: list[Commit] = []

    def is_done(self, index: int) -> bool:
        return False  # the driver sends only rows still to do

    def commit(self, data: bytes, rows: list[int], failed: list[int], prompt_tokens: int, completion_tokens: int) -> None:
        if rows:
            self.units.append(Commit(data, rows, failed, prompt_tokens, completion_tokens))


class JobReplica:
    """A Ray actor: one LLM and the job loop; a batch of input rows in, their commit units out."""

    def __init__(self, config: "JobConfig", input_format: str, output_shape: str, job_key: str, num_threads: int | None):
        from tokenmill.batch.job_engine import load_llm
        from tokenmill.batch.loop import JobLoop

        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        self.link = _CollectedCommits()
        # An engine stopped for good (a tensor-parallel worker died) is replaced, as in a local job.
        self.loop = JobLoop(config, load_llm(config), self.link, self.link, input_format, output_shape,  # type: ignore[arg-type]
                          job_key, new_llm=lambda: load_llm(config))

    def ready(self) -> bool:
        """Answers once the model is loaded (the constructor has returned)."""
        return True

    def run_batch(self, raws: list["RawRow"]) -> tuple[list[Commit], list[Any], list[str]]:
        """The batch's commit units, its progress events and its first row failures."""
        self.loop.run(iter(raws))
        units, self.link.units = self.link.units, []
        errors, self.loop.errors = self.loop.errors, []
        return units, self.link.take(), errors
