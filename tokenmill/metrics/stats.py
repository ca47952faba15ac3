"""The engine's metrics, under vLLM's names, in a prometheus-client registry of the engine's own.

Recorded only with ``LLM(disable_log_stats=False)`` (vLLM's LLM has the same default off), since
they cost a little host time per token. The engine reports what happens; this turns it into
vLLM's metrics (every one labelled ``model_name`` and ``engine="0"``):

- counters: ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success`` by
  ``finished_reason`` (one per completion), ``vllm:num_preemptions``, ``vllm:prefix_cache_queries``
  and ``vllm:prefix_cache_hits`` (prompt tokens looked up, and found, in the prefix cache);
- gauges: ``vllm:num_requests_running`` / ``_waiting`` (sequences), ``vllm:kv_cache_usage_perc``
  (share of KV blocks in use), ``vllm:engine_sleep_state``;
- histograms: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (the
  time between a sequence's tokens as the host reads them back), ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:iteration_tokens_total``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterable

from tokenmill.metrics.reader import Metric, get_metrics_snapshot
from tokenmill.sampling_params import RequestOutputKind

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
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens", "Generated tokens per request.", token_buckets)
        self.step_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step.", _STEP_TOKEN_BUCKETS)
        # Each sequence's last token time: weak, so a request that is aborted or finishes leaves nothing behind.
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
                self.prompt_tokens.inc(len(request.prompt_token_ids))
            last = self._last_token.get(seq)
            if last is not None:
                self.itl.observe(now - last)
            self._last_token[seq] = now

    def prefix_cache_looked_up(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache and found there (each sample's, as vLLM's
        child requests: `Scheduler.take_prefix_cache_stats`)."""
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)

    def request_finished(self, request: "Request", output: "RequestOutput", now: float) -> None:
        """One observation per completion, as vLLM's per-child finished requests."""
        tokens = [len(c.token_ids) for c in output.outputs]
        if request.params.output_kind is RequestOutputKind.DELTA and len(request.sequences) == len(tokens):
            tokens = [len(seq.output_token_ids) for seq in request.sequences]  # a DELTA output holds the last tokens only
        for completion, generated in zip(output.outputs, tokens):
            if completion.finish_reason in self.success:
                self.success[completion.finish_reason].inc()
            self.e2e.observe(now - request.arrival_time)
            if request.first_scheduled_time is not None:
                self.queue.observe(request.first_scheduled_time - request.arrival_time)
            self.request_prompt.observe(len(request.prompt_token_ids))
            self.request_generation.observe(generated)

    def request_aborted(self) -> None:
        self.success["abort"].inc()

    def engine_state(self, num_running: int, num_waiting: int, blocks_in_use: int, usable_blocks: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(blocks_in_use / usable_blocks if usable_blocks else 0.0)

    def record_sleep_level(self, level: int) -> None:
        for i, state in enumerate(SLEEP_STATES):
            self.sleep_state[state].set(1 if i == level else 0)
