"""The `tokenmill run` loop: stream rows in, keep a bounded number of requests in flight, write each result as it finishes.

    rows ──► rows_ahead: requests, prompts ──► engine.add_request ──► engine.step() ──► finished? ──► journal.commit
      │         (made in batches)               │ bad row                                            ▲
      │                                         └─────────────► error row ───────────────────────────┘
      └─ rows the journal says are done are skipped (resume)

Memory stays flat whatever the input size: the reader streams, a bounded number of rows is read
ahead (`rows_ahead.RowsAhead`), at most ``max_inflight`` requests (a few times ``max_num_seqs``,
enough to keep every batch full) are inside the engine, and every finished row is written at the
end of the step that finished it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tokenmill.batch.config import JobConfig
from tokenmill.batch.job_engine import base_sampling, max_num_seqs
from tokenmill.batch.lora_modules import JobAdapters, no_adapters
from tokenmill.batch.openai_batch import build_openai_request, openai_record
from tokenmill.batch.openai_lines import refused_request
from tokenmill.batch.pooling import NonFiniteOutput, PoolingRows, pooling_records
from tokenmill.batch.readers import RawRow
from tokenmill.batch.requests import (
    OpenAIMeta, RowError, RowRequest, build_row_request, check_engine_limits, check_prompt_room, row_seed,
    shared_sampling_params,
)
from tokenmill.batch.results import RowResult, generic_records, result_from_output
from tokenmill.batch.row_prompts import check_chat_template, prepare_rows, row_prompt
from tokenmill.batch.rows_ahead import RowsAhead
from tokenmill.batch.writers import encode_lines
from tokenmill.distributed import cleanup_dist_env_and_memory
from tokenmill.fatal_errors import drop_tracebacks, is_device_failure, is_engine_stopped
from tokenmill.gc_policy import timed_full_collections_only, young_collections_only

if TYPE_CHECKING:
    from tokenmill.batch.journal import Journal
    from tokenmill.batch.progress import Progress
    from tokenmill.batch.stall_watchdog import StallWatchdog

_INFLIGHT_PER_SEQ = 2
_MAX_PENDING_ERRORS = 256  # commit early when a stretch of bad rows piles up
_SHOWN_ERRORS = 5
_WHERE_PREFIXES = ("row ", "line ", "record ")  # how a row error names its row
_ENGINE_BROKEN_AFTER = 8  # rows failing alone in the engine one after another, none finishing in between
_FULL_COLLECTION_S = 300.0  # a full garbage collection this often: cyclic garbage is freed within minutes


class EngineFailure(RuntimeError):
    """The engine fails whatever it runs (not one row's fault): the job stops, finished rows kept."""


@dataclass
class _InFlight:
    raw: RawRow  # kept to run the row again if a step fails (see JobLoop._isolate)
    request: RowRequest
    prompt_tokens: int = 0  # as reported to the progress (0 until the first output)
    generated_seen: int = 0
    # Pooling rows: the engine requests of the row and the outputs of those already finished.
    part_ids: list[str] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)


