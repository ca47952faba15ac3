"""Differential checks of the engine core: the same requests through engines whose scheduling
differs must give the same outputs, the reference being an engine with no prefix cache, a large
KV pool and synchronous steps (itself checked against Hugging Face in test_generate.py).

The variants: prefix caching on, a pool so small that sequences are preempted and recomputed (and
cached blocks evicted), token budgets that split prompts inside a block, one sequence at a time,
other block sizes, asynchronous scheduling and the priority policy. The workload mixes prompts that
share long prefixes (equal, one a prefix of another, diverging mid-block) with greedy and seeded
sampling (n > 1, best_of), logprobs and prompt logprobs, penalties, logit_bias, bad_words, stop
strings and ids, min_tokens and allowed_token_ids. Token ids, texts, finish and stop reasons must be
equal; logprobs equal to fp32 round-off (a token's rank deep in the distribution may move by a near
tie), since batch shape and chunking change the order of float sums. Seeded samples must match too:
a request's draws depend on its seed and position only, whatever else is in the batch.

tests/test_async_scheduling.py, test_deterministic.py and test_scheduler.py check single variants
in depth; this file sweeps them together (a bounded version of a wider scratch fuzz).
"""

from __future__ import annotations

import math
import random

import pytest

from test_generate import make_llm
from tokenmill import RequestOutputKind, SamplingParams
from tokenmill.sampling_params import BeamSearchParams

