"""Requests sharing one SamplingParams object (docs/perf.md 87): `add_request`'s ``seed`` gives
each its own draws as ``params.seed`` would; the engine's stop-ids copy is shared by the requests
given one object, and made again once the object changed; the batch job's rows with the same values
share one params object in the engine and sample what they sampled with a params object each."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.requests import derive_seed

from support.jsonl import read_jsonl, write_jsonl

SAMPLED = dict(temperature=1.0, max_tokens=5, ignore_eos=True)
TEXTS = ["the cat sat", "on a warm mat", "while wind blew", "over its fur", "and the sun went down"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
               kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8, seed=0)


def run_engine(llm, requests: list[tuple[str, SamplingParams, int | None]]) -> tuple[dict[str, list[int]], dict[str, object]]:
    """(request_id -> its sampled ids, request_id -> the params object the engine holds for it)."""
    engine = llm.llm_engine
    held = {}
    for i, (text, params, seed) in enumerate(requests):
        engine.add_request(f"r{i}", text, params, seed=seed)
        held[f"r{i}"] = engine.requests[f"r{i}"].params
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    return outputs, held


def test_a_requests_seed_draws_as_its_params_seed_would(llm):
    shared = SamplingParams(**SAMPLED)
    with_seed, held = run_engine(llm, [(t, shared, 100 + i) for i, t in enumerate(TEXTS)])
    each, _ = run_engine(llm, [(t, SamplingParams(**SAMPLED, seed=100 + i), None) for i, t in enumerate(TEXTS)])
    assert with_seed == each
    assert len({id(p) for p in held.values()}) == 1  # one params object for all five
    again, _ = run_engine(llm, [(TEXTS[0], shared, 100), (TEXTS[0], shared, 101)])
    assert again["r0"] == with_seed["r0"] and again["r1"] != again["r0"]  # its own seed, its own draws
    with pytest.raises(ValueError, match="seed must be an integer, got str"):
        llm.llm_engine.add_request("bad", TEXTS[0], shared, seed="7")


def test_requests_given_one_params_object_share_the_engines_copy(llm):
    """ignore_eos off: the engine adds the model's eos to the stop ids on a copy; requests given the
    same object one after another share that copy, until the object's fields change."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    _, held = run_engine(llm, [(t, params, None) for t in TEXTS[:3]])
    copies = {id(p) for p in held.values()}
    assert len(copies) == 1 and held["r0"] is not params and held["r0"].all_stop_token_ids - params.all_stop_token_ids
    params.max_tokens = 2  # changed between two requests: a fresh copy, with the new value
    outputs, later = run_engine(llm, [(TEXTS[0], params, None)])
    assert id(later["r0"]) not in copies and later["r0"].max_tokens == 2 and len(outputs["r0"]) == 2
    params.stop_token_ids = [7]  # the stop ids themselves
    _, latest = run_engine(llm, [(TEXTS[0], params, None)])
    assert 7 in latest["r0"].all_stop_token_ids and latest["r0"] is not later["r0"]
    other = SamplingParams(temperature=0.0, max_tokens=3)  # equal values, another object: its own copy
    _, theirs = run_engine(llm, [(TEXTS[0], other, None)])
    assert theirs["r0"] is not latest["r0"]


def test_job_rows_share_params_and_sample_with_their_own_seeds(tmp_path, llm, monkeypatch):
    rows = [{"prompt": t} for t in TEXTS * 2] + [{"prompt": TEXTS[0], "sampling_params": {"seed": 3}},
                                                  {"prompt": TEXTS[1], "sampling_params": {"temperature": 0}}]
    engine = llm.llm_engine
    held = {}
    original = engine.add_request

    def recording(request_id, *args, **kwargs):
        result = original(request_id, *args, **kwargs)
        held[request_id] = engine.requests[request_id].params
        return result

    monkeypatch.setattr(engine, "add_request", recording)
    summary = run_job(JobConfig(input=str(write_jsonl(tmp_path / "in.jsonl", rows)), output=str(tmp_path / "out.jsonl"),
                                model="tiny", sampling=dict(SAMPLED), progress=False, seed=11, max_inflight=4), llm=llm)
    assert summary.rows_done == 12 and summary.failed == 0
    assert len({id(held[f"row-{i}"]) for i in range(10)}) == 1  # the ten rows with the job's values
    texts = {r["row"]: r["text"] for r in read_jsonl(tmp_path / "out.jsonl")}
    # Each row as generate samples it with a params object of its own carrying the row's seed.
    own = [SamplingParams(**SAMPLED, seed=derive_seed(11, i)) for i in range(10)]
    own += [SamplingParams(**SAMPLED, seed=3), SamplingParams(**{**SAMPLED, "temperature": 0})]
    expected = [o.outputs[0].text for o in llm.generate([r["prompt"] for r in rows], own, use_tqdm=False)]
    assert [texts[i] for i in range(12)] == expected
    assert len(set(expected[:5])) > 1 and expected[:5] != expected[5:10]  # rows draw apart, not alike
