"""SamplingParams.logprob_token_ids on a tiny random Llama: each output position holds the sampled
token and exactly the listed ids, with Hugging Face's raw log_softmax at those ids (before
penalties and temperature) and vLLM's ranks (the sampled token's rank in the distribution, a
listed id's place in the list); batches mixing rows with and without lists, and with lists of
other lengths, give each row what it gets alone; async scheduling changes nothing; prompt logprobs,
beam searches and the batch job are unaffected or carry it."""

from __future__ import annotations

import json

import pytest
import torch

from reference import hf_model, hf_next_logprobs
from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import BeamSearchParams, SamplingParams
from tokenmill.batch.job import JobConfig, run_job


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return (make_llm(tiny_llama_dir, max_num_seqs=16, async_scheduling=False),
            make_llm(tiny_llama_dir, max_num_seqs=16, async_scheduling=True))


@pytest.fixture(scope="module")
def llm(engines):
    return engines[0]


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return hf_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def vocab(llm):
    return llm.llm_engine.config.vocab_size


@pytest.fixture(scope="module")
def prompts(vocab):
    return random_prompts(vocab, [6, 19, 31, 12, 3], seed=11)


def expected_position(ref: torch.Tensor, token: int, listed: list[int]) -> dict[int, tuple[float, int]]:
    """vLLM's entry for one position, from HF's log_softmax: the sampled token with its rank in the
    distribution, then each listed id with its place in the list (a later entry for an id wins)."""
    entry = {token: (float(ref[token]), int((ref > ref[token]).sum()) + 1)}
    for place, tid in enumerate(listed, start=1):
        entry[tid] = (float(ref[tid]), place)
    return entry


def check_against_hf(hf, prompt: list[int], completion, listed: list[int]) -> None:
    ids = list(prompt)
    assert len(completion.logprobs) == len(completion.token_ids) > 0
    for token, entry in zip(completion.token_ids, completion.logprobs):
        want = expected_position(hf_next_logprobs(hf, ids), token, listed)
        assert list(entry) == list(want)  # the sampled token first, then the listed ids in order
        for tid, (logprob, rank) in want.items():
            assert abs(entry[tid].logprob - logprob) < 1e-4 and entry[tid].rank == rank
        ids.append(token)
    sampled = [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)]
    assert completion.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-5)


def test_listed_ids_get_raw_logprobs_matching_hf(llm, hf, prompts, vocab):
    # Penalties, temperature and a bias change what is sampled, not the logprobs reported (raw, as
    # for `logprobs`); an id listed twice keeps its first place and its last rank, as in vLLM's dict.
    listed = [5, vocab - 1, 40, 5, 17]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True, repetition_penalty=1.5,
                            logit_bias={40: 3.0}, logprob_token_ids=listed)
    for prompt in prompts[:2]:
        check_against_hf(hf, prompt, llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0].outputs[0], listed)


