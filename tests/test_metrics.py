"""LLM.get_metrics on the CPU: vLLM's metric names, labels and shapes (read through the real
prometheus-client), counted as vLLM counts them (each of n samples a child request; prefix-cache
queries only for real lookups), checked against the outputs of the requests that made them."""

from __future__ import annotations

import pytest

from test_engine_controls import GREEDY, OPTIONS, PROMPTS, llm  # noqa: F401  (llm: a module fixture)
from tokenmill import LLM, SamplingParams

pytest.importorskip("prometheus_client")


def _by_name(metrics) -> dict:
    found: dict = {}
    for metric in metrics:
        found.setdefault(metric.name, []).append(metric)
    return found


def test_metrics_count_tokens_requests_latencies_and_cache_hits(tiny_llama_dir):
    from tokenmill.metrics.reader import Counter, Gauge, Histogram

    fresh = LLM(str(tiny_llama_dir), disable_log_stats=False, served_model_name="tiny", **OPTIONS)
    params = [GREEDY, GREEDY.clone(max_tokens=3), SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[]),
              GREEDY.clone(n=2, temperature=1.0, seed=1)]
    prompts = PROMPTS + [{"prompt_token_ids": [11, 12, 13]}]
    outputs = fresh.generate(prompts, params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    metrics = _by_name(fresh.get_metrics())
    value = lambda name: metrics[name][0].value  # noqa: E731
    assert all(m.labels["model_name"] == "tiny" and m.labels["engine"] == "0" for ms in metrics.values() for m in ms)
    assert isinstance(metrics["vllm:prompt_tokens"][0], Counter)
    # vLLM counts each of the n=2 samples as a child request, with its own prompt and first token
    assert value("vllm:prompt_tokens") == sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    assert value("vllm:generation_tokens") == sum(len(c.token_ids) for c in completions)
    by_reason = {m.labels["finished_reason"]: m.value for m in metrics["vllm:request_success"]}
    assert by_reason == {"stop": sum(c.finish_reason == "stop" for c in completions),
                         "length": sum(c.finish_reason == "length" for c in completions), "abort": 0, "repetition": 0, "error": 0}
    ttft = metrics["vllm:time_to_first_token_seconds"][0]
    assert isinstance(ttft, Histogram) and ttft.count == len(completions) and ttft.buckets["+Inf"] == ttft.count
    itl = metrics["vllm:inter_token_latency_seconds"][0]
    assert itl.count == sum(len(c.token_ids) - 1 for c in completions) and itl.sum > 0
    assert metrics["vllm:e2e_request_latency_seconds"][0].count == len(completions)
    assert isinstance(metrics["vllm:kv_cache_usage_perc"][0], Gauge)
    assert value("vllm:kv_cache_usage_perc") == 0.0  # everything finished and freed its blocks

    long_prompt = [{"prompt_token_ids": list(range(3, 60))}]
    first = fresh.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    again = fresh.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    metrics = _by_name(fresh.get_metrics())
    assert again.num_cached_tokens > first.num_cached_tokens  # the first shares a prefix with PROMPTS[2]
    # each of the n=2 samples looks the prompt up (a child request of vLLM's); its sibling's
    # 3-token prompt has no full block to find
    assert value("vllm:prefix_cache_queries") == sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs) + 2 * 57
    hits = sum(o.num_cached_tokens for o in [*outputs, first, again])
    assert value("vllm:prefix_cache_hits") == hits

    fresh.enqueue(long_prompt, GREEDY)
    fresh.llm_engine.step()
    usage = _by_name(fresh.get_metrics())["vllm:kv_cache_usage_perc"][0].value
    assert 0.0 < usage <= 1.0
    fresh.llm_engine.abort_request(list(fresh.llm_engine.requests))
    aborted = {m.labels["finished_reason"]: m.value for m in _by_name(fresh.get_metrics())["vllm:request_success"]}
    assert aborted["abort"] == 0  # vLLM makes no finished-request stats for an aborted request


