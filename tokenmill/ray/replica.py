"""One replica of the Ray Data processor: a Ray actor holding one `LLM`, fed batches by `map_batches`.

Ray calls a replica from several threads at once (``max_concurrency`` = max_concurrent_batches),
so while one batch's last rows finish, the next batches' rows are already in the engine: the
engine never drains between batches. Each call translates its rows (in the calling thread), hands
them to the replica's one engine thread and waits; the engine thread adds requests and steps the
engine for every batch together (the engine is not thread-safe: only that thread touches it).

A row that cannot run (unparseable messages, invalid sampling values, a prompt longer than the
model allows), or whose output cannot become its result columns, becomes an error row
(``__inference_error__``); the other rows go on. An engine
that fails (an error in a step) fails every batch it holds: that is a bug, not a bad row.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.ray.rows import ERROR_COLUMN, AdapterNames, RowJob, RowProblem, column_types, generation_parts, pooling_job, result_columns


@dataclass
class _Ticket:
    """One map_batches call waiting for its rows."""

    jobs: list[RowJob]
    remaining: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None


class EngineThread:
    """Steps one engine for all the batches a replica holds; callers block in `run` until theirs are done."""

    def __init__(self, engine: Any, max_pending_requests: int | None = None):
        self.engine = engine
        self.max_pending = max_pending_requests or 0  # 0: no cap (the scheduler queues what does not fit)
        self._inbox: queue.SimpleQueue[_Ticket] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        threading.Thread(target=self._loop, name="tokenmill-replica-engine", daemon=True).start()

    def run(self, jobs: list[RowJob]) -> None:
        """Run every job without an error yet; each ends with its outputs or its error."""
        if self._failure is not None:
            raise RuntimeError("this replica's engine failed earlier") from self._failure
        ticket = _Ticket(jobs)
        self._inbox.put(ticket)
        ticket.finished.wait()
        if ticket.failure is not None:
            raise RuntimeError(f"the engine failed: {ticket.failure!r}") from ticket.failure

    def _loop(self) -> None:
        waiting: deque[tuple[_Ticket, RowJob]] = deque()
        running: dict[str, tuple[_Ticket, RowJob]] = {}
        tickets: list[_Ticket] = []
        try:
            while True:
                idle = not running and not waiting
                try:
                    ticket: _Ticket | None = self._inbox.get(block=idle)
                except queue.Empty:
                    ticket = None
                while ticket is not None:
                    tickets.append(ticket)
                    waiting.extend((ticket, job) for job in ticket.jobs if not job.done)
                    ticket.remaining = sum(not job.done for job in ticket.jobs)
                    if ticket.remaining == 0:  # every row failed before reaching the engine
                        ticket.finished.set()
                    try:
                        ticket = self._inbox.get_nowait()
                    except queue.Empty:
                        ticket = None
                while waiting and (not self.max_pending or len(running) < self.max_pending):
                    self._add(*waiting.popleft(), running)
                if running:
                    for output in self.engine.step(finished_only=True):
                        owner = running.pop(output.request_id, None) if output.finished else None
                        if owner is None:
                            continue
                        error = getattr(output, "error", None)  # (a pooling output has none)
                        if error is not None:  # the engine ended it unfinished: the row fails
                            self._fail_running(owner[1], f"the engine could not finish this row: {error}", running)
                        else:
                            owner[1].outputs[output.request_id] = output
                        self._job_progress(*owner)
                tickets = [t for t in tickets if not t.finished.is_set()]
        except BaseException as e:  # the engine is broken: fail every caller, now and later
            self._failure = e
            for ticket in tickets + [t for t, _ in waiting]:
                ticket.failure = e
                ticket.finished.set()

    def _add(self, ticket: _Ticket, job: RowJob, running: dict[str, tuple[_Ticket, RowJob]]) -> None:
        try:
            for request_id, prompt, params in job.parts:
                self.engine.add_request(request_id, prompt, params, lora_request=job.lora)
                running[request_id] = (ticket, job)
        except Exception as e:  # a request the engine refuses (too long, invalid): this row only
            self._fail_running(job, str(e) or type(e).__name__, running)
        self._job_progress(ticket, job)

    def _fail_running(self, job: RowJob, message: str, running: dict[str, tuple[_Ticket, RowJob]]) -> None:
        """The row fails: its requests still in the engine are aborted (the row counts as done once)."""
        rest = [request_id for request_id, _, _ in job.parts if running.get(request_id, (None, None))[1] is job]
        self.engine.abort_request(rest)
        for request_id in rest:
            del running[request_id]
        job.error = message

    @staticmethod
    def _job_progress(ticket: _Ticket, job: RowJob) -> None:
        if job.done:
            ticket.remaining -= 1
            if ticket.remaining == 0:
                ticket.finished.set()


class TokenmillReplica:
    """The Ray Data UDF: ``__call__`` takes a batch (an Arrow table) and returns it with the result columns."""

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any], task: str, chat_template: str | None,
                 apply_chat_template: bool, max_pending_requests: int | None, num_threads: int | None,
                 continue_on_error: bool, lora_root: str | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        from tokenmill import LLM

        self.llm = LLM(model_source, **engine_kwargs)
        self.task = task
        self.chat_template, self.apply_chat_template = chat_template, apply_chat_template
        self.chat_template_kwargs = chat_template_kwargs
        self.continue_on_error = continue_on_error
        self.adapters = AdapterNames(model_source, lora_root)
        self.pooling_rows = None
        if task != "generate":
            from tokenmill.batch.pooling import PoolingRows
            from tokenmill.batch.requests import PromptSettings

            self.pooling_rows = PoolingRows(task, self.llm, PromptSettings(), {})
        self.engine = EngineThread(self.llm.llm_engine, max_pending_requests)
        self._batches = itertools.count()
        self._types = column_types(task)

    def __call__(self, batch: Any) -> Any:
        rows = batch.to_pylist()
        prefix = f"b{next(self._batches)}-"  # request ids unique across the batches in flight
        jobs = [self._job(row, position, prefix) for position, row in enumerate(rows)]
        self.engine.run(jobs)
        columns = [self._columns(job) for job in jobs]
        if not self.continue_on_error:
            failed = next((job for job in jobs if job.error is not None), None)
            if failed is not None:
                raise ValueError(f"row {failed.position} of the batch failed: {failed.error} "
                                 "(should_continue_on_error=True makes such rows error rows instead)")
        return _with_columns(batch, columns, self._types)

    def _columns(self, job: RowJob) -> dict[str, Any]:
        """The row's result columns; a finished row whose output cannot become them (a bug that an
        odd output triggers) turns into an error row, so the batch's other rows are kept."""
        try:
            return result_columns(self.task, job, self.pooling_rows)
        except Exception as e:  # noqa: BLE001  (this row's output, not the batch)
            from tokenmill.batch.pooling import NonFiniteOutput

            # A vector or score that is not a number is no result (the model's doing, not a bug).
            job.error = (str(e) if isinstance(e, NonFiniteOutput)
                         else f"the row finished but its output could not become result columns: {type(e).__name__}: {e}")
            return result_columns(self.task, job, self.pooling_rows)

    def _job(self, row: dict[str, Any], position: int, prefix: str) -> RowJob:
        from tokenmill.sampling_params import RequestOutputKind

        if row.get(ERROR_COLUMN):  # failed before the engine (preprocess raised): it passes by as it is
            return RowJob(position, error=row[ERROR_COLUMN], prompt_text=row.get("prompt") if isinstance(row.get("prompt"), str) else None)
        try:
            if self.pooling_rows is not None:
                return pooling_job(self.pooling_rows, row, position, prefix)
            parts, text = generation_parts(row, f"{prefix}{position}", self.llm, self.chat_template, self.apply_chat_template,
                                           self.chat_template_kwargs)
            # One output per request, when it finishes (as LLM.generate asks for).
            parts = [(rid, prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY)) for rid, prompt, params in parts]
            return RowJob(position, parts=parts, prompt_text=text, lora=self.adapters.adapter(row))
        except RowProblem as e:
            return RowJob(position, error=str(e), prompt_text=row.get("prompt") if isinstance(row.get("prompt"), str) else None)


def _with_columns(batch: Any, columns: list[dict[str, Any]], types: dict[str, Any]) -> Any:
    """The batch with each result column set (replacing an input column of the same name)."""
    import pyarrow as pa

    for name, dtype in types.items():
        array = pa.array([row[name] for row in columns], type=dtype)
        if name in batch.column_names:
            batch = batch.set_column(batch.column_names.index(name), name, array)
        else:
            batch = batch.append_column(name, array)
    return batch
