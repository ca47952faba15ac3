"""The `tokenmill run` loop: stream rows in, keep a bounded number of requests in flight, write each result as it finishes.

    rows ──► build request ──► engine.add_request ──► engine.step() ──► finished? ──► journal.commit
      │            │ bad row                                                             ▲
      │            └──────────────────────────► error row ───────────────────────────────┘
      └─ rows the journal says are done are skipped (resume)

Memory stays flat whatever the input size: the reader streams, at most ``max_inflight`` requests
(a few times ``max_num_seqs``, enough to keep every batch full) are inside the engine, and every
finished row is written at the end of the step that finished it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from tokenmill.batch.journal import Journal, ResumeError, fingerprint, recorded_settings, sidecar_dir
from tokenmill.batch.openai_batch import build_openai_request, openai_record
from tokenmill.batch.pooling import PoolingRows, pooling_parquet_schema, pooling_records
from tokenmill.batch.progress import Progress, format_duration
from tokenmill.batch.readers import RawRow, detect_format, read_rows, scan_input
from tokenmill.batch.requests import PromptSettings, RowError, RowRequest, build_row_request, row_sampling_params
from tokenmill.batch.results import RowResult, generic_records, result_from_output
from tokenmill.batch.writers import encode_lines, jsonl_to_parquet, output_format

DEFAULT_MODEL = "smollm2-135m-instruct"
EXIT_OK, EXIT_ROWS_FAILED, EXIT_INTERRUPTED = 0, 3, 130
_INFLIGHT_PER_SEQ = 2
_MAX_PENDING_ERRORS = 256  # commit early when a stretch of bad rows piles up
_SHOWN_ERRORS = 5
# Engine options that change speed or memory but not what is generated: a resumed run may change them.
_THROUGHPUT_ONLY = {
    "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager",
    "device", "tensor_parallel_size", "enable_prefix_caching", "block_size", "disable_log_stats", "swap_space",
}


@dataclass
class JobConfig:
    input: str
    output: str
    model: str = DEFAULT_MODEL
    input_format: str = "auto"
    prompt: PromptSettings = field(default_factory=PromptSettings)
    sampling: dict[str, Any] = field(default_factory=dict)  # job-wide SamplingParams values (rows may override)
    seed: int = 0  # per-row seeds derive from it (see requests.row_sampling_params)
    engine: dict[str, Any] = field(default_factory=dict)  # LLM(...) keyword arguments
    chat_template: str | None = None
    overwrite: bool = False
    max_inflight: int | None = None
    fsync_interval: float = 1.0
    progress: bool = True
    log_interval: float = 10.0
    task: str = "generate"  # or a pooling task: "embed", "classify", "score" (see batch/pooling.py)
    pooling: dict[str, Any] = field(default_factory=dict)  # job-wide PoolingParams values (rows may override)
    replicas: int = 1  # engine processes on this host (batch/replicas.py), or Ray replicas with ray_address
    ray_address: str | None = None  # run on a Ray cluster through Ray Data (batch/ray_job.py)


@dataclass
class JobSummary:
    output: str
    rows_total: int | None
    rows_done: int  # all attempts together
    failed: int  # all attempts together
    resumed_rows: int  # done by earlier attempts
    prompt_tokens: int  # this attempt
    completion_tokens: int  # this attempt
    wall_s: float
    run_s: float  # wall time minus model loading
    complete: bool
    interrupted: bool = False
    already_complete: bool = False
    repaired_bytes: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures of this attempt

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_ROWS_FAILED if self.failed else EXIT_OK

    def report(self) -> str:
        if self.already_complete:
            head = f"{self.output} is already complete: {self.rows_done} rows, {self.failed} failed (pass --overwrite to run again)"
            return head
        state = "interrupted" if self.interrupted else "done"
        total = f"/{self.rows_total}" if self.rows_total is not None else ""
        lines = [f"tokenmill run {state}: {self.rows_done}{total} rows, {self.failed} failed, wall time {format_duration(self.wall_s)}"]
        if self.resumed_rows:
            lines.append(f"  resumed: {self.resumed_rows} rows were done by an earlier attempt")
        if self.repaired_bytes:
            lines.append(f"  repaired: cut {self.repaired_bytes} bytes of unfinished output left by the earlier attempt")
        run = max(self.run_s, 1e-9)
        lines.append(
            f"  tokens: {self.prompt_tokens:,} prompt, {self.completion_tokens:,} generated; "
            f"throughput {self.prompt_tokens / run:,.1f} prompt tok/s, {self.completion_tokens / run:,.1f} generated tok/s"
        )
        if self.errors:
            lines.append(f"  failures (the 'error' field of {self.output} has each one):")
            lines.extend(f"    {e}" for e in self.errors)
        if self.interrupted:
            lines.append("  rerun the same command to continue where this attempt stopped")
        lines.append(f"  output: {self.output}")
        return "\n".join(lines)


def job_settings(config: JobConfig, input_format: str, input_info: Any, output_shape: str) -> dict[str, Any]:
    """Everything that decides what the output holds: a resumed run must match it exactly."""
    settings = {
        "input_format": input_format,
        "input_digest": input_info.digest,
        "input_size": input_info.size,
        "model": config.model,
        "engine": {k: v for k, v in sorted(config.engine.items()) if k not in _THROUGHPUT_ONLY},
        "prompt": dataclasses.asdict(config.prompt),
        "chat_template": config.chat_template,
        "sampling": dict(sorted(config.sampling.items())),
        "seed": config.seed,
        "output_shape": output_shape,
    }
    if config.task != "generate":  # only then, so generation jobs started earlier still resume
        settings.update(task=config.task, pooling=dict(sorted(config.pooling.items())))
    return settings


def run_job(config: JobConfig, llm: Any = None, stderr: TextIO | None = None,
            should_stop: Callable[[], bool] | None = None) -> JobSummary:
    """Run (or resume) a batch job; `llm` may be a loaded `tokenmill.LLM` (tests share one).

    ``should_stop`` is polled once per step: when it turns true the job stops tidily (in-flight
    requests are dropped, finished ones are kept), as it does on KeyboardInterrupt.
    """
    started = time.monotonic()
    input_path, output = config.input, config.output
    if not os.path.isfile(input_path):
        raise ValueError(f"input {input_path!r} does not exist or is not a file")
    if os.path.abspath(input_path) in (os.path.abspath(output), os.path.abspath(sidecar_dir(output))):
        raise ValueError("the output must not be the input file")
    fmt = detect_format(input_path, config.input_format)
    if fmt == "openai" and config.task != "generate":
        raise ValueError(f"--task {config.task} reads rows (JSONL, CSV, Parquet), not OpenAI batch requests")
    out_fmt = output_format(output)
    shape = "openai" if fmt == "openai" and out_fmt == "jsonl" else "generic"
    info = scan_input(input_path, fmt)
    config = keep_deterministic(config, stderr)
    settings = job_settings(config, fmt, info, shape)
    data_path = output if out_fmt == "jsonl" else os.path.join(sidecar_dir(output), "staging.jsonl")
    with Journal.open(output, data_path, settings, overwrite=config.overwrite, fsync_interval=config.fsync_interval) as journal:
        if journal.complete:
            total = journal.total()
            return JobSummary(output, info.rows, total.rows, total.failed, total.rows, 0, 0,
                              time.monotonic() - started, 0.0, complete=True, already_complete=True)
        progress = Progress(info.rows, journal.resumed_rows, stream=stderr, enabled=config.progress,
                            log_interval=config.log_interval)
        interrupted, errors = False, []
        if info.rows is None or journal.resumed_rows < info.rows:
            if config.replicas > 1 or config.ray_address is not None:
                if llm is not None:
                    raise ValueError("replicas load their own models: pass no llm with replicas or ray_address")
                loop: Any = _parallel_loop(config, journal, progress, fmt, shape, fingerprint(settings), should_stop, stderr)
            else:
                if llm is None:
                    llm = load_llm(config)
                progress.start = time.monotonic()  # the summary's throughput leaves model loading out
                loop = _Loop(config, llm, journal, progress, fmt, shape, fingerprint(settings), should_stop)
            try:
                interrupted = not loop.run(read_rows(input_path, fmt))
            except KeyboardInterrupt:
                interrupted = True
            if interrupted:
                loop.abort()
            errors = loop.errors
        progress.close()
        if not interrupted:
            if out_fmt == "parquet":
                schema = pooling_parquet_schema(config.task) if config.task != "generate" else None
                jsonl_to_parquet(data_path, output, schema)
            journal.mark_complete()
        else:
            journal.sync()
        total = journal.total()
        return JobSummary(
            output=output, rows_total=info.rows, rows_done=total.rows, failed=total.failed,
            resumed_rows=journal.resumed_rows, prompt_tokens=journal.current.prompt_tokens,
            completion_tokens=journal.current.completion_tokens, wall_s=time.monotonic() - started,
            run_s=time.monotonic() - progress.start, complete=not interrupted, interrupted=interrupted,
            repaired_bytes=journal.repaired_bytes, errors=errors,
        )


def keep_deterministic(config: JobConfig, stderr: TextIO | None = None) -> JobConfig:
    """A deterministic run resumed without saying so stays deterministic: the journal recorded
    ``deterministic`` among its engine settings, and the rows written before and after a resume
    must come from the same kernels. An explicit ``deterministic=False`` against such a journal is
    a settings change (refused); otherwise False is dropped, so it matches a run that never said."""
    explicit = config.engine.get("deterministic")
    recorded = not config.overwrite and bool(((recorded_settings(config.output) or {}).get("engine") or {}).get("deterministic"))
    if explicit is None and recorded:
        if stderr is not None:
            print(f"resuming a deterministic run: {config.output} continues in deterministic mode", file=stderr)
        return dataclasses.replace(config, engine={**config.engine, "deterministic": True})
    if explicit is False and not recorded:
        return dataclasses.replace(config, engine={k: v for k, v in config.engine.items() if k != "deterministic"})
    return config


def _parallel_loop(config: JobConfig, journal: Journal, progress: Progress, fmt: str, shape: str, job_key: str,
                   should_stop: Callable[[], bool] | None, stderr: TextIO | None) -> Any:
    """The job loop spread over several engines: replica processes on this host, or a Ray cluster.
    Either has `_Loop`'s interface (run, abort, errors) and commits through the same journal."""
    if config.ray_address is not None:
        from tokenmill.batch.ray_job import RayJobLoop

        return RayJobLoop(config, journal, progress, fmt, shape, job_key, should_stop)
    from tokenmill.batch.replicas import ReplicaPool

    return ReplicaPool(config, journal, progress, fmt, shape, job_key, should_stop, stderr)


