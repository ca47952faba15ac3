"""`tokenmill run`: check the input and output, open the journal (resume), run the job loop
(`loop.JobLoop` here, or spread over replicas: `replicas.py`, `ray_job.py`), finish the output and
sum the run up."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Callable, TextIO

from tokenmill.batch.config import DEFAULT_MODEL, JobConfig
from tokenmill.batch.journal import Journal, RecordReader, ResumeError, fingerprint, recorded_settings, sidecar_dir
from tokenmill.batch.job_engine import load_llm
from tokenmill.batch.loop import EngineFailure, JobLoop
from tokenmill.batch.lora_modules import check_lora_modules
from tokenmill.batch.openai_batch import OpenAIRecordReader
from tokenmill.batch.pooling import pooling_parquet_schema
from tokenmill.batch.progress import Progress, tell
from tokenmill.batch.readers import JSONL_SAMPLE_ROWS, detect_format, input_columns, read_rows, scan_input
from tokenmill.batch.stall_watchdog import StallWatchdog
from tokenmill.batch.requests import check_columns
from tokenmill.batch.results import read_result_record
from tokenmill.batch.summary import JobSummary
from tokenmill.batch.writers import (
    check_output_path, describe_file_error, generic_parquet_schema, is_output_file, jsonl_to_parquet, output_format,
)

# Engine options that change speed or memory but not what is generated: a resumed run may change them.
_THROUGHPUT_ONLY = {
    "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager",
    "device", "tensor_parallel_size", "enable_prefix_caching", "block_size", "disable_log_stats", "swap_space",
    "max_loras", "max_cpu_loras",  # how many adapters share a step or stay read, not what a row generates
}


class OutputError(ValueError):
    """The output (or the input) cannot be written or read: a read-only folder, a full disk..."""


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
    if config.lora_modules:  # likewise; names and folders decide which weights each row runs with
        settings["lora_modules"] = dict(config.lora_modules)
    return settings


def run_job(config: JobConfig, llm: Any = None, stderr: TextIO | None = None,
            should_stop: Callable[[], bool] | None = None) -> JobSummary:
    """Run (or resume) a batch job; `llm` may be a loaded `tokenmill.LLM` (tests share one).

    ``should_stop`` is polled once per step: when it turns true the job stops tidily (in-flight
    requests are dropped, finished ones are kept), as it does on KeyboardInterrupt. A file that
    cannot be written or read raises `OutputError` saying which and what to do; what was
    committed before stays, and rerunning the same command continues from there.
    """
    try:
        return _run_job(config, llm, stderr, should_stop)
    except OSError as e:
        raise OutputError(describe_file_error(e, config.input, config.output)) from None


def _run_job(config: JobConfig, llm: Any, stderr: TextIO | None, should_stop: Callable[[], bool] | None) -> JobSummary:
    started = time.monotonic()
    input_path, output = config.input, config.output
    if not os.path.isfile(input_path):
        raise ValueError(f"input {input_path!r} does not exist or is not a file")
    real_input = os.path.realpath(input_path)
    if is_output_file(real_input, os.path.realpath(output)):
        raise ValueError(f"the output must not be the input file ({input_path} is {real_input})"
                         if real_input != os.path.abspath(input_path) else "the output must not be the input file")
    check_output_path(output)
    fmt = detect_format(input_path, config.input_format)
    out_fmt = output_format(output)
    if fmt == "openai" and config.task not in ("generate", "embed", "score"):
        raise ValueError(f"--task {config.task} reads rows (JSONL, CSV, Parquet), not OpenAI batch requests (those run "
                         "--task generate, --task embed for /v1/embeddings lines, --task score for /v1/score and /v1/rerank)")
    if fmt == "openai" and config.task != "generate" and out_fmt != "jsonl":
        raise ValueError(f"an OpenAI batch file's {config.task} lines are answered as OpenAI output lines: give a .jsonl "
                         f"output, not {output!r}")
    shape = "openai" if fmt == "openai" and out_fmt == "jsonl" else "generic"
    info = scan_input(input_path, fmt)
    config = keep_deterministic(config, stderr)
    config = check_lora_modules(config)  # the adapter folders exist: before the model loads
    columns = input_columns(input_path, fmt)
    if columns is not None and info.rows:  # fail fast, before the model loads
        _check_columns(columns, config, input_path if fmt != "jsonl" else f"{input_path} (its first {JSONL_SAMPLE_ROWS} rows)")
    settings = job_settings(config, fmt, info, shape)
    data_path = output if out_fmt == "jsonl" else os.path.join(sidecar_dir(output), "staging.jsonl")
    # The record reader is Journal.open's alone: an OpenAI output's, once it has rebuilt a lost journal,
    # holds an id -> row table of the whole input, which a local here would keep for the whole run.
    with Journal.open(output, data_path, settings, overwrite=config.overwrite, fsync_interval=config.fsync_interval,
                      read_record=_record_reader(shape, fingerprint(settings), info.rows)) as journal:
        if journal.complete:
            total = journal.total()
            return JobSummary(output, info.rows, total.rows, total.failed, total.rows, 0, 0,
                              time.monotonic() - started, 0.0, complete=True, already_complete=True, input=input_path)
        progress = Progress(info.rows, journal.resumed_rows, stream=stderr, enabled=config.progress,
                            log_interval=config.log_interval, engines=config.replicas)
        interrupted, errors = False, []
        if info.rows is None or journal.resumed_rows < info.rows:
            watchdog: StallWatchdog | None = None  # replicas keep their own
            if config.replicas > 1 or config.ray_address is not None:
                if llm is not None:
                    raise ValueError("replicas load their own models: pass no llm with replicas or ray_address")
                loop: Any = _parallel_loop(config, journal, progress, fmt, shape, fingerprint(settings), should_stop, stderr,
                                           info.size)
            else:
                try:
                    loop = _engine_loop(config, llm, journal, progress, fmt, shape, fingerprint(settings), should_stop, stderr)
                except BaseException as error:  # stopped while the model loaded (`tokenmill run` stops at once then)?
                    if not _raised_by_interrupt(error):
                        raise
                    loop = None  # no row ran: nothing to write or drop; the summary says interrupted
                    interrupted = True
                watchdog = loop.watchdog if loop is not None else None
            if loop is not None:
                try:
                    with watchdog or contextlib.nullcontext():
                        interrupted = not loop.run(read_rows(input_path, fmt, info.size))
                except KeyboardInterrupt:
                    interrupted = True
                except BaseException:
                    if isinstance(loop, JobLoop):  # the engine outlives the job (tests, notebooks): leave it empty
                        with contextlib.suppress(Exception):
                            loop.drop_inflight()
                    raise
                if interrupted:
                    loop.abort()
                errors = loop.errors
        progress.close()
        _tell_if_grown(input_path, fmt, info.size, stderr)
        if not interrupted and info.rows is not None and journal.total().rows < info.rows:
            journal.sync()  # what finished stays; a rerun runs the rest
            raise ValueError(
                f"{input_path} gave {journal.total().rows} rows where the scan before the run counted {info.rows}: "
                "was it changed or removed while the job ran? The finished rows are kept; restore the input "
                "and rerun the same command to run the rest")
        if not interrupted:
            try:
                if out_fmt == "parquet":
                    schema = pooling_parquet_schema(config.task) if config.task != "generate" else \
                        generic_parquet_schema(with_lora=bool(config.lora_modules))
                    jsonl_to_parquet(data_path, output, schema)
                journal.mark_complete()
            except KeyboardInterrupt:  # a second Ctrl-C: the staging file stays, and the rerun writes the output
                interrupted = True
        else:
            # A second Ctrl-C while a stopped job fsyncs skips the fsync (the lines reached the OS), not the summary.
            with contextlib.suppress(KeyboardInterrupt):
                journal.sync()
        total = journal.total()
        return JobSummary(
            output=output, rows_total=info.rows, rows_done=total.rows, failed=total.failed,
            resumed_rows=journal.resumed_rows, prompt_tokens=journal.current.prompt_tokens,
            completion_tokens=journal.current.completion_tokens, wall_s=time.monotonic() - started,
            run_s=time.monotonic() - progress.start, complete=not interrupted, interrupted=interrupted,
            repaired_bytes=journal.repaired_bytes, rebuilt_rows=journal.rebuilt_rows, errors=errors, input=input_path,
        )


def _engine_loop(config: JobConfig, llm: Any, journal: Journal, progress: Progress, fmt: str, shape: str, job_key: str,
                 should_stop: Callable[[], bool] | None, stderr: TextIO | None) -> JobLoop:
    """The single-engine loop, with the engine loaded unless ``llm`` is given. An engine the job loads
    itself is the job's to replace when it stops for good (a tensor-parallel worker died); one passed
    in stays the caller's. Held by the loop only, so that a replaced engine's memory can be freed."""
    new_llm = None if llm is not None else (lambda: load_llm(config))
    engine_llm = llm if llm is not None else load_llm(config)
    progress.start = time.monotonic()  # the summary's throughput leaves model loading out
    watchdog = StallWatchdog(config.stall_timeout, stream=stderr) if config.stall_timeout > 0 else None
    return JobLoop(config, engine_llm, journal, progress, fmt, shape, job_key, should_stop, new_llm=new_llm,
                   notice=lambda message: tell(message, stderr or sys.stderr), watchdog=watchdog)


def _tell_if_grown(input_path: str, fmt: str, scanned: int, stderr: TextIO | None) -> None:
    """Rows appended to the input while the job ran were not run (`readers.ScannedInput`): say so."""
    with contextlib.suppress(OSError):
        if fmt != "parquet" and os.path.getsize(input_path) > scanned:
            tell(f"tokenmill run: {input_path} grew while the job ran; only the rows it held when the job started "
                 "were run (the rows added since are another job's)", stderr or sys.stderr)


def _raised_by_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is a KeyboardInterrupt (the CLI's stop) or was raised because of one. The
    stop's KeyboardInterrupt is raised wherever the model load is; inside a ``__set_name__`` (every
    dataclass field has one, and torch's and transformers' imports define hundreds) Python 3.11 hands
    it on as a RuntimeError caused by it."""
    for _ in range(16):  # a chain of causes is short; a cycle is not followed for ever
        if error is None or isinstance(error, KeyboardInterrupt):
            return error is not None
        error = error.__cause__ or error.__context__
    return False


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