def test_metrics_count_each_sample_of_an_n_request_as_vllms_child_requests(tiny_llama_dir):
    # vLLM fans n>1 out into n child requests, each with its own first token, prompt tokens and
    # finished-request observations; a DELTA stream's last output holds only its last tokens.
    from tokenmill.sampling_params import RequestOutputKind

    fresh = LLM(str(tiny_llama_dir), disable_log_stats=False, **OPTIONS)
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, ignore_eos=True)
    fresh.generate([{"prompt_token_ids": [5, 6, 7]}], sampled, use_tqdm=False)
    fresh.llm_engine.add_request("d", {"prompt_token_ids": [8, 9]}, sampled.clone(output_kind=RequestOutputKind.DELTA))
    while fresh.llm_engine.has_unfinished_requests():
        fresh.llm_engine.step()
    metrics = _by_name(fresh.get_metrics())
    assert metrics["vllm:prompt_tokens"][0].value == 2 * 3 + 2 * 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert metrics[name][0].count == 4, name
    prompt, generated = metrics["vllm:request_prompt_tokens"][0], metrics["vllm:request_generation_tokens"][0]
    assert (prompt.count, prompt.sum) == (4, 2 * 3 + 2 * 2)
    assert (generated.count, generated.sum) == (4, 4 * 4)


def test_prefix_cache_metrics_count_only_lookups_in_the_prefix_cache(tiny_llama_dir):
    # vLLM records a query only where it looks the prompt up: not with the prefix cache off, nor for
    # a request that skips reading it (prompt logprobs, skip_reading_prefix_cache).
    prompt = [{"prompt_token_ids": list(range(3, 12))}]
    nocache = LLM(str(tiny_llama_dir), disable_log_stats=False, enable_prefix_caching=False, **OPTIONS)
    nocache.generate(prompt * 2, GREEDY, use_tqdm=False)
    metrics = _by_name(nocache.get_metrics())
    assert (metrics["vllm:prefix_cache_queries"][0].value, metrics["vllm:prefix_cache_hits"][0].value) == (0, 0)
    cached = LLM(str(tiny_llama_dir), disable_log_stats=False, **OPTIONS)
    cached.generate(prompt, GREEDY.clone(prompt_logprobs=1), use_tqdm=False)
    cached.generate(prompt, GREEDY.clone(skip_reading_prefix_cache=True), use_tqdm=False)
    assert _by_name(cached.get_metrics())["vllm:prefix_cache_queries"][0].value == 0
    cached.generate(prompt, GREEDY, use_tqdm=False)
    assert _by_name(cached.get_metrics())["vllm:prefix_cache_queries"][0].value == 9


def test_do_log_stats_logs_the_counters_only_when_stats_are_on(llm, tiny_llama_dir, caplog):
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with caplog.at_level("INFO", logger="tokenmill.engine.engine"):
        llm.llm_engine.do_log_stats()
        llm.llm_engine.do_log_stats_with_interval()  # just logged: within the interval, silent
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenmill.engine.engine"]
    steps = llm.llm_engine.stats.num_steps
    assert len(lines) == 1 and lines[0].startswith(f"engine: {steps} steps,") and "KV blocks free" in lines[0]
    caplog.clear()
    quiet = LLM(str(tiny_llama_dir), **OPTIONS)  # disable_log_stats defaults to True in LLM, as in vLLM
    with caplog.at_level("INFO", logger="tokenmill.engine.engine"):
        quiet.llm_engine.do_log_stats()
    assert not [r for r in caplog.records if r.name == "tokenmill.engine.engine"]


def test_preemptions_are_counted(tiny_llama_dir):
    tight = LLM(str(tiny_llama_dir), disable_log_stats=False, **{**OPTIONS, "kv_cache_memory_bytes": None},
                num_gpu_blocks_override=12, block_size=4)
    tight.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (10, 12, 9, 11)],
                   GREEDY.clone(max_tokens=20), use_tqdm=False)
    counted = _by_name(tight.get_metrics())["vllm:num_preemptions"][0].value
    assert counted == tight.llm_engine.scheduler.num_preemptions > 0