def test_a_listed_sampled_token_takes_its_place_in_the_list_as_rank(llm, hf, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = llm.generate(as_inputs([prompts[0]]), greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    listed = [first + 1, first]
    params = greedy.clone(logprobs=2, logprob_token_ids=listed)
    out = llm.generate(as_inputs([prompts[0]]), params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == first and list(out.logprobs[0]) == [first, first + 1]
    assert out.logprobs[0][first].rank == 2  # vLLM: its place in the list, not its rank (1) in the distribution
    check_against_hf(hf, prompts[0], out, listed)


def mixed_params(vocab: int) -> list[SamplingParams]:
    """Rows with lists of different lengths, with top logprobs, with nothing, n > 1 and best_of."""
    base = dict(max_tokens=6, ignore_eos=True)
    return [
        SamplingParams(temperature=0.9, seed=1, logprob_token_ids=[3, 4, 5], **base),
        SamplingParams(temperature=0.0, logprobs=3, **base),
        SamplingParams(temperature=0.8, seed=2, **base),
        SamplingParams(temperature=0.0, logprobs=7, logprob_token_ids=list(range(vocab - 7, vocab)), **base),
        SamplingParams(temperature=1.0, seed=4, n=2, top_k=20, logprob_token_ids=[9], **base),
        SamplingParams(temperature=1.0, seed=5, n=1, best_of=2, logprob_token_ids=[8, 2], presence_penalty=0.5, **base),
    ]


def contents(outputs) -> list:
    """Per completion: tokens, and per position the (id, rank) pairs in order and the logprobs."""
    return [(c.token_ids, c.cumulative_logprob,
             None if c.logprobs is None else [[(t, lp.rank) for t, lp in e.items()] for e in c.logprobs],
             None if c.logprobs is None else [[lp.logprob for lp in e.values()] for e in c.logprobs])
            for o in outputs for c in o.outputs]


def assert_same(got, want) -> None:
    for g, w in zip(contents(got), contents(want), strict=True):
        assert g[0] == w[0] and g[2] == w[2]
        if w[1] is not None:
            assert g[1] == pytest.approx(w[1], abs=1e-5)
            assert [x for pos in g[3] for x in pos] == pytest.approx([x for pos in w[3] for x in pos], abs=1e-5)


def test_mixed_batch_gives_each_row_what_it_gets_alone(llm, hf, prompts, vocab):
    params = mixed_params(vocab)
    batch = llm.generate(as_inputs(prompts + prompts[:1]), params, use_tqdm=False)
    for prompt, p, out in zip(prompts + prompts[:1], params, batch):
        assert_same([out], llm.generate(as_inputs([prompt]), p, use_tqdm=False))
        for c in out.outputs:
            if p.logprob_token_ids:
                check_against_hf(hf, prompt, c, p.logprob_token_ids)
            elif p.logprobs is not None:
                assert all(1 <= len(e) <= p.logprobs + 1 for e in c.logprobs)  # the top ones, as before
            else:
                assert c.logprobs is None and c.cumulative_logprob is None
    assert len(batch[4].outputs) == 2 and len(batch[5].outputs) == 1


def test_async_scheduling_gives_the_same_logprobs(engines, prompts, vocab):
    sync, overlapped = engines
    params = mixed_params(vocab)
    before = overlapped.llm_engine.stats.num_overlapped_steps
    want = sync.generate(as_inputs(prompts + prompts[:1]), params, use_tqdm=False)
    got = overlapped.generate(as_inputs(prompts + prompts[:1]), params, use_tqdm=False)
    assert_same(got, want)
    assert overlapped.llm_engine.stats.num_overlapped_steps > before


def test_prompt_logprobs_keep_their_top_tokens(llm, hf, prompts):
    # vLLM applies logprob_token_ids to sample logprobs only: prompt positions list their top ones.
    prompt = prompts[1]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, logprob_token_ids=[6, 7, 8])
    out = llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        row = expected[pos - 1]
        assert set(out.prompt_logprobs[pos]) == {prompt[pos], *row.topk(2).indices.tolist()}
    assert all(list(e)[1:] == [6, 7, 8] for e in out.outputs[0].logprobs)


def run_engine(llm, requests: dict[str, tuple[list[int], object]]) -> dict:
    engine = llm.llm_engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_beam_search_beside_listed_ids_is_unchanged(llm, prompts):
    beam = (prompts[2], BeamSearchParams(beam_width=3, max_tokens=4))
    listed = (prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprob_token_ids=[1, 2]))
    alone = run_engine(llm, {"beam": beam})["beam"]
    mixed = run_engine(llm, {"beam": beam, "ids": listed})
    assert [c.token_ids for c in mixed["beam"].outputs] == [c.token_ids for c in alone.outputs]
    assert [c.cumulative_logprob for c in mixed["beam"].outputs] == \
        pytest.approx([c.cumulative_logprob for c in alone.outputs], abs=1e-5)
    assert all(list(e)[1:] == [1, 2] for e in mixed["ids"].outputs[0].logprobs)


def test_ids_outside_the_vocabulary_are_refused_by_name(llm, prompts, vocab):
    message = rf"SamplingParams.logprob_token_ids has token ids \[{vocab}\] outside the vocabulary \[0, {vocab}\)"
    with pytest.raises(ValueError, match=message):
        llm.generate(as_inputs([prompts[0]]), SamplingParams(logprob_token_ids=[1, vocab]), use_tqdm=False)


def test_an_empty_list_asks_for_nothing(llm, prompts):
    params = SamplingParams(max_tokens=2, logprob_token_ids=[])
    out = llm.generate(as_inputs([prompts[0]]), params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_batch_rows_carry_logprob_token_ids(tmp_path, llm, prompts, vocab):
    greedy = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    rows = [{"id": "ids", "prompt_token_ids": prompts[0], "sampling_params": {"logprob_token_ids": [3, 4]}},
            {"id": "plain", "prompt_token_ids": prompts[1]},
            {"id": "bad", "prompt_token_ids": prompts[2], "sampling_params": {"logprob_token_ids": [vocab + 5]}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_job(JobConfig(input=str(path), output=str(tmp_path / "out.jsonl"), model="tiny", sampling=greedy,
                                progress=False), llm=llm)
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert summary.failed == 1 and "SamplingParams.logprob_token_ids" in records["bad"]["error"]
    want = llm.generate(as_inputs([prompts[0]]), SamplingParams(**greedy, logprob_token_ids=[3, 4]), use_tqdm=False)
    assert records["ids"]["cumulative_logprob"] == pytest.approx(want[0].outputs[0].cumulative_logprob, abs=1e-6)
    assert records["plain"]["cumulative_logprob"] is None
