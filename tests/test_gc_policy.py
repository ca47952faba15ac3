"""LLM's blocking generation calls and Python's cyclic garbage collector (tokenmill/gc_policy.py,
docs/perf.md 62): inside a call only young collections run, the collector is on again afterwards
(or stays off when the user turned it off), and a finished or aborted request's `Request` and
`Sequence`s are freed by reference counting alone, so a call that never runs a full collection
keeps no finished request's state."""

from __future__ import annotations

import gc
import weakref

import pytest

from test_generate import make_llm, random_prompts
from tokenmill import BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # A small cache (preemptions) and few sequences a step (many steps, requests finishing throughout).
    return make_llm(tiny_llama_dir, max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=2**18)


@pytest.fixture(scope="module")
def prompts(llm):
    return [{"prompt_token_ids": p} for p in random_prompts(llm.llm_engine.config.vocab_size, [5, 17, 9, 30, 12, 3], seed=2)]


class _Collections:
    """A gc.callbacks hook: the generation of every collection that ran while installed (with
    ``paused_only``, of those that ran while automatic collection was off: the ones asked for)."""

    def __init__(self, paused_only: bool = False) -> None:
        self.generations: list[int] = []
        self.paused_only = paused_only

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start" and not (self.paused_only and gc.isenabled()):
            self.generations.append(info["generation"])

    def __enter__(self) -> "_Collections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


@pytest.fixture
def frequent_collections():
    """Thresholds low enough that a call's allocations would run older collections many times over."""
    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(20, 2, 2)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


LOGPROBS = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, logprobs=2)


def test_a_generation_call_runs_young_collections_only(llm, prompts, frequent_collections):
    threshold = gc.get_threshold()
    with _Collections() as seen:
        outputs = llm.generate(prompts * 4, LOGPROBS, use_tqdm=False)
    assert len(outputs) == 4 * len(prompts)
    assert seen.generations and set(seen.generations) == {0}, sorted(set(seen.generations))
    assert gc.isenabled() and gc.get_threshold() == threshold
    # The queue's blocking call too.
    llm.enqueue(prompts, LOGPROBS)
    with _Collections() as seen:
        assert len(llm.wait_for_completion(use_tqdm=False)) == len(prompts)
    assert seen.generations and set(seen.generations) == {0}, sorted(set(seen.generations))
    assert gc.isenabled()
    # Outside such a call the collector is left as it was: older generations come as usual.
    with _Collections() as seen:
        kept = [[{}] for _ in range(5_000)]
    assert max(seen.generations) >= 1 and kept


def test_prompts_made_in_bulk_with_the_collector_paused(llm, monkeypatch):
    """A call's text prompts are tokenized together, and its conversations rendered together,
    before the call's steps (and their young collections): with the collector paused, so that its
    full passes do not walk the growing lists of prompts again and again."""
    from tokenmill import llm as llm_module

    enabled = []
    for name in ("tokenize_prompts", "render_chat_prompts"):
        original = getattr(llm_module, name)
        monkeypatch.setattr(llm_module, name,
                            lambda *a, _original=original, **k: enabled.append(gc.isenabled()) or _original(*a, **k))
    texts = [f"prompt number {i} about the river" for i in range(30)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert len(llm.generate(texts, params, use_tqdm=False)) == len(texts)
    assert len(llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)) == len(texts)
    assert enabled == [False, False, False] and gc.isenabled()  # generate's texts; chat's render, then its ids


def test_a_batch_job_runs_young_collections_and_a_timed_full_one(llm, prompts, frequent_collections, tmp_path,
                                                                 monkeypatch):
    """`tokenmill run`'s loop: young collections between steps, and a full one only once its
    interval has passed (a job runs for hours; cyclic garbage is freed within minutes)."""
    import json

    from tokenmill.batch import loop
    from tokenmill.batch.job import JobConfig, run_job

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt_token_ids": p["prompt_token_ids"]}) + "\n" for p in prompts * 3))
    config = dict(input=str(rows), sampling=dict(temperature=1.0, max_tokens=20, ignore_eos=True), progress=False,
                  model="tiny")
    seen = _Collections()
    loop_run = loop.JobLoop.run

    def run_watched(self, rows):  # the loop's collections, not the job's set-up (reading the input, the journal)
        with seen:
            return loop_run(self, rows)

    monkeypatch.setattr(loop.JobLoop, "run", run_watched)
    run_job(JobConfig(output=str(tmp_path / "a.jsonl"), **config), llm=llm)
    assert seen.generations and set(seen.generations) == {0}, sorted(set(seen.generations))
    assert gc.isenabled()
    monkeypatch.setattr(loop, "_FULL_COLLECTION_S", 0.0)  # the interval always passed: a full one each step
    seen.generations.clear()
    # Each full collection walks the heap (a big one in a whole test session): few rows, few tokens.
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt_token_ids": p["prompt_token_ids"]}) + "\n" for p in prompts))
    short = dict(config, input=str(few), sampling=dict(temperature=1.0, max_tokens=4, ignore_eos=True))
    run_job(JobConfig(output=str(tmp_path / "b.jsonl"), **short), llm=llm)
    assert set(seen.generations) == {2} and len(seen.generations) >= 4, seen.generations