def test_the_reader_turns_a_prometheus_registry_into_vllms_shapes():
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter
    from prometheus_client import Histogram as PromHistogram

    from tokenmill.metrics.reader import Counter, Histogram, Vector, get_metrics_snapshot

    registry = CollectorRegistry()
    accepted = PromCounter("vllm:spec_decode_num_accepted_tokens_per_pos", "d", ["engine", "position"], registry=registry)
    for position, count in ((0, 10), (2, 3)):
        accepted.labels("0", str(position)).inc(count)
    PromCounter("vllm:prompt_tokens", "d", ["engine"], registry=registry).labels("0").inc(7)
    PromCounter("other:ignored", "d", registry=registry).inc()
    latency = PromHistogram("vllm:e2e_request_latency_seconds", "d", ["engine"], buckets=[0.5, 2.0], registry=registry)
    for seconds in (0.1, 1.0, 5.0):
        latency.labels("0").observe(seconds)
    found = {m.name: m for m in get_metrics_snapshot(registry)}
    assert set(found) == {"vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:prompt_tokens", "vllm:e2e_request_latency_seconds"}
    assert found["vllm:spec_decode_num_accepted_tokens_per_pos"] == Vector(
        "vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "0"}, [10, 0, 3])
    assert found["vllm:prompt_tokens"] == Counter("vllm:prompt_tokens", {"engine": "0"}, 7)
    assert found["vllm:e2e_request_latency_seconds"] == Histogram(
        "vllm:e2e_request_latency_seconds", {"engine": "0"}, 3, 6.1, {"0.5": 1, "2.0": 2, "+Inf": 3})


def _fresh(tiny_llama_dir, **extra) -> LLM:
    return LLM(str(tiny_llama_dir), disable_log_stats=False, **{**OPTIONS, **extra})


def test_prefix_cache_metrics_count_each_sample_as_a_vllm_child_looking_up_its_prompt(tiny_llama_dir):
    # vLLM runs each of n samples as a child request that looks its prompt up when first scheduled
    # (KVCacheManager.get_computed_blocks): queries += prompt length; hits += the cached full blocks,
    # at most prompt length - 1. Child 0 caches its prompt's blocks as it is scheduled, so each later
    # child finds all of them: (P - 1) // block_size full blocks.
    block, prompt_len, n = 4, 11, 3
    fresh = _fresh(tiny_llama_dir, block_size=block)
    prompt = [{"prompt_token_ids": list(range(3, 3 + prompt_len))}]
    fresh.generate(prompt, GREEDY.clone(n=n, temperature=1.0, seed=2), use_tqdm=False)
    sibling_hits = (prompt_len - 1) // block * block
    metrics = _by_name(fresh.get_metrics())
    assert metrics["vllm:prefix_cache_queries"][0].value == n * prompt_len
    assert metrics["vllm:prefix_cache_hits"][0].value == (n - 1) * sibling_hits
    fresh.generate(prompt, GREEDY, use_tqdm=False)  # n = 1, the same prompt: its full blocks are cached
    metrics = _by_name(fresh.get_metrics())
    assert metrics["vllm:prefix_cache_queries"][0].value == (n + 1) * prompt_len
    assert metrics["vllm:prefix_cache_hits"][0].value == n * sibling_hits
    # no child reads the prefix cache when the request skips it (nor with prompt logprobs)
    fresh.generate(prompt, GREEDY.clone(n=2, temperature=1.0, seed=3, skip_reading_prefix_cache=True), use_tqdm=False)
    fresh.generate(prompt, GREEDY.clone(n=2, temperature=1.0, seed=3, prompt_logprobs=0), use_tqdm=False)
    metrics = _by_name(fresh.get_metrics())
    assert metrics["vllm:prefix_cache_queries"][0].value == (n + 1) * prompt_len


def test_an_aborted_request_is_not_counted_as_a_finished_request(tiny_llama_dir):
    # vLLM's LLMEngine.abort_request drops the request from its output processor before the engine
    # core aborts it, so no finished-request stats are made: vllm:request_success (abort included),
    # e2e latency and the per-request histograms leave it out.
    fresh = _fresh(tiny_llama_dir)
    fresh.llm_engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY.clone(n=2, temperature=1.0, seed=1))
    fresh.llm_engine.step()
    fresh.llm_engine.abort_request(["a"])
    metrics = _by_name(fresh.get_metrics())
    assert {m.labels["finished_reason"]: m.value for m in metrics["vllm:request_success"]} == dict.fromkeys(
        ("stop", "length", "abort", "repetition", "error"), 0)
    assert metrics["vllm:e2e_request_latency_seconds"][0].count == 0
    assert metrics["vllm:request_params_n"][0].count == 0


