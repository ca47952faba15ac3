"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

``add_request`` validates and queues; ``step`` schedules, runs the model once, appends the
sampled tokens, applies stop conditions and frees finished sequences' blocks. The `LLM` class
drives it in a loop; the batch job drives it directly to write results as they finish.

With ``async_scheduling`` (the default on GPUs) a step is launched before the previous step's
sampled ids are read back: ``step`` schedules and launches step N+1, then reads step N's ids and
does its bookkeeping while the device runs N+1. A sequence that step N finished is then computed
once more in N+1 and that token is dropped; a sequence that reaches max_tokens is not scheduled
again. Requests whose sampling reads all earlier output ids (penalties, bad words, logits
processors, grammars) and beam searches (the next beams depend on this step's logprobs) make the
engine read each step back before scheduling the next (`Request.needs_sync`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import torch

from tokenmill.config import EngineArgs, EngineConfig, create_engine_config
from tokenmill.distributed.executor import Executor
from tokenmill.engine.beam_search import BeamSearch, beam_sampling_params
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.pooling import PoolingEngine
from tokenmill.engine.request import Request, Sequence
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.inputs import PromptType, parse_prompt, validate_prompt_ids
from tokenmill.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestMetrics, RequestOutput
from tokenmill.pooling_config import resolve_pooling
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from tokenmill.worker.model_runner import StepResult

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from tokenmill.models.source import resolve_model

        self.args = args
        self.source = resolve_model(
            args.model, tokenizer=args.tokenizer, revision=args.revision, gguf_file=args.gguf_file,
            trust_remote_code=args.trust_remote_code,
        )
        self.config: EngineConfig = create_engine_config(args, self.source)
        pooling_config = resolve_pooling(args, self.source)  # None: a generative model
        if pooling_config is not None and args.deterministic:
            raise ValueError("LLM(deterministic=True) is for generation: pooling models have no batch-invariant path")
        if pooling_config is not None:
            self.config = pooling_config.engine_config(self.config, args)
        self.model_config = self.config  # vLLM code reads llm_engine.model_config.max_model_len
        self.tokenizer = None if args.skip_tokenizer_init else self._load_tokenizer()
        torch.manual_seed(args.seed)
        # A pooling model is served by PoolingEngine (one rank, no KV cache, sampler or decode graphs);
        # every public method below hands over to it.
        self.pooling: PoolingEngine | None = None
        if pooling_config is not None:
            self.pooling = PoolingEngine(self.config, self.source, pooling_config, self.tokenizer, args.load_format)
            return
        # Loads the model on every tensor-parallel rank and sizes and allocates the KV cache there;
        # the engine steps rank 0's runner (tokenmill/distributed/ when there are several ranks).
        self.executor = Executor(self.config, self.source, args.load_format)
        self.runner = self.executor.driver.runner
        num_blocks = self.executor.num_blocks
        self.kv = KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.max_model_len
        )
        self.requests: dict[str, Request] = {}
        self._in_flight: StepResult | None = None  # launched, not yet read back
        self._history_readers: set[str] = set()  # live requests that force synchronous steps (needs_sync)
        self._next_seq_id = 0
        self.stats = EngineStats()
        self._grammars = None  # GrammarCache, built on the first structured request

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
        *,
        index: int | None = None,
    ) -> None:
        """Validate and queue one request; a ValueError leaves the engine untouched.

        With `BeamSearchParams` the request is a beam search (see `tokenmill.engine.beam_search`).
        """
        if self.pooling is not None:
            return self.pooling.add_request(request_id, prompt, params, index=index)
        params = params if params is not None else SamplingParams()
        where = f"prompts[{index}]" if index is not None else "prompt"
        beam_params = params if isinstance(params, BeamSearchParams) else None
        if beam_params is not None:
            params = self._beam_sampling_params(beam_params, where)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = parse_prompt(prompt, self.tokenizer, index)
        if params.truncate_prompt_tokens is not None:
            keep = self.config.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            processed.token_ids = processed.token_ids[-keep:]
        validate_prompt_ids(processed.token_ids, self.config.vocab_size, self.config.max_model_len, where)
        self._check_fits_cache(processed.token_ids, params, where)
        params = self._with_stop_ids(params)
        params = self._with_logit_controls(params, where)
        matchers = self._grammar_matchers(params, where)
        request = Request(request_id, processed.prompt, processed.token_ids, params)
        if beam_params is not None:
            max_new = max(1, min(params.max_tokens, self.config.max_model_len - len(processed.token_ids)))
            request.beam = BeamSearch(beam_params, params.all_stop_token_ids, max_new)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # nothing predicts the first prompt token
        for i in range(params.num_samples):
            request.sequences.append(self._new_sequence(request, i))
            request.sequences[-1].grammar = matchers[i] if matchers else None
        self.requests[request_id] = request
        if request.needs_sync:
            self._history_readers.add(request_id)
        self.scheduler.add(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if self.pooling is not None:
            return self.pooling.abort_request(request_ids)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            self._history_readers.discard(request_id)
            for seq in request.sequences:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)

    def get_num_unfinished_requests(self) -> int:
        if self.pooling is not None:
            return self.pooling.get_num_unfinished_requests()
        return len(self.requests)

    # ---- stepping -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        if self.pooling is not None:
            return self.pooling.has_unfinished_requests()
        return bool(self.requests)

    def step(self, finished_only: bool = False) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """Run one engine step; return the outputs of the requests it advanced (or only finished ones).

        With asynchronous scheduling the outputs are those of the step launched by the previous call.
        """
        if self.pooling is not None:
            return self.pooling.step(finished_only)
        overlap = self.config.async_scheduling and not self._history_readers
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and not overlap:
            outputs += self._read_back(self._take_in_flight(), finished_only)
        plan = self.scheduler.schedule()
        if plan.is_empty and self._in_flight is None:
            if self.scheduler.has_unfinished() and not outputs:
                raise RuntimeError("the scheduler could not place any request; the KV cache is too small")
            return outputs
        previous = self._take_in_flight()
        try:
            self._in_flight = None if plan.is_empty else self._launch(plan)
        except BaseException:
            self._in_flight = previous  # its ids are still to be read back by the next step
            raise
        if previous is not None and self._in_flight is not None:
            self.stats.num_overlapped_steps += 1
        if previous is not None:
            outputs += self._read_back(previous, finished_only)
        if not overlap and self._in_flight is not None:
            outputs += self._read_back(self._take_in_flight(), finished_only)
        return outputs

    def _take_in_flight(self) -> StepResult | None:
        result, self._in_flight = self._in_flight, None
        return result

    def _launch(self, plan: SchedulerOutput) -> StepResult:
        result = self.runner.execute(plan.scheduled)
        self.stats.record(plan.num_batched_tokens)
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.commit_computed(item.seq)
        for item in result.sampled:
            item.seq.num_inflight += 1
        return result

    def _read_back(self, result: StepResult, finished_only: bool) -> list[RequestOutput]:
        """Wait for a launched step's ids, append them, apply stop conditions, build outputs."""
        result.wait()
        self._record_prompt_logprobs(result)
        touched = self._apply_samples(result)
        outputs = []
        for request in touched:
            if request.is_finished:
                request.finished_time = time.monotonic()
                del self.requests[request.request_id]
                self._history_readers.discard(request.request_id)
            final_only = finished_only or request.params.output_kind is RequestOutputKind.FINAL_ONLY
            if request.is_finished or not final_only:
                outputs.append(self._request_output(request))
        return outputs

    def _apply_samples(self, result: StepResult) -> list[Request]:
        touched: dict[str, Request] = {}
        if result.output is None:
            return []
        out = result.output
        token_ids = out.token_ids.tolist()
        want_logprobs = out.sampled_logprobs is not None
        if want_logprobs:
            sampled_lp = out.sampled_logprobs.tolist()
            ranks = out.sampled_ranks.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        now = time.monotonic()
        for row, item in enumerate(result.sampled):
            seq = item.seq
            seq.num_inflight -= 1
            if seq.is_finished:
                continue  # stopped or aborted while this token was in flight: it is dropped
            token = token_ids[row]
            self.stats.num_generated_tokens += 1
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            touched[seq.request.request_id] = seq.request
            if seq.request.beam is not None:
                seq.request.beam.report(seq, top_ids[row], top_lp[row])
                continue
            seq.output_token_ids.append(token)
            if seq.params.best_of is not None:
                seq.best_of_logprob += sampled_lp[row]
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                entry = {token: Logprob(sampled_lp[row], ranks[row], self._token_text(token))}
                for rank, (tid, lp) in enumerate(zip(top_ids[row][:k], top_lp[row][:k]) if k else [], start=1):
                    entry.setdefault(tid, Logprob(lp, rank, self._token_text(tid)))
                seq.logprobs.append(entry)
                seq.cumulative_logprob += sampled_lp[row]
            if seq.grammar is not None and not seq.grammar.is_terminated():
                seq.grammar.accept_token(token)
            self._check_stop(seq, token)
            if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated():
                seq.finish_reason = "stop"  # the constraint is complete: nothing more may follow
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
        for request in touched.values():
            if request.beam is not None and request.beam.ready(request.sequences):
                request.beam.advance(request, self.scheduler, self._new_sequence)
        return list(touched.values())

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        for chunk in result.prompt_logprobs or ():
            request = chunk.request
            k = request.params.prompt_logprobs
            for i, (lp, rank) in enumerate(zip(chunk.token_logprobs, chunk.ranks)):
                position = chunk.first + i
                if position < len(request.prompt_logprobs):
                    continue  # already scored before a preemption
                token = request.prompt_token_ids[position]
                entry = {token: Logprob(lp, rank, self._token_text(token))}
                if k:
                    for r, (tid, tlp) in enumerate(zip(chunk.top_ids[i], chunk.top_logprobs[i]), start=1):
                        entry.setdefault(tid, Logprob(tlp, r, self._token_text(tid)))
                request.prompt_logprobs.append(entry)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        num_out = len(seq.output_token_ids)
        stop_allowed = num_out >= params.min_tokens
        stop_string = seq.detokenizer.add_token(token, stop_allowed) if seq.detokenizer is not None else None
        if stop_allowed:
            if token in params.all_stop_token_ids:
                seq.finish_reason = "stop"
                seq.stop_reason = None if token in self.config.eos_token_ids and token not in params.stop_token_ids else token
                return
            if stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_string
                return
        if (params.max_tokens is not None and num_out >= params.max_tokens) or seq.num_known_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"

    # ---- building blocks ------------------------------------------------------------------
    def _new_sequence(self, request: Request, index: int) -> Sequence:
        params = request.params
        seq = Sequence(self._next_seq_id, index, request, request.prompt_token_ids)
        self._next_seq_id += 1
        if params.seed is not None:
            # A 63-bit draw key of its own for each of the request's sequences (see worker/sampler.py).
            seq.seed = (params.seed if index == 0 else hash((params.seed, index))) & (2**63 - 1)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.detokenize and self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
        return seq

    def _with_stop_ids(self, params: SamplingParams) -> SamplingParams:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.config.eos_token_ids
        if stop_ids != params.all_stop_token_ids:
            params = params.clone()
            params.all_stop_token_ids = stop_ids
        return params

    def _grammar_matchers(self, params: SamplingParams, where: str) -> list | None:
        """One matcher per sample, from a grammar compiled once per distinct constraint."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{where}: structured_outputs needs a tokenizer (the engine was started with skip_tokenizer_init)")
        if self._grammars is None:
            from tokenmill.structured_outputs import GrammarCache

            self._grammars = GrammarCache(self.tokenizer, self.config.vocab_size)
            self.runner.grammars = self._grammars
        try:
            return [self._grammars.matcher(params.structured_outputs) for _ in range(params.num_samples)]
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc

    def _with_logit_controls(self, params: SamplingParams, where: str) -> SamplingParams:
        """Check token ids against the vocabulary and tokenize bad_words (vLLM: each word as is and
        with a leading space, since both spellings occur mid-text)."""
        vocab = self.config.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or {})), ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{where}: SamplingParams.{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.bad_words needs a tokenizer (the engine was started with skip_tokenizer_init)")
        sequences: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        params = params.clone()
        params.bad_words_token_ids = sequences
        return params

    def _check_fits_cache(self, token_ids: list[int], params: SamplingParams, where: str) -> None:
        longest = len(token_ids) + (params.max_tokens or self.config.max_model_len)
        longest = min(longest, self.config.max_model_len)
        needed = -(-longest // self.config.block_size)
        if needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"{where} may grow to {longest} tokens ({needed} KV blocks) but the KV cache holds only "
                f"{self.kv.num_usable_blocks} blocks; lower max_tokens or max_model_len, or give the cache "
                "more memory (kv_cache_memory_bytes / gpu_memory_utilization)"
            )

    def _beam_sampling_params(self, params: BeamSearchParams, where: str) -> SamplingParams:
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(
                f"{where}: BeamSearchParams.beam_width={params.beam_width} is invalid: must be <= max_num_seqs "
                f"({self.config.max_num_seqs}), since all beams of a prompt run in one batch"
            )
        return beam_sampling_params(params, len(self.config.eos_token_ids))

    def _request_output(self, request: Request) -> RequestOutput:
        if request.beam is not None:  # its sequences are live beams; the output is the finished ones
            completions = request.beam.completions(self.tokenizer) if request.beam.done else []
        else:
            completions = self._sample_completions(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            outputs=completions,
            finished=request.is_finished,
            metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time, request.finished_time),
            num_cached_tokens=request.num_cached_tokens,
        )

    def _sample_completions(self, request: Request) -> list[CompletionOutput]:
        delta = request.params.output_kind is RequestOutputKind.DELTA
        completions = []
        sequences = request.sequences
        if request.params.num_samples > request.params.n:
            # best_of: the n samples with the highest cumulative logprob (only final outputs are whole).
            sequences = sorted(sequences, key=lambda s: s.best_of_logprob, reverse=True)[: request.params.n]
        for index, seq in enumerate(sequences):
            first_token, first_char = (seq.num_emitted_tokens, seq.num_emitted_chars) if delta else (0, 0)
            text = seq.text if seq.is_finished or seq.detokenizer is None else seq.detokenizer.settled_text
            if delta:
                seq.num_emitted_tokens, seq.num_emitted_chars = len(seq.output_token_ids), len(text)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text[first_char:],
                    token_ids=seq.output_token_ids[first_token:],
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs[first_token:] if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return completions

    def _token_text(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _load_tokenizer(self) -> Any:
        from tokenmill.models.source import tokenizer_class

        path = self.source.tokenizer_path
        kwargs = dict(self.source.tokenizer_kwargs)
        if self.args.tokenizer_revision:
            kwargs["revision"] = self.args.tokenizer_revision
        try:
            cls = tokenizer_class(path, kwargs)
            return cls.from_pretrained(path, trust_remote_code=self.args.trust_remote_code, **kwargs)
        except Exception as exc:  # transformers raises many types; the user needs the path
            raise ValueError(f"could not load the tokenizer from {path!r}: {exc}") from exc

    def reset_prefix_cache(self) -> bool:
        if self.pooling is not None:
            return True  # a pooling model keeps no cache
        return self.kv.pool.reset_prefix_cache()

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a Worker method (or method(worker, ...)) on every tensor-parallel rank; see Executor."""
        if self.pooling is not None:
            return self.pooling.collective_rpc(method, timeout, args, kwargs)
        return self.executor.collective_rpc(method, timeout, args, kwargs)


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