def test_a_pooling_job_runs_only_the_timed_full_collection(bert_embedder_llm, frequent_collections, tmp_path,
                                                           monkeypatch):
    """An embedding job's loop runs no user code and makes no cycles: no young collections between
    its steps (they were ~10% of its host time a row), only the full one once its interval passed."""
    import json

    from tokenmill.batch import loop
    from tokenmill.batch.job import JobConfig, run_job

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"a sentence about rivers, number {i}"}) + "\n" for i in range(40)))
    config = dict(input=str(rows), task="embed", progress=False, model="tiny", max_inflight=4)  # ten steps at least
    steps, seen = [], _Collections(paused_only=True)  # not the automatic ones after the loop turned it on again
    loop_run, loop_step = loop.JobLoop.run, loop.JobLoop._step

    def run_watched(self, rows):
        with seen:
            return loop_run(self, rows)

    monkeypatch.setattr(loop.JobLoop, "run", run_watched)
    monkeypatch.setattr(loop.JobLoop, "_step", lambda self: steps.append(1) or loop_step(self))
    assert run_job(JobConfig(output=str(tmp_path / "a.jsonl"), **config), llm=bert_embedder_llm).failed == 0
    assert len(steps) >= 10 and seen.generations == [] and gc.isenabled()
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 40
    monkeypatch.setattr(loop, "_FULL_COLLECTION_S", 0.0)  # the interval always passed: a full one each step
    steps.clear()
    run_job(JobConfig(output=str(tmp_path / "b.jsonl"), **config), llm=bert_embedder_llm)
    assert set(seen.generations) == {2} and len(seen.generations) == len(steps) >= 10


def test_the_collector_is_on_again_after_a_failed_call(llm, prompts):
    too_long = {"prompt_token_ids": [5] * 500}  # over max_model_len: refused at intake
    with pytest.raises(ValueError):
        llm.generate(prompts + [too_long], LOGPROBS, use_tqdm=False)
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(llm, prompts):
    gc.disable()
    try:
        with _Collections() as seen:
            llm.generate(prompts, LOGPROBS, use_tqdm=False)
        assert not gc.isenabled() and seen.generations == []
    finally:
        gc.enable()


def _watch_requests(llm) -> tuple[list[weakref.ref], callable]:
    """Weak references to every request the engine takes, its sequences and beams forked later."""
    refs: list[weakref.ref] = []
    scheduler = llm.llm_engine.scheduler
    add, add_forks = scheduler.add, scheduler.add_forks

    def watched_add(request):
        refs.append(weakref.ref(request))
        refs.extend(weakref.ref(seq) for seq in request.sequences)
        return add(request)

    def watched_forks(seqs):
        refs.extend(weakref.ref(seq) for seq in seqs)
        return add_forks(seqs)

    scheduler.add, scheduler.add_forks = watched_add, watched_forks

    def unwatch():
        del scheduler.add, scheduler.add_forks

    return refs, unwatch


def test_finished_and_aborted_requests_are_freed_without_the_collector(llm, prompts):
    """With the cyclic collector off, reference counting alone frees every request once the call
    is over: no Request <-> Sequence cycle is left behind (Request.release)."""
    refs, unwatch = _watch_requests(llm)
    gc.collect()
    gc.disable()
    try:
        llm.generate(prompts * 3, [LOGPROBS, SamplingParams(n=2, best_of=3, max_tokens=12, logprobs=1, stop=["a"]),
                                   SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=1, flat_logprobs=True,
                                                  logprobs=3)] * len(prompts), use_tqdm=False)
        llm.beam_search(prompts[:3], BeamSearchParams(beam_width=3, max_tokens=6))
        stream = llm.stream(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
        next(stream), next(stream)
        stream.close()  # aborts what is still running
        llm.enqueue(prompts[:2], LOGPROBS)
        llm.wait_for_completion(use_tqdm=False)
        list(llm.imap(prompts, SamplingParams(max_tokens=5), max_in_flight=2))
        assert llm.llm_engine.scheduler.num_preemptions > 0  # the small cache made some
        alive = [ref() for ref in refs if ref() is not None]
        assert len(refs) > 6 * len(prompts) and not alive, [type(o).__name__ for o in alive[:10]]
    finally:
        gc.enable()
        unwatch()
