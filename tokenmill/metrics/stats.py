"""The engine's metrics, under vLLM's names, in a prometheus-client registry of the engine's own.

Recorded only with ``LLM(disable_log_stats=False)`` (vLLM's LLM has the same default off), since
they cost a little host time per token. The engine reports what happens; this turns it into
vLLM's metrics (every one labelled ``model_name`` and ``engine="0"``). vLLM runs each of a
request's n samples as a child request, so most of them count samples (completions):

- counters: ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success`` by
  ``finished_reason`` (finished samples; an aborted request is not counted, as in vLLM),
  ``vllm:num_preemptions``, ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (prompt
  tokens looked up, and found, in the prefix cache), ``vllm:prompt_tokens_by_source`` by
  ``source`` (``local_compute``, ``local_cache_hit``, ``external_kv_transfer``: always 0 here),
  ``vllm:prompt_tokens_cached``, ``vllm:prompt_tokens_recomputed``;
- gauges: ``vllm:num_requests_running`` / ``_waiting`` (sequences), ``vllm:kv_cache_usage_perc``
  (share of KV blocks in use), ``vllm:engine_sleep_state``;
- histograms: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (the
  time between a sequence's tokens as the host reads them back), ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds``,
  ``vllm:request_decode_time_seconds``, ``vllm:request_inference_time_seconds``,
  ``vllm:request_time_per_output_token_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_prefill_kv_computed_tokens``,
  ``vllm:request_params_max_tokens`` (per sample), ``vllm:request_params_n`` and
  ``vllm:request_max_num_generation_tokens`` (per request, once all its samples finished),
  ``vllm:iteration_tokens_total``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterable

from tokenmill.metrics.reader import Metric, get_metrics_snapshot

if TYPE_CHECKING:
    from tokenmill.engine.request import Request, Sequence
    from tokenmill.engine.step import SchedulerOutput
    from tokenmill.outputs import RequestOutput

# Bucket bounds as vLLM's, so histograms from either engine line up.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # no KV connector: the last is 0
FINISH_REASONS = ("stop", "length", "abort", "repetition", "error")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # sleep level 0, 1, 2


def token_count_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets for token counts)."""
    found, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return found
            found.append(mantissa * scale)
        scale *= 10