OPTIONS = dict(max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
# name -> engine arguments. 10 blocks of 16 hold one sequence of max_model_len (8 blocks) and little more.
VARIANTS = {
    "tiny_pool_prefix_cache": dict(enable_prefix_caching=True, num_gpu_blocks_override=10, max_num_batched_tokens=7),
    "tiny_pool_async": dict(enable_prefix_caching=False, num_gpu_blocks_override=10, max_num_batched_tokens=6, async_scheduling=True),
    "block_4_async": dict(enable_prefix_caching=True, block_size=4, num_gpu_blocks_override=34, max_num_batched_tokens=9,
                          async_scheduling=True),
    "one_seq_block_8": dict(enable_prefix_caching=True, block_size=8, max_num_seqs=1, max_num_batched_tokens=11),
    "priority_tiny_pool": dict(enable_prefix_caching=True, num_gpu_blocks_override=10, scheduling_policy="priority",
                               max_num_batched_tokens=11),
}
# Must preempt (the point of their tiny pools).
PREEMPTING = {"tiny_pool_prefix_cache", "tiny_pool_async", "priority_tiny_pool"}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return make_llm(tiny_llama_dir, enable_prefix_caching=False, async_scheduling=False, **OPTIONS)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return {name: make_llm(tiny_llama_dir, **OPTIONS, **args) for name, args in VARIANTS.items()}


def workload(seed: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    shared = draw(60)
    prompts = [shared[:45], shared[:45], shared[:16], shared[:20], shared[:33] + draw(7), shared[:45] + draw(5), draw(9),
               shared[:31], draw(3), shared[:7] + draw(30), shared[:17], shared[:60]]
    params = []
    for kind, prompt in zip(["greedy", "sample", "penalties", "bias", "stop", "min_tokens", "bad_words", "allowed",
                             "best_of", "penalties", "sample", "greedy"], prompts):
        room = min(30, 128 - len(prompt))
        args: dict = dict(max_tokens=rng.randint(room // 2, room), logprobs=rng.choice([0, 2]),
                          prompt_logprobs=rng.choice([None, 1]), ignore_eos=True)
        if kind == "sample":
            args.update(temperature=0.9, n=rng.randint(2, 3), seed=rng.randrange(10**6), top_p=0.9, top_k=20)
        elif kind == "penalties":  # their counts must survive preemption and chunking
            args.update(temperature=rng.choice([0, 0.8]), seed=rng.randrange(10**6), repetition_penalty=1.4,
                        frequency_penalty=0.7, presence_penalty=0.5)
        elif kind == "bias":
            args.update(temperature=0, logit_bias={rng.randrange(3, vocab): 5.0, rng.randrange(3, vocab): -100.0})
        elif kind == "stop":
            args.update(temperature=0.7, n=2, seed=rng.randrange(10**6), stop=["e", "a "], min_tokens=2,
                        include_stop_str_in_output=True)
        elif kind == "min_tokens":
            args.update(temperature=0, min_tokens=5, stop_token_ids=draw(40), ignore_eos=False)
        elif kind == "bad_words":
            args.update(temperature=0, bad_words=["e", "th", " a"])
        elif kind == "allowed":
            args.update(temperature=1.0, seed=rng.randrange(10**6), allowed_token_ids=draw(30))
        elif kind == "best_of":
            args.update(temperature=1.0, n=2, best_of=3, seed=rng.randrange(10**6))
        else:
            args.update(temperature=0)
        params.append(SamplingParams(**args))
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[i] for i in order], [params[i] for i in order]


def inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def same_float(a: float | None, b: float | None, tol: float) -> bool:
    if a is None or b is None or math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol * max(1.0, abs(a))


def assert_same_positions(want, got, where: str) -> None:
    """Logprob dicts position by position: the same ids in the same order, values to fp32 round-off."""
    assert (want is None) == (got is None), where
    if want is None:
        return
    assert len(want) == len(got), where
    for k, (a, b) in enumerate(zip(want, got)):
        assert (a is None) == (b is None), f"{where}[{k}]"
        if a is None:
            continue
        assert list(a) == list(b), f"{where}[{k}]: ids"
        for token, entry in a.items():
            other = b[token]
            assert same_float(entry.logprob, other.logprob, 2e-5), f"{where}[{k}] token {token}: {entry.logprob} vs {other.logprob}"
            assert entry.decoded_token == other.decoded_token, f"{where}[{k}] token {token}"
            # The top alternatives' ranks are their places; a token's own rank deep in the
            # distribution counts near ties, which fp32 round-off may break either way.
            assert abs(entry.rank - other.rank) <= (0 if entry.rank <= len(a) else 2), f"{where}[{k}] token {token}: rank"


def assert_same_outputs(want: list, got: list, name: str) -> None:
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        where = f"{name}: request {i}"
        assert b.prompt_token_ids == a.prompt_token_ids, where
        assert_same_positions(a.prompt_logprobs, b.prompt_logprobs, f"{where} prompt_logprobs")
        assert [c.index for c in b.outputs] == [c.index for c in a.outputs], where
        for x, y in zip(a.outputs, b.outputs):
            at = f"{where}.{x.index}"
            assert y.token_ids == x.token_ids, at
            assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason, x.stop_reason), at
            assert same_float(x.cumulative_logprob, y.cumulative_logprob, 1e-4), at
            assert_same_positions(x.logprobs, y.logprobs, f"{at} logprobs")


@pytest.mark.parametrize("seed", [0, 1])
def test_generate_is_the_same_under_every_scheduling(reference, engines, seed):
    prompts, params = workload(seed, reference.llm_engine.config.vocab_size)
    want = reference.generate(inputs(prompts), params, use_tqdm=False)
    assert {c.finish_reason for o in want for c in o.outputs} == {"stop", "length"}
    for name, llm in engines.items():
        before = llm.llm_engine.scheduler.num_preemptions
        # Twice: the second run starts on whatever the first left in the prefix cache.
        for _ in range(2):
            priority = [i % 3 for i in range(len(prompts))] if name == "priority_tiny_pool" else None
            assert_same_outputs(want, llm.generate(inputs(prompts), params, use_tqdm=False, priority=priority), name)
        if name in PREEMPTING:
            assert llm.llm_engine.scheduler.num_preemptions > before, f"{name} never preempted"
    cached = engines["tiny_pool_prefix_cache"].generate(inputs(prompts), params, use_tqdm=False)
    assert any(o.num_cached_tokens for o in cached)


def test_aborts_mid_run_leave_the_rest_unchanged(reference, engines):
    """Requests driven by LLMEngine.step, a third of them aborted after a few steps (waiting,
    running, preempted or with a token in flight): every other request's output is unchanged."""
    prompts, params = workload(2, reference.llm_engine.config.vocab_size)
    want = reference.generate(inputs(prompts), params, use_tqdm=False)
    rng = random.Random(5)
    for name in ("tiny_pool_prefix_cache", "tiny_pool_async", "block_4_async"):
        engine = engines[name].llm_engine
        ids = [f"{name}-{i}" for i in range(len(prompts))]
        for request_id, prompt, sp in zip(ids, prompts, params):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, sp)
        abort_at = {request_id: rng.randint(1, 8) for request_id in rng.sample(ids, len(ids) // 3)}
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
            engine.abort_request([r for r, at in abort_at.items() if at == steps])
        kept = [i for i, r in enumerate(ids) if r not in abort_at]
        assert set(finished) >= {ids[i] for i in kept}
        assert_same_outputs([want[i] for i in kept], [finished[ids[i]] for i in kept], f"{name} with aborts")


def test_enqueue_and_delta_streams_match(reference, engines):
    """Requests queued by two enqueue calls and collected by wait_for_completion, and the same
    requests as DELTA outputs joined (best_of == n: best_of > n is refused there)."""
    prompts, params = workload(3, reference.llm_engine.config.vocab_size)
    params = [sp.clone(best_of=None) if sp.best_of else sp for sp in params]
    want = reference.generate(inputs(prompts), params, use_tqdm=False)
    llm = engines["tiny_pool_async"]
    half = len(prompts) // 2
    llm.enqueue(inputs(prompts[:half]), params[:half], use_tqdm=False)
    llm.enqueue(inputs(prompts[half:]), params[half:], use_tqdm=False)
    assert_same_outputs(want, llm.wait_for_completion(use_tqdm=False), "enqueue")
    engine = llm.llm_engine
    joined: dict[tuple[int, int], tuple[list[int], str, tuple]] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"delta-{i}", {"prompt_token_ids": prompt}, sp.clone(output_kind=RequestOutputKind.DELTA))
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                key = (int(out.request_id.split("-")[1]), c.index)
                ids, text, _ = joined.get(key, ([], "", ()))
                joined[key] = (ids + c.token_ids, text + c.text, (c.finish_reason, c.stop_reason))
    for i, out in enumerate(want):
        for c in out.outputs:
            assert joined[(i, c.index)] == (c.token_ids, c.text, (c.finish_reason, c.stop_reason)), f"request {i}.{c.index}"


def test_beam_search_is_the_same_under_every_scheduling(reference, engines):
    prompts, _ = workload(4, reference.llm_engine.config.vocab_size)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    want = reference.beam_search(inputs(prompts[:4]), params)
    for name in ("tiny_pool_prefix_cache", "block_4_async", "priority_tiny_pool"):
        got = engines[name].beam_search(inputs(prompts[:4]), params)
        for a, b in zip(want, got):
            for x, y in zip(a.sequences, b.sequences, strict=True):
                assert (y.tokens, y.text, y.finish_reason) == (x.tokens, x.text, x.finish_reason), name
                assert same_float(x.cum_logprob, y.cum_logprob, 1e-4), name
                assert_same_positions(x.logprobs, y.logprobs, f"{name} beam")
