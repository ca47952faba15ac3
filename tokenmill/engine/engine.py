"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

``add_request`` validates and queues (`Intake`); ``step`` schedules (`Scheduler`), launches the
model once (`Executor`), and reads the step back: the scheduler appends the sampled tokens,
applies stop conditions and frees finished sequences' blocks, and the `OutputProcessor` builds
the outputs. The `LLM` class drives it in a loop; the batch job drives it directly to write
results as they finish.

With ``async_scheduling`` (the default on GPUs) a step is launched before the previous step's
sampled ids are read back: ``step`` schedules and launches step N+1, then reads step N's ids and
does its bookkeeping while the device runs N+1. A sequence that step N finished is then computed
once more in N+1 and that token is dropped; a sequence that reaches max_tokens is not scheduled
again. Grammars (structured outputs) keep the overlap: a step with grammar rows launches its
forward only, and its draw once step N's tokens are in the matchers (`StepResult.pending_draw`).
Requests whose sampling reads all earlier output ids on the host (Python logits processors) and
beam searches (the next beams depend on this step's logprobs) make the engine read each step back
before scheduling the next (`Request.needs_sync`); penalties and bad words keep their history on
the device.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from tokenmill.config import EngineConfig
from tokenmill.distributed.executor import Executor
from tokenmill.engine.controls import EngineControls
from tokenmill.engine.intake import Intake
from tokenmill.engine.protocol import check_add_request_keywords, request_id_list
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request, Sequence
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step import RequestCodeError, SchedulerOutput, StepResult
from tokenmill.fatal_errors import is_device_failure
from tokenmill.inputs import PromptType, tokenize_prompts
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.lora.slots import AdapterBook, AdapterLoadError
    from tokenmill.metrics.stats import EngineMetrics
    from tokenmill.models.source import ModelSource

logger = logging.getLogger(__name__)
STATS_LOG_INTERVAL_S = 10.0
# Worker methods collective_rpc refuses: the engine keeps their books (call the method named
# instead), or runs them itself at start-up or in a step (None): called by hand they would leave
# the engine's books wrong (initialize_cache reallocates the KV cache under its block tables).
ENGINE_KEPT_METHODS: dict[str, str | None] = {
    "sleep": "LLM.sleep()", "wake_up": "LLM.wake_up()", "start_profile": "LLM.start_profile()",
    "stop_profile": "LLM.stop_profile()", "cache_lora": "LLMEngine.add_lora()", "drop_lora": "LLMEngine.remove_lora()",
    "pin_lora": "LLMEngine.pin_lora()", "load_lora": None, "initialize_cache": None, "execute_model": None,
    "use_grammars": None,
}
# Worker methods that replace weights: the cached prefix blocks then hold stale keys and values.
WEIGHT_WRITING_METHODS = ("reload_weights", "update_weights")


class LLMEngine(EngineControls):  # EngineControls: sleep, profiling, weight transfer, metrics
    """The engine of a generative model (`tokenmill.engine_factory.create_engine` picks it)."""

    @classmethod
    def from_engine_args(cls, engine_args: "EngineArgs", usage_context: Any = None) -> "LLMEngine":
        """vLLM's constructor: the engine for ``engine_args`` (a generative model's; `LLM` serves pooling models)."""
        from tokenmill.engine_inputs import resolve_engine_inputs

        engine_args.validate()
        config, source, tokenizer = resolve_engine_inputs(engine_args)
        return cls(config, source, tokenizer, engine_args.load_format)

    def __init__(self, config: EngineConfig, source: "ModelSource", tokenizer: Any, load_format: str = "auto"):
        if config.pooling is not None:
            raise ValueError(f"model {config.model!r} is a pooling model; PoolingEngine serves it")
        self.config = config
        self.model_config = config  # vLLM code reads llm_engine.model_config.max_model_len
        self.source = source
        self.tokenizer = tokenizer
        # Loads the model on every tensor-parallel rank and sizes and allocates the KV cache there;
        # the engine steps rank 0's runner (tokenmill/distributed/ when there are several ranks).
        self.executor = Executor(config, source, load_format)
        try:
            self._set_up(config)
        except BaseException:
            # Stopped here, not when the half-built engine is collected: the error's traceback holds
            # it (and its workers, which keep their shards and KV caches) as long as the caller keeps the error.
            self.executor.shutdown()
            raise

    def _set_up(self, config: EngineConfig) -> None:
        """Everything the engine builds around its loaded executor: the KV books, the scheduler, the rest."""
        num_blocks = self.executor.num_blocks
        # The CPU's default pool becomes resident page by page: let it grow with the work (see kv_cache.py).
        grow = config.device.type == "cpu" and config.kv_cache_memory_bytes is None
        self.kv = KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching, grow_on_demand=grow)
        self.intake = Intake(self.config, self.tokenizer, self.kv.num_usable_blocks, self.executor.use_grammars)
        self.scheduler = Scheduler(
            self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.chunked_prefill,
            eos_token_ids=frozenset({config.primary_eos_token_id}) if config.primary_eos_token_id is not None
            else config.eos_token_ids, new_sequence=self.intake.new_sequence,
            max_loras=config.lora.max_loras if config.lora is not None else None,
            priority=config.scheduling_policy == "priority",
            copy_partial_blocks=config.tensor_parallel_size == 1,  # the runner copies on rank 0 alone
        )
        self.adapters = _adapter_book(config, self.executor)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._in_flight: StepResult[Sequence] | None = None  # launched, not yet read back
        self._history_readers: set[str] = set()  # live requests that force synchronous steps (needs_sync)
        self._undelivered: list[RequestOutput] = []  # built by a step that then failed: the next step's (step)
        self.stats = EngineStats()
        self.metrics = _start_metrics(config)
        self.asleep: set[str] = set()  # "weights" / "kv_cache" while asleep (LLM.sleep)
        self.weight_version = 0  # bumped by update_weights
        self._last_stats_log = time.monotonic()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        prompt_text: str | None = None,
        *,
        index: int | None = None,
        seed: int | None = None,
    ) -> str:
        """Validate and queue one request; a ValueError leaves the engine untouched. Returns its id.

        With `BeamSearchParams` the request is a beam search (see `tokenmill.engine.beam_search`).
        vLLM's keywords: ``arrival_time`` (wall-clock ``time.time()`` seconds, as vLLM's) dates the
        request for its metrics (kept on the engine's monotonic clock); ``tokenization_kwargs`` go to
        the tokenizer for a text prompt; ``prompt_text`` is a token prompt's text for its output; ``priority`` (lower
        first) orders the waiting requests under ``scheduling_policy="priority"`` and, under first-come-first-served
        scheduling, has no effect; ``trace_headers`` are accepted (no tracing); ``lora_request``: the
        request's LoRA adapter (a `tokenmill.lora.request.LoRARequest`; needs ``LLM(enable_lora=True)``).
        ``seed`` (a tokenmill extension): the request's random seed in place of ``params.seed``, so
        that requests sharing one params object each draw their own samples (the batch job's rows).
        """
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({' and '.join(sorted(self.asleep))} freed by sleep()); "
                               "call wake_up() before adding requests")
        check_add_request_keywords(request_id, priority, arrival_time)
        if tokenization_kwargs:
            (prompt,) = tokenize_prompts([prompt], self.tokenizer, tokenization_kwargs)
        request = self.intake.make_request(request_id, prompt, params, index, self.requests, seed)
        if lora_request is not None:
            if self.adapters is None:
                raise ValueError(f"lora_request={lora_request!r} needs an engine started with enable_lora=True "
                                 "(LLM(model, enable_lora=True, max_lora_rank=...))")
            request.adapter, request.lora_request = self.adapters.register(lora_request), lora_request
        request.priority = priority
        if arrival_time is not None:
            request.arrival_time = time.monotonic() - (time.time() - float(arrival_time))
        if prompt_text is not None and request.prompt is None:
            request.prompt = prompt_text
        self.requests[request_id] = request
        if request.needs_sync:
            self._history_readers.add(request_id)
        self.scheduler.add(request)
        return request_id

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Forget these requests (``internal``: vLLM's flag for its own aborts; no difference here)."""
        ids = request_id_list(request_ids)
        if self._undelivered:  # their outputs from a failed step, if any, go too
            gone = set(ids)
            self._undelivered = [o for o in self._undelivered if o.request_id not in gone]
        for request_id in ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self._history_readers.discard(request_id)
                self.scheduler.abort(request)
                request.release()  # no output is made for it: break Request <-> Sequence now

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- stepping -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Requests in the engine, or outputs a failed step built that the next step delivers."""
        return bool(self.requests or self._undelivered)

    def generated_token_counts(self, request_id: str) -> tuple[int, int] | None:
        """(its prompt's tokens, the tokens its samples generated so far) for an unfinished request,
        without building its output; None if it is not in the engine. For callers that step with
        ``finished_only`` and still show progress (the batch job)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return len(request.prompt_token_ids), sum(len(seq.output_token_ids) for seq in request.sequences)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests it advanced (or only finished ones).

        With asynchronous scheduling the outputs are those of the step launched by the previous call.
        A step that raises (a bug, Ctrl-C) first puts the engine back in order (`_recover`): the
        requests left run on, and the outputs it had built come with the next step's. When a
        request's own logits processor raised, that request alone ends, with finish_reason "error"
        and the reason in its output's ``error``, and the step returns as one that did not raise.
        """
        outputs, self._undelivered = self._undelivered, []
        try:
            self._step(outputs, finished_only)
        except BaseException as error:
            self._undelivered = outputs
            self._recover()
            culprit = self._culprit(error)
            if culprit is None:
                raise
            logger.error("request %s ends with finish_reason 'error': %s", culprit.request_id, error)
            self._undelivered.append(self._end_with_error(culprit, str(error), time.monotonic()))
            outputs, self._undelivered = self._undelivered, []
        return outputs

    def _culprit(self, error: BaseException) -> Request | None:
        """The request whose own code raised ``error``, if one did (not the device failing under it)."""
        if not isinstance(error, RequestCodeError) or is_device_failure(error.__cause__ or error):
            return None
        return next((r for r in self.requests.values() if any(s.seq_id == error.seq_id for s in r.sequences)), None)

    def _end_with_error(self, request: Request, message: str, now: float) -> RequestOutput:
        """End an unfinished request with finish_reason "error"; its last output, which says why."""
        request.error = message
        self.scheduler.abort(request, reason="error")
        if request.beam is not None:
            request.beam.done = True
        return self._finish(request, now)

    def _step(self, outputs: list[RequestOutput], finished_only: bool) -> None:
        """One step, its outputs appended to ``outputs`` as they are built (so a failure keeps them)."""
        # Logits processors read each row's output list, complete only when steps run one at a time.
        overlap = self.config.async_scheduling and not self._history_readers and not self.config.logits_processors
        if self._in_flight is not None and not overlap:
            self._read_back(self._take_in_flight(), finished_only, outputs)
        plan = self.scheduler.schedule()
        if self.adapters is not None:
            plan = self._place_adapters(plan, outputs)
        if plan.is_empty:
            # Never launched: its finished and preempted ids go to the next plan, so the runner
            # frees their sampling-state slots and only running sequences keep slots (the memory plan).
            self.scheduler.report_later(plan.finished_seq_ids)
        if plan.is_empty and self._in_flight is None:
            if self.scheduler.has_unfinished() and not outputs:
                raise RuntimeError("the scheduler could not place any request; the KV cache is too small")
            return
        previous = self._take_in_flight()  # read back once the next step is launched (dropped if that fails: _recover)
        self._in_flight = None if plan.is_empty else self._launch(plan)
        if previous is not None and self._in_flight is not None:
            self.stats.num_overlapped_steps += 1
        if previous is not None:
            self._read_back(previous, finished_only, outputs)
        if self._in_flight is not None and self._in_flight.pending_draw is not None:
            self._in_flight.pending_draw()  # its grammar masks need the tokens just read back
        if not overlap and self._in_flight is not None:
            self._read_back(self._take_in_flight(), finished_only, outputs)
        if self.metrics is not None:
            self.metrics.prefix_cache_looked_up(*self.scheduler.take_prefix_cache_stats())
            self.metrics.engine_state(len(self.scheduler.running), len(self.scheduler.waiting),
                                      self.kv.num_usable_blocks - self.kv.num_free_blocks, self.kv.num_usable_blocks)

    def _recover(self) -> None:
        """Put the books back in order after a step raised midway, so that the requests left (another
        call's, enqueued ones, open iterators') run on as they would have. Where the step stopped is
        unknown: it may have launched a plan, half read a step back, or left a draw pending. So the
        step in flight is dropped and every sequence is computed again from the tokens the host
        holds (`Scheduler.recover`). A request whose sequences all finished in the failed step gets
        its last output, kept for the next step; one whose output cannot be built is dropped with a
        logged error, not left in the engine, where nothing would ever finish it."""
        self._in_flight = None
        self.scheduler.recover()
        now = time.monotonic()
        for request in [r for r in self.requests.values() if r.is_finished]:
            try:
                self._undelivered.append(self._finish(request, now))
            except Exception:  # noqa: BLE001  (the step's own error is the one raised)
                logger.exception("request %s finished, but its output could not be built; it is dropped", request.request_id)
                self.abort_request(request.request_id)

    def _settle(self) -> None:
        """Read back the step still in flight (its requests are all finished or aborted)."""
        if self._in_flight is not None:
            self._read_back(self._take_in_flight(), finished_only=True, outputs=[])

    def _take_in_flight(self) -> StepResult[Sequence] | None:
        result, self._in_flight = self._in_flight, None
        return result

    def _place_adapters(self, plan: SchedulerOutput[Sequence], outputs: list[RequestOutput]) -> SchedulerOutput[Sequence]:
        """Device slots for the plan's adapters. One that cannot be loaded (its folder deleted or
        rewritten since it was checked) fails its own requests, whose outputs join ``outputs``, and
        the step is planned again without them; nothing of the dropped plan ran."""
        from tokenmill.lora.slots import AdapterLoadError

        assert self.adapters is not None
        while not plan.is_empty:
            try:
                plan.lora_slots = self.adapters.place({s.seq.request.adapter for s in plan.scheduled} - {None})
                return plan
            except AdapterLoadError as error:
                self.scheduler.undo_copies(plan)
                self.scheduler.report_later(plan.finished_seq_ids)
                failed = self._fail_adapter(error)
                if not failed:  # no request of ours holds it: planning again would meet it again
                    raise
                outputs += failed
                plan = self.scheduler.schedule()
        return plan

    def _fail_adapter(self, error: "AdapterLoadError") -> list[RequestOutput]:
        """End every request of an adapter that could not be loaded with finish_reason "error" (their
        outputs say why); forget the adapter, so that a request naming it later is checked again."""
        spec = error.spec
        assert self.adapters is not None
        self.adapters.forget(spec)
        failed = [r for r in self.requests.values() if r.adapter is not None and r.adapter.uid == spec.uid]
        logger.error("%s; its %d request(s) end with finish_reason 'error'", error, len(failed))
        now = time.monotonic()
        return [self._end_with_error(request, str(error), now) for request in failed]

    def _launch(self, plan: SchedulerOutput[Sequence]) -> StepResult[Sequence]:
        result = self.executor.execute_model(plan)
        self.stats.record(plan.num_batched_tokens)
        if self.metrics is not None:
            self.metrics.step_launched(plan)
        self.scheduler.update_after_launch(plan)
        return result

    def _read_back(self, result: StepResult[Sequence], finished_only: bool, outputs: list[RequestOutput]) -> None:
        """Wait for a launched step's ids, append them, apply stop conditions, add outputs to ``outputs``."""
        if result.pending_draw is not None:  # step() draws it after reading the step before; if that raised
            result.pending_draw()
        result.wait()
        self.output_processor.record_prompt_logprobs(result)
        rows = self.scheduler.update_from_output(result)
        self.output_processor.record_sample_logprobs(result, rows)
        self.stats.num_generated_tokens += len(rows)
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.tokens_read([result.sampled[row].seq for row in rows], now)
        for request in dict.fromkeys(result.sampled[row].seq.request for row in rows):
            if request.is_finished:
                outputs.append(self._finish(request, now))
            elif not (finished_only or request.params.output_kind is RequestOutputKind.FINAL_ONLY):
                outputs.append(self.output_processor.request_output(request))

    def _finish(self, request: Request, now: float) -> RequestOutput:
        """A finished request leaves the engine: its last output (built first: if that fails, the
        request is still there for `_recover`)."""
        request.finished_time = now
        output = self.output_processor.request_output(request)
        del self.requests[request.request_id]
        self._history_readers.discard(request.request_id)
        if self.metrics is not None:
            self.metrics.request_finished(request, output, now)
        request.release()  # its last output is built: break Request <-> Sequence (Request.release)
        return output

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a Worker method (or method(worker, ...)) on every tensor-parallel rank; see Executor.

        The engine keeps the books on sleep (what is freed, the aborted requests), so ``"sleep"`` and
        ``"wake_up"`` are refused by name; after ``"reload_weights"`` or ``"update_weights"`` the prefix
        cache, computed with the old weights, is forgotten (a function that changes weights itself
        should be followed by reset_prefix_cache()).
        """
        if isinstance(method, str) and method in ENGINE_KEPT_METHODS:
            instead = ENGINE_KEPT_METHODS[method]
            raise ValueError(f"collective_rpc(method={method!r}) would leave the engine unaware of it; " + (
                f"call {instead} instead" if instead else "the engine calls it itself (at start-up or in a step)"))
        if method not in WEIGHT_WRITING_METHODS:
            return self.executor.collective_rpc(method, timeout, args, kwargs)
        try:
            return self.executor.collective_rpc(method, timeout, args, kwargs)
        finally:  # even a failed load may have replaced some tensors
            self._forget_prefix_cache(f"collective_rpc({method!r})")

    def do_log_stats(self) -> None:
        """Log the engine's counters, as vLLM's stat logger does (only with disable_log_stats=False)."""
        if not self.config.log_stats:
            return
        stats = self.stats
        logger.info("engine: %d steps, %d tokens batched, %d generated, %d requests unfinished, %d of %d KV blocks free",
                    stats.num_steps, stats.num_batched_tokens, stats.num_generated_tokens, len(self.requests),
                    self.kv.num_free_blocks, self.kv.num_usable_blocks)
        self._last_stats_log = time.monotonic()

    def do_log_stats_with_interval(self) -> None:
        """do_log_stats at most every STATS_LOG_INTERVAL_S seconds (vLLM's default interval)."""
        if time.monotonic() - self._last_stats_log >= STATS_LOG_INTERVAL_S:
            self.do_log_stats()

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on every tensor-parallel rank's model; one result per rank."""
        return self.collective_rpc("apply_model", args=(func,))


def _adapter_book(config: EngineConfig, executor: Executor) -> "AdapterBook | None":
    """With enable_lora: the adapters' books, knowing what the model can adapt (rank 0's answer)."""
    if config.lora is None:
        return None
    from tokenmill.lora.slots import AdapterBook

    targets, excluded = executor.collective_rpc("lora_targets")[0]
    return AdapterBook(config.lora, targets, lambda slot, spec: executor.collective_rpc("load_lora", args=(slot, spec)),
                       excluded)


def _start_metrics(config: EngineConfig) -> "EngineMetrics | None":
    """The metrics recorder with disable_log_stats=False (None when off, or without prometheus-client)."""
    if not config.log_stats:
        return None
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        logger.warning("disable_log_stats=False but prometheus-client is not installed: no metrics are collected "
                       "(pip install 'tokenmill[metrics]')")
        return None
    from tokenmill.metrics.stats import EngineMetrics

    return EngineMetrics(config.served_model_name, config.max_model_len)


class EngineStats:
    """Counters for progress bars and metrics."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_batched_tokens = 0
        self.num_generated_tokens = 0
        self.num_overlapped_steps = 0  # launched while the previous step was still in flight

    def record(self, batched_tokens: int) -> None:
        self.num_steps += 1
        self.num_batched_tokens += batched_tokens