def _check_columns(columns: list[str], config: JobConfig, source: str) -> None:
    if config.task == "score":
        missing = [name for name in ("text_1", "text_2") if name not in columns]
        if missing:
            raise ValueError(f"{source} has no column(s) {missing}: --task score reads the pair from text_1 and text_2 "
                             f"(its columns: {sorted(columns)[:20]})")
        return
    check_columns(columns, config.prompt, source)


def _record_reader(shape: str, job_key: str, rows: int | None) -> RecordReader:
    """How to read an output record back (a lost journal is rebuilt from the output)."""
    return OpenAIRecordReader(job_key, rows or 0) if shape == "openai" else read_result_record


def _parallel_loop(config: JobConfig, journal: Journal, progress: Progress, fmt: str, shape: str, job_key: str,
                   should_stop: Callable[[], bool] | None, stderr: TextIO | None, input_size: int) -> Any:
    """The job loop spread over several engines: replica processes on this host, or a Ray cluster.
    Either has `JobLoop`'s interface (run, abort, errors) and commits through the same journal."""
    if config.ray_address is not None:
        from tokenmill.batch.ray_job import RayJobLoop

        return RayJobLoop(config, journal, progress, fmt, shape, job_key, should_stop)
    from tokenmill.batch.replicas import ReplicaPool

    return ReplicaPool(config, journal, progress, fmt, shape, job_key, should_stop, stderr, input_size)


__all__ = ["JobConfig", "JobSummary", "EngineFailure", "OutputError", "ResumeError", "run_job", "DEFAULT_MODEL"]
