"""SamplingParams.flat_logprobs: `FlatLogprobs` reads like the list of per-position dicts (length,
indexing, slicing, iteration, equality), and an engine run with flat_logprobs=True returns the
same contents as one without, for sample and prompt logprobs, top logprobs and logprob_token_ids,
n > 1, and DELTA outputs step by step."""

from __future__ import annotations

import collections
import pickle
import random
from collections.abc import MutableSequence

import pytest

from test_generate import make_llm, random_prompts
from tokenmill import SamplingParams
from tokenmill.logprobs import FlatLogprobs, Logprob, append_position, create_prompt_logprobs
from tokenmill.sampling_params import RequestOutputKind


def random_positions(seed: int, count: int) -> list[dict[int, Logprob] | None]:
    rng = random.Random(seed)
    positions: list[dict[int, Logprob] | None] = [None]  # as prompt logprobs start
    for _ in range(count):
        ids = [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
        positions.append({t: Logprob(-rng.random() * 5, rng.randrange(1, 9), f"t{t}") for t in ids})
    return positions


def test_reads_like_the_list_of_dicts():
    positions = random_positions(0, 12)
    flat = FlatLogprobs()
    flat.extend(positions)
    assert isinstance(flat, MutableSequence) and len(flat) == len(positions)
    assert flat[0] == {} and flat == positions and positions == flat  # a position without logprobs reads as {}
    assert [flat[i] for i in range(1, len(flat))] == positions[1:] and list(flat)[1:] == positions[1:]
    assert flat[-1] == positions[-1] and flat[-3] == positions[-3]
    for s in (slice(2, 7), slice(None, None, 2), slice(-4, None), slice(5, 5), slice(9, 2, -2), slice(0, 100)):
        part = flat[s]
        assert isinstance(part, FlatLogprobs) and part == positions[s] and len(part) == len(positions[s])
    assert flat[3:9][1:4] == positions[3:9][1:4]
    assert flat != positions[:-1] and flat != positions[:-1] + [{1: Logprob(0.0)}]
    assert pickle.loads(pickle.dumps(flat)) == positions
    with pytest.raises(IndexError):
        flat[len(positions)]
    with pytest.raises(TypeError):
        flat["1"]
    for change in (lambda: flat.__setitem__(1, {}), lambda: flat.__delitem__(1), lambda: flat.insert(0, {})):
        with pytest.raises(TypeError):
            change()


def test_a_repeated_id_reads_back_as_in_a_dict():
    # append_position keeps a repeated id's first place and its last values, as a dict does.
    args = ([4, 7, 4, 9], [-1.0, -2.0, -3.0, -4.0], [2, 1, 5, 6], ["a", "b", "c", "d"])
    flat, listed = FlatLogprobs(), []
    append_position(flat, *args)
    append_position(listed, *args)
    assert flat == listed and list(flat[0]) == [4, 7, 9] and flat[0][4] == Logprob(-3.0, 5, "c")
    assert flat.token_ids == [4, 7, 9] and flat.start_indices == [0] and flat.end_indices == [3]


def test_prompt_container_starts_with_the_unpredicted_position():
    assert create_prompt_logprobs(False) == [None]
    flat = create_prompt_logprobs(True)
    assert isinstance(flat, FlatLogprobs) and len(flat) == 1 and flat[0] == {}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(llm.llm_engine.config.vocab_size, [7, 15, 4], seed=5)


CASES = [
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprob_token_ids=[3, 9, 3], prompt_logprobs=0),
    SamplingParams(temperature=0.7, seed=8, best_of=3, n=2, max_tokens=4, ignore_eos=True, logprobs=0),
    # Without decoded tokens the list form's positions are built by output_processor._position,
    # the flat form's by _append: the two must still agree.
    SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=5, ignore_eos=True, logprobs=1, detokenize=False),
    SamplingParams(temperature=1.0, seed=6, max_tokens=5, ignore_eos=True, logprobs=4, detokenize=False),
    # Prompt positions without decoded tokens: the list form's built by _position, the flat form's
    # columns by FlatLogprobs.extend_ranked (k = 1, a scoring job's, and k = 3).
    SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1, logprobs=0, detokenize=False),
    SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3, logprobs=2, detokenize=False),
]


def run(llm, prompt: list[int], params: SamplingParams) -> list:
    """Every output the engine gives for one request, step by step."""
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_flat_outputs_carry_the_same_contents(llm, prompts, case, kind):
    params = CASES[case].clone(output_kind=kind)
    if kind is RequestOutputKind.DELTA and params.num_samples > params.n:
        with pytest.raises(ValueError, match="best_of=3 with n=2 is refused for output_kind=DELTA"):
            run(llm, prompts[0], params)  # which samples it returns is known only at the end
        return
    for prompt in prompts:
        plain = run(llm, prompt, params)
        flat = run(llm, prompt, params.clone(flat_logprobs=True))
        assert len(flat) == len(plain) > 1
        for position, (f, p) in enumerate(zip(flat, plain)):
            assert [c.token_ids for c in f.outputs] == [c.token_ids for c in p.outputs]
            assert [c.cumulative_logprob for c in f.outputs] == [c.cumulative_logprob for c in p.outputs]
            for fc, pc in zip(f.outputs, p.outputs):
                assert isinstance(fc.logprobs, FlatLogprobs) and isinstance(pc.logprobs, list)
                assert fc.logprobs == pc.logprobs and len(fc.logprobs) == len(fc.token_ids)
            if params.prompt_logprobs is not None:
                assert isinstance(f.prompt_logprobs, FlatLogprobs) and f.prompt_logprobs == p.prompt_logprobs
                if kind is RequestOutputKind.DELTA and position > 0:  # vLLM: all in the first output, then none
                    assert len(f.prompt_logprobs) == len(p.prompt_logprobs) == 0
                else:
                    assert f.prompt_logprobs[0] == {} and p.prompt_logprobs[0] is None
            else:
                assert f.prompt_logprobs is None and p.prompt_logprobs is None
        if kind is RequestOutputKind.DELTA:
            # Each output holds only the new position, and the deltas add up to whole outputs.
            joined = collections.Counter()
            for out in flat:
                for c in out.outputs:
                    assert len(c.logprobs) == len(c.token_ids) <= 1
                    joined[c.index] += len(c.logprobs)
            assert joined == {i: params.max_tokens for i in range(params.n)}


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_a_position_built_directly_matches_the_general_path(k):
    """output_processor._position (the list form without decoded tokens, once per sampled token)
    gives the dict `OutputProcessor._append` gives, entries and order: the token first with its
    rank, then the top ones ranked 1.. without the token itself, a repeated id in its first place
    with its last values; rows wider than k (the step's largest k) are cut to k."""
    from tokenmill.engine.output_processor import OutputProcessor, _position

    rng = random.Random(k)
    general = OutputProcessor(tokenizer=None)
    for _ in range(300):
        width = k + rng.randrange(3)
        top_ids = [rng.randrange(6) for _ in range(width)]  # a small range: the token and repeats come up
        top_logprobs = [-rng.random() for _ in range(width)]
        token, logprob, rank = rng.randrange(6), -rng.random(), rng.randrange(1, 9)
        expected: list = []
        general._append(expected, token, logprob, rank, (top_ids[:k], top_logprobs[:k]) if k else None, detokenize=False)
        got = _position(token, logprob, rank, top_ids if k else None, top_logprobs if k else None, k)
        assert list(got.items()) == list(expected[0].items())
        assert all(type(v) is Logprob and v.decoded_token is None for v in got.values())