class JobLoop:
    """Rows in, finished rows committed to ``journal``: the loop of a single-engine job, and of each
    replica (whose journal and progress are stand-ins that forward to the parent)."""

    def __init__(self, config: JobConfig, llm: Any, journal: Journal, progress: Progress, fmt: str, shape: str,
                 job_key: str, should_stop: Callable[[], bool] | None = None,
                 new_llm: Callable[[], Any] | None = None, notice: Callable[[str], None] | None = None,
                 watchdog: StallWatchdog | None = None):
        """``new_llm`` builds a replacement engine for one that stopped for good (a tensor-parallel
        worker died); without it such a stop ends the job. ``notice`` prints a line for the user.
        ``watchdog`` times every engine step."""
        self.config, self.llm, self.journal, self.progress = config, llm, journal, progress
        self.should_stop = should_stop or (lambda: False)
        self.new_llm, self.notice, self.watchdog = new_llm, notice or _print_notice, watchdog
        self._committing = False  # True while a commit is half done (an interrupt landed inside it)
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.fmt, self.shape, self.job_key = fmt, shape, job_key
        self.model_name = config.model
        self.created = int(time.time())
        self.base = base_sampling(llm, config.sampling)
        self.pooling = PoolingRows(config.task, llm, config.prompt, config.pooling) if config.task != "generate" else None
        self.keep_logprobs = _asks_logprobs(self.base)
        self.max_inflight = config.max_inflight or _INFLIGHT_PER_SEQ * max_num_seqs(self.engine, config)
        self.max_model_len = self.engine.config.max_model_len
        # The job's LoRA adapters, each checked against the model now: a bad one is a usage error
        # before any row runs (vLLM's server loads its --lora-modules at start-up too).
        self.adapters = JobAdapters(config.lora_modules, config.model) if config.lora_modules else None
        if self.pooling is None:
            self._check_job_limits()
            check_chat_template(self.tokenizer, config.chat_template, config.prompt, self.fmt, config.model)
            if self.adapters is not None:
                self._check_adapters()
        self.inflight: dict[str, _InFlight] = {}
        self.pending: list[tuple[RowResult, _InFlight | None]] = []  # finished rows (and their flight)
        self.retry: deque[list[RawRow]] = deque()  # rows to run again apart, a group at a time (_isolate)
        # Rows that failed alone in the engine since a row last finished, with their error: written
        # as error rows only once another row finishes (the engine works, so the row is at fault).
        self.suspects: list[tuple[_InFlight, str]] = []
        self.row_finished_on_engine = False  # whether this engine (since its last restart) finished a row
        self.restarts_without_progress = 0  # engine restarts since a row last finished
        self.alone_on_new_engine: set[int] = set()  # rows that stopped an engine alone and ran alone again
        self.errors: list[str] = []
        self._params_made: dict[str, Any] = {}  # rows' SamplingParams by their values (shared_sampling_params)
        from jinja2 import TemplateError  # chat templates can raise their own errors for odd conversations

        self._row_errors: tuple[type[BaseException], ...] = (ValueError, TypeError, TemplateError)

    def run(self, rows: Any) -> bool:
        """Feed the engine until every row is written; False when stopped early by ``should_stop``.
        Python's collector walks only young objects between steps, and the whole heap every few
        minutes (`gc_policy`): left automatic, a full collection paused the host, and the GPU with
        it, for ~0.1 s at a time (docs/perf.md 70). Pooling rows run no user code a step (no logits
        processors, no callbacks) and make no cycles: only the timed full collection (107)."""
        collections = (young_collections_only(full_every_s=_FULL_COLLECTION_S) if self.pooling is None
                       else timed_full_collections_only(_FULL_COLLECTION_S))
        with collections as collect:
            return self._feed(rows, collect)

    def _feed(self, rows: Any, collect: Callable[[], None]) -> bool:
        ahead = RowsAhead(rows, self.journal.is_done, self._prepare, self.max_inflight, self.should_stop)
        while True:
            if self.should_stop():
                return False
            if self.retry:
                if not self.inflight:  # one group at a time, alone in the engine
                    self._submit_all(self.retry.popleft())
            else:
                while len(self.inflight) < self.max_inflight and not ahead.finished:
                    taken = ahead.take(self.max_inflight - len(self.inflight))
                    for raw, built in taken:
                        self._submit(raw, built)
                    if len(self.pending) >= _MAX_PENDING_ERRORS:
                        self._commit()
                    if not taken:  # the job stops: the loop's next turn says so
                        break
            if self.inflight:
                try:
                    self._step()
                except Exception as error:  # noqa: BLE001  (a row broke the step: find it, see _isolate)
                    self._isolate(error)
                collect()
            elif ahead.finished and not self.retry:
                self._settle_suspects_at_end()
                self._commit()
                return True
            self._commit()
            if self.inflight and self.pooling is None and self.progress.counts_due():
                self._count_running()
            self.progress.maybe_draw()

    def _check_job_limits(self) -> None:
        """Job-wide values no row could run with are a usage error, before any row runs (a max_tokens
        past max_model_len is capped as LLM.generate caps it, but not for OpenAI lines: vLLM's server)."""
        limits = {"n": (self.engine.config.max_num_seqs, "max_num_seqs"),
                  "truncate_prompt_tokens": (self.max_model_len, "max_model_len")}
        if self.fmt == "openai":
            limits["max_tokens"] = (self.max_model_len, "max_model_len")
        for name, (limit, what) in limits.items():
            value = self.config.sampling.get(name)
            if value is not None and value > limit:
                raise ValueError(f"--{name.replace('_', '-')} {value} is more than this engine's {what} ({limit}); "
                                 f"lower it, or raise --{what.replace('_', '-')}")
        most, _ = self.engine.intake.logprobs_limit()
        for name in ("logprobs", "prompt_logprobs"):
            value = self.config.sampling.get(name)
            if value is not None and value > most:
                raise ValueError(f"--{name.replace('_', '-')} {value} is more than this engine allows ({most}: "
                                 f"--max-logprobs, -1 for the whole vocabulary); lower it, or raise --max-logprobs")

    def _check_adapters(self) -> None:
        assert self.adapters is not None
        if getattr(self.engine, "adapters", None) is None:  # an LLM passed in, started without LoRA
            raise ValueError("--lora-modules needs an engine started with enable_lora=True")
        self.adapters.register(self.engine)

    def _submit_all(self, raws: list[RawRow]) -> None:
        """Submit rows in order (a group run again apart); their prompts made together."""
        built = self._prepare(raws)
        for raw in raws:
            self._submit(raw, built.get(raw.index))

    def _prepare(self, raws: list[RawRow]) -> dict[int, tuple[RowRequest, Any]]:
        if self.pooling is not None:
            return self.pooling.prepare(raws, self.fmt == "openai", self._row_errors)
        return prepare_rows(raws, self._row_request, self.tokenizer, self.config.chat_template, self._row_errors)

    def _row_request(self, raw: RawRow) -> RowRequest:
        return build_openai_request(raw) if self.fmt == "openai" else build_row_request(raw, self.config.prompt)

    def _submit(self, raw: RawRow, built: tuple[RowRequest, Any] | None = None) -> None:
        """One row into the engine, or an error row; ``built``: its request and prompt, made already."""
        request: RowRequest | None = None
        row_id, lora = None, None
        bound, samples = 0, 1  # what the row may generate at most (progress and ETA)
        keywords: dict[str, Any] = {}  # add_request's beyond the params: a generation row's seed (its params are shared)
        try:
            if raw.error is not None:
                raise RowError(raw.error)
            if self.pooling is not None:
                if built is None:
                    built = self.pooling.build_openai(raw) if self.fmt == "openai" else self.pooling.build(raw)
                request, parts = built
                row_id = request.row_id
            else:
                request, prompt = built if built is not None else (self._row_request(raw), None)
                row_id = request.row_id
                where = raw.where or f"row {raw.index}"
                params = shared_sampling_params(self.base, request.overrides, raw.index, row_id, where, self._params_made)
                keywords["seed"] = row_seed(params, self.config.seed, raw.index)
                try:
                    check_engine_limits(params, self.max_model_len, self.engine.config.max_num_seqs,
                                        cap_max_tokens=self.fmt != "openai")
                except ValueError as e:
                    raise RowError(f"{where}: {e}", row_id) from None
                samples = params.n
                bound = min(params.max_tokens or self.max_model_len, self.max_model_len) * samples
                if prompt is None:
                    prompt = row_prompt(self.tokenizer, request, self.config.chat_template)
                if self.fmt == "openai" and "max_tokens" in {**self.config.sampling, **request.overrides}:
                    check_prompt_room(params, prompt, self.max_model_len, where, row_id)  # vLLM's server's rule
                parts = [(f"row-{raw.index}", prompt, params)]
                # Chosen from the row each time it is read (a retry, a resumed run): nothing to remember.
                lora = self.adapters.for_row(request, where) if self.adapters is not None else no_adapters(request, where)
            flight = _InFlight(raw, request, part_ids=[request_id for request_id, _, _ in parts])
            try:
                for request_id, prompt, params in parts:
                    self.engine.add_request(request_id, prompt, params, lora_request=lora, **keywords)
                    self.inflight[request_id] = flight
            except self._row_errors:
                added = [request_id for request_id in flight.part_ids if request_id in self.inflight]
                self.engine.abort_request(added)  # all of the row's requests run, or none
                for request_id in added:
                    del self.inflight[request_id]
                raise
            self.progress.on_submitted(raw.index, bound, samples)
        except self._row_errors as e:
            if isinstance(e, RowError) and e.row_id is not None:
                row_id = e.row_id
            openai = request.openai if request is not None else refused_request(raw, e) if self.fmt == "openai" else None
            result = self._error_result(raw.index, row_id, _row_message(raw, e), openai)
            if isinstance(e, RowError):
                result.error_status, result.error_param = e.status, e.param
            self.pending.append((result, None))

    def _fail(self, index: int, row_id: Any, message: str, openai: OpenAIMeta | None, flight: _InFlight | None = None,
              engine_fault: bool = False) -> None:
        self.pending.append((self._error_result(index, row_id, message, openai, engine_fault), flight))

    def _error_result(self, index: int, row_id: Any, message: str, openai: Any, engine_fault: bool = False) -> RowResult:
        """The failed row's result; its message is among the summary's first failures. ``engine_fault``:
        the engine, not the request, failed (see `RowResult.engine_fault`)."""
        if len(self.errors) < _SHOWN_ERRORS:
            self.errors.append(message if message.startswith(_WHERE_PREFIXES) else f"row {index}: {message}")
        return RowResult(index=index, row_id=row_id if row_id is not None else _fallback_id(self.fmt, index), error=message,
                         openai=openai, engine_fault=engine_fault)

    def _unwritable(self, index: int, row_id: Any, flight: _InFlight | None, error: Exception, openai: Any) -> RowResult:
        """A finished row whose output could not become its output records (a bug that an odd output
        triggers): it is written as a failed row, naming the error, instead of going missing or
        stopping the job (the other rows are not at fault)."""
        what = RuntimeError(f"the row finished but its output could not be written: {type(error).__name__}: {error}")
        message = _row_message(flight.raw, what) if flight is not None else f"row {index}: {what}"
        return self._error_result(index, row_id, message, openai, engine_fault=True)

    def _step(self) -> None:
        # Finished outputs only: an output for every running row every step (its token ids and text
        # copied, ~2.5 us a row on the dev CPU) nearly doubled the host's work per sequence-step
        # (docs/perf.md 69); the progress line reads the running rows' counts when it is drawn.
        with self.watchdog.step() if self.watchdog is not None else contextlib.nullcontext():
            outputs = self.engine.step(finished_only=True)
        self.progress.on_step()
        for out in outputs:
            flight = self.inflight.get(out.request_id)
            if flight is None or not out.finished:  # (finished only was asked; never a partial row written)
                continue
            if self.pooling is not None:
                self._pooled(flight, out)
                continue
            self._count(flight, len(out.prompt_token_ids or []), sum(len(c.token_ids) for c in out.outputs))
            self._row_finished()
            del self.inflight[out.request_id]
            req = flight.request
            if out.error is not None:  # the engine ended it unfinished (its LoRA adapter could not be loaded)
                message = _row_message(flight.raw, RuntimeError(f"the engine could not finish this row: {out.error}"))
                self._fail(req.index, req.row_id, message, req.openai, flight, engine_fault=True)
                continue
            try:
                result = result_from_output(req.index, req.row_id, out, req.openai, self.keep_logprobs or _asks_logprobs(req.overrides))
            except Exception as error:  # noqa: BLE001  (this row's output, not the step: the row fails alone)
                result = self._unwritable(req.index, req.row_id, flight, error, req.openai)
            self.pending.append((result, flight))

    def _count_running(self) -> None:
        """The running rows' tokens so far, for the progress line (read from the engine, not its outputs)."""
        for request_id, flight in self.inflight.items():
            counts = self.engine.generated_token_counts(request_id)
            if counts is not None:
                self._count(flight, *counts)

    def _count(self, flight: _InFlight, prompt_tokens: int, generated: int) -> None:
        """Tell the progress what a row did since it was last counted; its prompt counts once it has output."""
        prompt = 0
        if not flight.prompt_tokens and generated:
            prompt = flight.prompt_tokens = prompt_tokens
        delta = generated - flight.generated_seen
        flight.generated_seen = generated
        if prompt or delta:
            self.progress.on_tokens(flight.raw.index, prompt, delta)

    def _pooled(self, flight: _InFlight, out: Any) -> None:
        """A pooling request is done (each finishes in one step); the row is, once all its parts are."""
        self._row_finished()
        del self.inflight[out.request_id]
        flight.outputs[out.request_id] = out
        flight.prompt_tokens += len(out.prompt_token_ids)
        self.progress.on_tokens(flight.raw.index, len(out.prompt_token_ids), 0)
        if len(flight.outputs) == len(flight.part_ids):
            assert self.pooling is not None
            req = flight.request
            try:
                result = self.pooling.result(req, [flight.outputs[i] for i in flight.part_ids])
            except NonFiniteOutput as error:  # the model's output is no result: the row's error, the engine's fault
                result = self._error_result(req.index, req.row_id, _row_message(flight.raw, error), req.openai, engine_fault=True)
            except Exception as error:  # noqa: BLE001  (this row's output, not the step: the row fails alone)
                result = self._unwritable(req.index, req.row_id, flight, error, req.openai)
            self.pending.append((result, flight))

    def _isolate(self, error: Exception) -> None:
        """A step raised: find the row behind it, so that it fails alone and the job goes on.

        Whatever slipped past the checks made when a row was read (a value the engine cannot serve,
        a bug a strange row triggers) surfaces here, with no way to tell which request caused it.
        Every row in flight is taken out and run again in two halves, one half at a time; a half
        that fails again is halved again, until the row that fails on its own becomes an error row.
        Rows run again give the same results (greedy, or their own per-row seed). A failure of the
        device itself (out of memory, a CUDA error) is no row's fault and stops the job; an engine
        that can run no more steps (a tensor-parallel worker died) is replaced first
        (``_restart_engine``). A row failing alone is held as a suspect until another row finishes.
        """
        if is_device_failure(error):
            raise error
        flights = list({id(f): f for f in self.inflight.values()}.values())
        self.drop_inflight()
        rows = sorted((f.raw for f in flights), key=lambda raw: raw.index)
        if is_engine_stopped(error):
            self._restart_engine(error)
            if len(rows) == 1 and rows[0].index not in self.alone_on_new_engine:
                # A worker killed from outside while this row ran alone would blame it: it runs
                # alone once more, on the new engine, before it can be held to account.
                self.alone_on_new_engine.add(rows[0].index)
                self.retry.appendleft(rows)
                return
        if len(rows) == 1:
            flight = flights[0]
            message = f"the engine failed on this row: {type(error).__name__}: {error}"
            self.suspects.append((flight, _row_message(flight.raw, RuntimeError(message))))
            if len(self.suspects) >= _ENGINE_BROKEN_AFTER:
                raise EngineFailure(f"{len(self.suspects)} rows in a row failed inside the engine, each on its own, the "
                                    f"last with {type(error).__name__}: {error}; the engine itself looks broken. The "
                                    "finished rows are kept: rerun the same command to continue") from error
            return
        half = len(rows) // 2
        self.retry.extendleft([rows[half:], rows[:half]])  # extendleft reverses: the first half runs first

    def _row_finished(self) -> None:
        """A row came out of the engine: the engine works, so the rows that failed alone in it are at
        fault, and become error rows."""
        self.row_finished_on_engine = True
        self.restarts_without_progress = 0
        for flight, message in self.suspects:
            self._fail(flight.raw.index, flight.request.row_id, message, flight.request.openai, engine_fault=True)
        self.suspects = []

    def _settle_suspects_at_end(self) -> None:
        """The last rows failed alone and no row came after them: they are at fault if this engine
        finished rows before them; if it never finished one, nothing says the rows are to blame."""
        if not self.suspects:
            return
        if not self.row_finished_on_engine:
            raise EngineFailure(f"the last {len(self.suspects)} row(s) each failed alone inside an engine that finished no "
                                f"row, so the engine may be at fault: {self.suspects[-1][1]}. The finished rows are "
                                "kept: rerun the same command to continue")
        self._row_finished()

    def _restart_engine(self, error: Exception) -> None:
        """The engine cannot run another step (a tensor-parallel worker died, or a step failed midway
        and the workers were stopped): replace it with a new one and run the rows again, or end the
        job. A row that breaks every engine it runs on is still found by halving (a restart a half)."""
        limit = self.max_inflight.bit_length() + 2  # enough restarts to halve every row in flight down to one
        if self.new_llm is None or self.pooling is not None or self.restarts_without_progress >= limit:
            why = "" if self.new_llm is None or self.pooling is not None else f" ({limit} engines in a row stopped)"
            raise EngineFailure(f"the engine stopped{why}: {type(error).__name__}: {error}. The finished rows are kept: "
                                "rerun the same command to continue") from error
        self.restarts_without_progress += 1
        self.notice(f"tokenmill run: the engine stopped ({type(error).__name__}: {error}); starting a new one and "
                    "running its unfinished rows again")
        with contextlib.suppress(Exception):  # stop what is left of its workers
            self.engine.executor.shutdown()
        self.llm = self.engine = None
        drop_tracebacks(error)  # their frames hold the old engine's runner (weights, KV cache)
        with contextlib.suppress(Exception):  # the old engine's weights and KV cache, before the new one loads
            cleanup_dist_env_and_memory()
        try:
            self.llm = self.new_llm()
        except Exception as load_error:  # noqa: BLE001
            raise EngineFailure(f"the engine stopped ({type(error).__name__}: {error}) and a new one could not start: "
                                f"{type(load_error).__name__}: {load_error}. The finished rows are kept: rerun the same "
                                "command to continue") from load_error
        self.engine = self.llm.llm_engine
        self.row_finished_on_engine = False

    def _commit(self) -> None:
        if not self.pending:
            return
        lines: list[bytes] = []
        try:  # every row's lines in one call: their vectors are formatted together (writers.float32_json)
            lines.append(encode_lines([record for result, _ in self.pending for record in self._records(result)]))
        except Exception:  # noqa: BLE001  (then row by row, below: a row that cannot be written fails alone)
            lines = []
        together = bool(lines)
        rows, failed, prompt_tokens, completion_tokens = [], [], 0, 0
        for position, (result, flight) in enumerate(self.pending):
            if not together:
                try:
                    lines.append(encode_lines(self._records(result)))
                except Exception as error:  # noqa: BLE001  (one row's records: it is written failed, the rest go on)
                    result = self._unwritable(result.index, result.row_id, flight, error, result.openai)
                    self.pending[position] = (result, flight)
                    lines.append(encode_lines(self._records(result)))
            rows.append(result.index)
            if result.failed:
                failed.append(result.index)
            prompt_tokens += result.prompt_tokens
            completion_tokens += result.completion_tokens
        # Only from here is a commit half done: an interrupt while the lines were made leaves
        # ``pending`` whole, for abort() to commit.
        self._committing = True
        self.journal.commit(b"".join(lines), rows, failed, prompt_tokens, completion_tokens)
        for result, flight in self.pending:
            self.progress.on_row_done(flight.raw.index if flight is not None else None, result.failed)
        self.pending = []
        self._committing = False

    def _records(self, result: RowResult) -> list[dict[str, Any]]:
        """The output records of one finished row, in the output's shape."""
        if self.shape == "openai":
            return [openai_record(result, self.model_name, self.created, self.job_key)]
        if self.pooling is not None:
            return pooling_records(result, self.config.task)
        return generic_records(result, with_lora=self.adapters is not None)

    def drop_inflight(self) -> None:
        """Take every running row out of the engine unfinished (a rerun, or a retry, computes it again)."""
        if self.inflight:
            self.engine.abort_request(list(self.inflight))
            for flight in self.inflight.values():
                self.progress.on_dropped(flight.raw.index)
            self.inflight.clear()

    def abort(self) -> None:
        """Stop early: keep what finished, drop what runs (a rerun recomputes those rows).

        If the interrupt landed inside a commit, committing again could write rows twice; the
        half-done commit is left as a crash would leave it, for the next run's journal replay.
        """
        self.drop_inflight()
        if not self._committing:
            self._commit()


def _asks_logprobs(sampling: dict[str, Any]) -> bool:
    """Whether these sampling values ask for sample logprobs: ``logprobs``, or ``logprob_token_ids``
    (vLLM's ``SamplingParams.num_logprobs`` rule)."""
    return sampling.get("logprobs") is not None or bool(sampling.get("logprob_token_ids"))


def _fallback_id(fmt: str, index: int) -> Any:
    return None if fmt == "openai" else index


def _row_message(raw: RawRow, error: BaseException) -> str:
    message = str(error) or type(error).__name__
    if isinstance(error, RowError) or message.startswith(_WHERE_PREFIXES):
        return message
    return f"{raw.where or f'row {raw.index}'}: {message}"


def _print_notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