class EngineMetrics:
    def __init__(self, model_name: str, max_model_len: int):
        from prometheus_client import CollectorRegistry
        from prometheus_client import Counter as PromCounter
        from prometheus_client import Gauge as PromGauge
        from prometheus_client import Histogram as PromHistogram

        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            return PromCounter(name, doc, names, registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return PromGauge(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return PromHistogram(name, doc, names, buckets=list(buckets), registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        by_source = PromCounter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*names, "source"],
                                registry=self.registry)
        self.prompt_by_source = {source: by_source.labels(**labels, source=source) for source in PROMPT_TOKEN_SOURCES}
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.prompt_recomputed = counter("vllm:prompt_tokens_recomputed", "Cached prompt tokens computed again to sample.")
        success = PromCounter("vllm:request_success", "Finished completions, by finish reason.", [*names, "finished_reason"],
                              registry=self.registry)
        self.success = {reason: success.labels(**labels, finished_reason=reason) for reason in FINISH_REASONS}
        self.running = gauge("vllm:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        sleep = PromGauge("vllm:engine_sleep_state", "1 for the engine's sleep state.", [*names, "sleep_state"],
                          registry=self.registry)
        self.sleep_state = {state: sleep.labels(**labels, sleep_state=state) for state in SLEEP_STATES}
        self.record_sleep_level(0)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", _LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                        _LATENCY_BUCKETS)
        self.time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                               "Mean time per output token after the first, per request.", _ITL_BUCKETS)
        token_buckets = token_count_buckets(max_model_len)
        self.max_model_len = max_model_len
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens", "Generated tokens per request.", token_buckets)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                             "Prompt tokens computed, not found cached, per request.", token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.",
                                            token_buckets)
        self.request_n = histogram("vllm:request_params_n", "The n request parameter.", _N_BUCKETS)
        self.request_longest = histogram("vllm:request_max_num_generation_tokens",
                                         "The most tokens one sample of a request generated.", token_buckets)
        self.step_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step.", _STEP_TOKEN_BUCKETS)
        # Each sequence's first and last token times: weak, so a request that is aborted or finishes
        # leaves nothing behind.
        self._first_token: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()
        self._last_token: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()

    def snapshot(self) -> list[Metric]:
        return get_metrics_snapshot(self.registry)

    # ---- what the engine reports ---------------------------------------------------------------
    def step_launched(self, plan: "SchedulerOutput") -> None:
        self.step_tokens.observe(plan.num_batched_tokens)
        if plan.num_preempted:
            self.preemptions.inc(plan.num_preempted)

    def tokens_read(self, sequences: list["Sequence"], now: float) -> None:
        """``sequences`` each got one token in the step just read back (at ``now``)."""
        self.generation_tokens.inc(len(sequences))
        for seq in sequences:
            request = seq.request
            if len(seq.output_token_ids) == 1:  # a sample's first token (not a beam forked with its parent's)
                # vLLM runs each of n samples as a child request: each has a first token and a prompt.
                self.ttft.observe(now - request.arrival_time)
                self._first_token[seq] = now
                self._prompt_computed(len(request.prompt_token_ids), seq.num_cached_tokens)
            last = self._last_token.get(seq)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token[seq] = now

    def prefix_cache_looked_up(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache and found there (each sample's, as vLLM's
        child requests: `Scheduler.take_prefix_cache_stats`)."""
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)

    def _prompt_computed(self, num_prompt: int, num_cached: int) -> None:
        """vLLM's PromptTokenStats for one sample's prefill. A prompt found cached but for its last
        token has that token computed again (its logits sample): it counts as a cache hit and as
        recomputed, so local_compute + local_cache_hit - recomputed = the prompt."""
        recomputed = 1 if num_cached + 1 == num_prompt else 0
        self.prompt_tokens.inc(num_prompt)
        self.prompt_by_source["local_compute"].inc(num_prompt - num_cached)
        self.prompt_by_source["local_cache_hit"].inc(num_cached + recomputed)
        self.prompt_cached.inc(num_cached)
        self.prompt_recomputed.inc(recomputed)

    def request_finished(self, request: "Request", output: "RequestOutput", now: float) -> None:
        """One observation per completion, as vLLM's per-child finished requests, and one per request
        of its n and its longest completion (vLLM's parent request, once all its children finished)."""
        # The sample behind each completion (none for a beam search's or best_of's chosen ones).
        mapped = request.beam is None and len(request.sequences) == len(output.outputs)
        sequences: list[Sequence | None] = list(request.sequences) if mapped else [None] * len(output.outputs)
        # (A DELTA output holds the last tokens only: count the sample's.)
        tokens = [len(seq.output_token_ids) if seq is not None else len(c.token_ids) for c, seq in zip(output.outputs, sequences)]
        params = request.params
        num_prompt = len(request.prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        for completion, seq, generated in zip(output.outputs, sequences, tokens):
            if completion.finish_reason in self.success:
                self.success[completion.finish_reason].inc()
            self.e2e.observe(now - request.arrival_time)
            self._phases(request, seq, generated, now)
            self.request_prompt.observe(num_prompt)
            self.request_generation.observe(generated)
            cached = seq.num_cached_tokens if seq is not None else request.num_cached_tokens
            self.prefill_kv_computed.observe(num_prompt - cached)
            if max_tokens:  # vLLM leaves out max_tokens=0
                self.request_max_tokens.observe(max_tokens)
        self.request_n.observe(params.n)
        self.request_longest.observe(max(tokens, default=0))

    def _phases(self, request: "Request", seq: "Sequence | None", generated: int, now: float) -> None:
        """vLLM's finished-request times: queued (arrival to first scheduled), and for a sample with
        tokens prefill (to its first token), decode (first to last token), inference (first scheduled
        to last token) and, past one token, the mean time per output token after the first."""
        scheduled = request.first_scheduled_time
        if scheduled is None:
            return
        self.queue.observe(scheduled - request.arrival_time)
        first = self._first_token.get(seq) if seq is not None else request.first_token_time
        if first is None or not generated:
            return
        last = self._last_token.get(seq, now) if seq is not None else now
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)
        if generated > 1:
            self.time_per_output_token.observe((last - first) / (generated - 1))

    def engine_state(self, num_running: int, num_waiting: int, blocks_in_use: int, usable_blocks: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(blocks_in_use / usable_blocks if usable_blocks else 0.0)

    def record_sleep_level(self, level: int) -> None:
        for i, state in enumerate(SLEEP_STATES):
            self.sleep_state[state].set(1 if i == level else 0)