def test_request_parameter_histograms_count_each_request_as_vllms(tiny_llama_dir):
    # vllm:request_params_n and vllm:request_max_num_generation_tokens: one observation per request
    # once all its samples finished (ParentRequest.observe_finished_request); the max is over its
    # samples' generated tokens. vllm:request_params_max_tokens: one per sample, max_tokens or, unset,
    # max_model_len - prompt length (vLLM's input processor fills it in).
    fresh = _fresh(tiny_llama_dir)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": list(range(3, 43))}]
    params = [GREEDY.clone(n=2, temperature=1.0, seed=1, max_tokens=5), GREEDY.clone(max_tokens=3),
              SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=None, ignore_eos=True)]
    outputs = fresh.generate(prompts, params, use_tqdm=False)
    metrics = _by_name(fresh.get_metrics())
    n_hist = metrics["vllm:request_params_n"][0]
    assert (n_hist.count, n_hist.sum) == (3, 2 + 1 + 3)
    assert {le: n_hist.buckets[le] for le in ("1.0", "2.0", "5.0", "10.0", "20.0", "+Inf")} == {
        "1.0": 1, "2.0": 2, "5.0": 3, "10.0": 3, "20.0": 3, "+Inf": 3}
    longest = metrics["vllm:request_max_num_generation_tokens"][0]
    assert (longest.count, longest.sum) == (3, sum(max(len(c.token_ids) for c in o.outputs) for o in outputs))
    max_tokens = metrics["vllm:request_params_max_tokens"][0]
    room = OPTIONS["max_model_len"] - 40
    assert (max_tokens.count, max_tokens.sum) == (6, 2 * 5 + 3 + 3 * room)
    assert list(max_tokens.buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]  # 1-2-5 up to max_model_len


def test_request_phase_times_as_vllms_finished_request_stats(tiny_llama_dir):
    # Per finished sample: prefill = first token - first scheduled, decode = last token - first token,
    # inference = last token - first scheduled (so inference = prefill + decode), and the mean time per
    # output token = decode / (generated - 1), only for samples with more than one token.
    fresh = _fresh(tiny_llama_dir)
    params = [GREEDY.clone(n=2, temperature=1.0, seed=1, max_tokens=4), GREEDY.clone(max_tokens=1)]
    outputs = fresh.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    metrics = _by_name(fresh.get_metrics())
    prefill, decode, inference = (metrics[f"vllm:request_{phase}_time_seconds"][0] for phase in ("prefill", "decode", "inference"))
    assert prefill.count == decode.count == inference.count == len(completions)
    assert inference.sum == pytest.approx(prefill.sum + decode.sum)
    assert 0 < prefill.sum and 0 < decode.sum
    tpot = metrics["vllm:request_time_per_output_token_seconds"][0]
    assert tpot.count == sum(len(c.token_ids) > 1 for c in completions)


def test_prompt_tokens_by_source_as_vllms_prompt_token_stats(tiny_llama_dir):
    # vLLM's PromptTokenStats per sample's prefill: local_compute = P - cached, local_cache_hit =
    # cached + recomputed, recomputed = 1 when cached = P - 1 (the last prompt token is computed again
    # to sample); vllm:request_prefill_kv_computed_tokens observes P - cached per finished sample.
    block, prompt_len = 4, 9  # (P - 1) % block == 0: a repeat finds all but the last token cached
    fresh = _fresh(tiny_llama_dir, block_size=block)
    prompt = [{"prompt_token_ids": list(range(3, 3 + prompt_len))}]
    fresh.generate(prompt, GREEDY, use_tqdm=False)
    fresh.generate(prompt, GREEDY, use_tqdm=False)
    cached = (prompt_len - 1) // block * block
    metrics = _by_name(fresh.get_metrics())
    by_source = {m.labels["source"]: m.value for m in metrics["vllm:prompt_tokens_by_source"]}
    assert by_source == {"local_compute": prompt_len + (prompt_len - cached), "local_cache_hit": cached + 1,
                         "external_kv_transfer": 0}
    assert metrics["vllm:prompt_tokens_cached"][0].value == cached
    assert metrics["vllm:prompt_tokens_recomputed"][0].value == 1
    assert metrics["vllm:prompt_tokens"][0].value == 2 * prompt_len
    computed = metrics["vllm:request_prefill_kv_computed_tokens"][0]
    assert (computed.count, computed.sum) == (2, prompt_len + (prompt_len - cached))
