"""`tokenmill run --ray ADDRESS`: the same job on a Ray cluster, through Ray Data.

    driver (this process)                                  replicas (Ray actors, one LLM each)
      reads the input, skips rows the journal has ──► Dataset ──► map_batches(JobReplica) ──┐
      Journal: the only writer of the output ◄──────── commit units (encoded lines + rows) ◄──┘

Each replica runs the job's own loop (`loop.JobLoop`) over the rows of each batch it is given, so a
row becomes exactly the records a single-process run writes (prompt settings, per-row seeds,
OpenAI format, pooling tasks, error rows). The driver commits what comes back through the same
journal, so a killed driver resumes like any job: the rerun skips the journaled rows. A replica
that dies is replaced by Ray and its batch retried; the driver never commits a row twice.

The driver reads the input (only the rows still to do) into Ray's object store before the run
starts (spilled to disk when larger than memory), so the input needs to be readable where the
command runs, not on the cluster's nodes. For data already in cluster storage use
`tokenmill.ray.build_llm_processor` (docs/scale-out.md).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Iterator

from tokenmill.batch.replica_messages import ProgressRecorder, ReplicaError, replay_progress

if TYPE_CHECKING:
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.journal import Journal
    from tokenmill.batch.progress import Progress
    from tokenmill.batch.readers import RawRow

_BATCH_ROWS = 256  # rows per replica call at most (the job's loop drains the engine at the end of each)
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
        from tokenmill.ray.processor import import_ray

        try:
            self.ray = import_ray()
        except ImportError as e:
            raise ValueError(f"--ray: {e}") from None  # a usage error: say how to install it

    def run(self, rows: Iterator["RawRow"]) -> bool:
        ray = self.ray
        if not ray.is_initialized():
            address = self.config.ray_address
            ray.init(address=None if address == "local" else address)
            self._connected = True
        try:
            dataset = self._dataset(rows)
            if dataset is None:
                return True
            for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
                for unit in batch.to_pylist():
                    self._commit(unit)
                self.progress.maybe_draw()
                if self.should_stop():
                    return False
            return True
        finally:
            self.abort()

    def abort(self) -> None:
        """Disconnect from the cluster if this job connected: its replicas end with it."""
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False

    def _dataset(self, rows: Iterator["RawRow"]) -> Any:
        import pyarrow as pa
        import ray

        replicas, num_gpus, num_cpus, threads = self._placement()
        # One block is one replica call; a small job still reaches every replica.
        total = self.progress.total_rows
        todo = None if total is None else total - self.journal.resumed_rows
        batch_rows = _BATCH_ROWS if todo is None else max(1, min(_BATCH_ROWS, -(-todo // replicas)))
        refs, chunk = [], []
        for raw in rows:
            if self.journal.is_done(raw.index):
                continue
            # default=str: a Parquet column of timestamps or bytes the prompt does not use must not stop the job
            chunk.append({"index": raw.index, "record": None if raw.record is None else json.dumps(raw.record, default=str),
                          "error": raw.error, "where": raw.where})
            if len(chunk) == batch_rows:
                refs.append(ray.put(pa.Table.from_pylist(chunk, schema=_row_schema())))
                chunk = []
        if chunk:
            refs.append(ray.put(pa.Table.from_pylist(chunk, schema=_row_schema())))
        if not refs:
            return None
        from tokenmill.ray.processor import wait_for_replicas

        dataset = ray.data.from_arrow_refs(refs).map_batches(
            JobReplica, batch_size=batch_rows, batch_format="pyarrow", zero_copy_batch=True,
            fn_constructor_kwargs=dict(config=self.config, input_format=self.input_format,
                                       output_shape=self.output_shape, job_key=self.job_key, num_threads=threads),
            compute=ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=2),
            num_gpus=num_gpus, num_cpus=num_cpus,
        )
        wait_for_replicas(dataset)
        return dataset

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

    def _commit(self, unit: dict[str, Any]) -> None:
        if unit["batch_report"] is not None:  # the progress calls and first failures of one batch
            import pickle

            events, errors = pickle.loads(unit["batch_report"])
            replay_progress(events, self.progress)
            self.errors.extend(errors[: max(0, _SHOWN_ERRORS - len(self.errors))])
        rows = unit["rows"]
        if not rows:
            return
        done = [row for row in rows if self.journal.is_done(row)]
        if len(done) == len(rows):
            return  # a retried batch whose results already arrived: written once, as it should be
        if done:
            raise ReplicaError(f"a replica sent rows that are partly in the output already: {done[:5]}; "
                               "nothing was written twice. Rerun to continue")
        self.journal.commit(unit["data"], rows, unit["failed"], unit["prompt_tokens"], unit["completion_tokens"])


def _row_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("index", pa.int64()), ("record", pa.string()), ("error", pa.string()), ("where", pa.string())])


class _CollectedCommits(ProgressRecorder):
    """The replica's stand-in for the Journal (commits kept, to be returned) and the Progress."""

    def __init__(self) -> None:
        super().__init__()
        self.units: list[dict[str, Any]] = []

    def is_done(self, index: int) -> bool:
        return False  # the driver sends only rows still to do

    def commit(self, data: bytes, rows: list[int], failed: list[int], prompt_tokens: int, completion_tokens: int) -> None:
        self.units.append(dict(data=data, rows=rows, failed=failed, prompt_tokens=prompt_tokens,
                               completion_tokens=completion_tokens, batch_report=None))


class JobReplica:
    """A Ray Data actor: one LLM and the job loop; a batch of input rows in, their commit units out."""

    def __init__(self, config: "JobConfig", input_format: str, output_shape: str, job_key: str, num_threads: int | None):
        from tokenmill.batch.loop import JobLoop, load_llm

        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        self.link = _CollectedCommits()
        # An engine stopped for good (a tensor-parallel worker died) is replaced, as in a local job.
        self.loop = JobLoop(config, load_llm(config), self.link, self.link, input_format, output_shape,  # type: ignore[arg-type]
                          job_key, new_llm=lambda: load_llm(config))

    def __call__(self, batch: Any) -> Any:
        import pickle

        import pyarrow as pa

        from tokenmill.batch.readers import RawRow

        raws = [RawRow(r["index"], None if r["record"] is None else json.loads(r["record"]), r["error"], r["where"] or "")
                for r in batch.to_pylist()]
        self.loop.run(iter(raws))
        units, self.link.units = self.link.units, []
        report, self.loop.errors = (self.link.take(), self.loop.errors), []
        units.append(dict(data=b"", rows=[], failed=[], prompt_tokens=0, completion_tokens=0, batch_report=pickle.dumps(report)))
        return pa.Table.from_pylist(units, schema=pa.schema([
            ("data", pa.binary()), ("rows", pa.list_(pa.int64())), ("failed", pa.list_(pa.int64())),
            ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("batch_report", pa.binary())]))