def load_llm(config: JobConfig) -> Any:
    from tokenmill import LLM

    engine = dict(config.engine)
    if config.task != "generate":
        engine.setdefault("runner", "pooling")
    return LLM(model=config.model, seed=config.seed, **engine)


def base_sampling(llm: Any, explicit: dict[str, Any]) -> dict[str, Any]:
    """The model's defaults (generation_config), then the job's explicit values."""
    from tokenmill.batch.requests import sampling_field_names

    names = sampling_field_names()
    defaults = llm.get_default_sampling_params()
    values = {name: getattr(defaults, name) for name in names if hasattr(defaults, name)}
    values.update(explicit)
    return values


@dataclass
class _InFlight:
    request: RowRequest
    prompt_tokens: int = 0  # as reported to the progress (0 until the first output)
    generated_seen: int = 0
    # Pooling rows: the engine requests of the row and the outputs of those already finished.
    part_ids: list[str] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)


class _Loop:
    def __init__(self, config: JobConfig, llm: Any, journal: Journal, progress: Progress, fmt: str, shape: str,
                 job_key: str, should_stop: Callable[[], bool] | None = None):
        self.config, self.llm, self.journal, self.progress = config, llm, journal, progress
        self.should_stop = should_stop or (lambda: False)
        self._committing = False  # True while a commit is half done (an interrupt landed inside it)
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.fmt, self.shape, self.job_key = fmt, shape, job_key
        self.model_name = config.model
        self.created = int(time.time())
        self.base = base_sampling(llm, config.sampling)
        self.pooling = PoolingRows(config.task, llm, config.prompt, config.pooling) if config.task != "generate" else None
        self.keep_logprobs = self.base.get("logprobs") is not None
        self.max_inflight = config.max_inflight or _INFLIGHT_PER_SEQ * _max_num_seqs(self.engine, config)
        self.inflight: dict[str, _InFlight] = {}
        self.pending: list[tuple[RowResult, _InFlight | None]] = []  # finished rows (and their flight)
        self.errors: list[str] = []
        from jinja2 import TemplateError  # chat templates can raise their own errors for odd conversations

        self._row_errors: tuple[type[BaseException], ...] = (ValueError, TypeError, TemplateError)

    def run(self, rows: Any) -> bool:
        """Feed the engine until every row is written; False when stopped early by ``should_stop``."""
        exhausted = False
        while True:
            if self.should_stop():
                return False
            while not exhausted and len(self.inflight) < self.max_inflight:
                raw = next(rows, None)
                if raw is None:
                    exhausted = True
                elif not self.journal.is_done(raw.index):
                    self._submit(raw)
                    if len(self.pending) >= _MAX_PENDING_ERRORS:
                        self._commit()
            if self.inflight:
                self._step()
            elif exhausted:
                self._commit()
                return True
            self._commit()
            self.progress.maybe_draw()

    def _submit(self, raw: RawRow) -> None:
        request: RowRequest | None = None
        row_id = None
        try:
            if raw.error is not None:
                raise RowError(raw.error)
            if self.pooling is not None:
                request, parts = self.pooling.build(raw)
                row_id = request.row_id
            else:
                request = build_openai_request(raw) if self.fmt == "openai" else build_row_request(raw, self.config.prompt)
                row_id = request.row_id
                parts = [(f"row-{raw.index}", self._prompt(request, raw.index),
                          row_sampling_params(self.base, request.overrides, raw.index, self.config.seed, row_id))]
            flight = _InFlight(request, part_ids=[request_id for request_id, _, _ in parts])
            try:
                for request_id, prompt, params in parts:
                    self.engine.add_request(request_id, prompt, params)
                    self.inflight[request_id] = flight
            except self._row_errors:
                added = [request_id for request_id in flight.part_ids if request_id in self.inflight]
                self.engine.abort_request(added)  # all of the row's requests run, or none
                for request_id in added:
                    del self.inflight[request_id]
                raise
            self.progress.on_submitted()
        except self._row_errors as e:
            if isinstance(e, RowError) and e.row_id is not None:
                row_id = e.row_id
            self._fail(raw.index, row_id, _row_message(raw, e), request)

    def _prompt(self, request: RowRequest, index: int) -> Any:
        if request.messages is not None:
            from tokenmill.inputs import render_chat_prompt

            ids = render_chat_prompt(self.tokenizer, request.messages, chat_template=self.config.chat_template,
                                     where=f"row {index} messages")
            return {"prompt_token_ids": ids}
        if request.prompt_token_ids is not None:
            return {"prompt_token_ids": request.prompt_token_ids}
        return request.prompt

    def _fail(self, index: int, row_id: Any, message: str, request: RowRequest | None) -> None:
        meta = request.openai if request is not None else None
        self.pending.append((RowResult(index=index, row_id=row_id if row_id is not None else _fallback_id(self.fmt, index), error=message, openai=meta), None))
        if len(self.errors) < _SHOWN_ERRORS:
            self.errors.append(f"row {index}: {message}")

    def _step(self) -> None:
        for out in self.engine.step():
            flight = self.inflight.get(out.request_id)
            if flight is None:
                continue
            if self.pooling is not None:
                self._pooled(flight, out)
                continue
            prompt = 0
            if not flight.prompt_tokens:
                prompt = flight.prompt_tokens = len(out.prompt_token_ids or [])
            generated = sum(len(c.token_ids) for c in out.outputs)
            delta = generated - flight.generated_seen
            flight.generated_seen = generated
            self.progress.on_tokens(prompt, delta)
            if out.finished:
                del self.inflight[out.request_id]
                req = flight.request
                result = result_from_output(req.index, req.row_id, out, req.openai, self.keep_logprobs or _asks_logprobs(req))
                self.pending.append((result, flight))

    def _pooled(self, flight: _InFlight, out: Any) -> None:
        """A pooling request is done (each finishes in one step); the row is, once all its parts are."""
        del self.inflight[out.request_id]
        flight.outputs[out.request_id] = out
        flight.prompt_tokens += len(out.prompt_token_ids)
        self.progress.on_tokens(len(out.prompt_token_ids), 0)
        if len(flight.outputs) == len(flight.part_ids):
            assert self.pooling is not None
            result = self.pooling.result(flight.request, [flight.outputs[i] for i in flight.part_ids])
            self.pending.append((result, flight))

    def _commit(self) -> None:
        if not self.pending:
            return
        self._committing = True
        records: list[dict[str, Any]] = []
        rows, failed, prompt_tokens, completion_tokens = [], [], 0, 0
        for result, _ in self.pending:
            if self.shape == "openai":
                records.append(openai_record(result, self.model_name, self.created, self.job_key))
            elif self.pooling is not None:
                records.extend(pooling_records(result, self.config.task))
            else:
                records.extend(generic_records(result))
            rows.append(result.index)
            if result.failed:
                failed.append(result.index)
            prompt_tokens += result.prompt_tokens
            completion_tokens += result.completion_tokens
        self.journal.commit(encode_lines(records), rows, failed, prompt_tokens, completion_tokens)
        for result, flight in self.pending:
            if flight is None:
                self.progress.on_row_done(result.failed)
            else:
                self.progress.on_row_done(result.failed, flight.prompt_tokens, flight.generated_seen, was_inflight=True)
        self.pending = []
        self._committing = False

    def abort(self) -> None:
        """Stop early: keep what finished, drop what runs (a rerun recomputes those rows).

        If the interrupt landed inside a commit, committing again could write rows twice; the
        half-done commit is left as a crash would leave it, for the next run's journal replay.
        """
        if self.inflight:
            self.engine.abort_request(list(self.inflight))
            self.inflight.clear()
        if not self._committing:
            self._commit()


def _max_num_seqs(engine: Any, config: JobConfig) -> int:
    for holder in (getattr(engine, "config", None), getattr(engine, "scheduler_config", None), getattr(engine, "scheduler", None)):
        value = getattr(holder, "max_num_seqs", None)
        if isinstance(value, int) and value > 0:
            return value
    return int(config.engine.get("max_num_seqs") or 256)


def _asks_logprobs(request: RowRequest) -> bool:
    return request.overrides.get("logprobs") is not None


def _fallback_id(fmt: str, index: int) -> Any:
    return None if fmt == "openai" else index


def _row_message(raw: RawRow, error: BaseException) -> str:
    message = str(error) or type(error).__name__
    if isinstance(error, RowError) or message.startswith(("row ", "line ", "record ")):
        return message
    return f"{raw.where or f'row {raw.index}'}: {message}"


__all__ = ["JobConfig", "JobSummary", "ResumeError", "run_job", "DEFAULT_MODEL"]
