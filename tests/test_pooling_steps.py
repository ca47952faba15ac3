"""How the pooling engine packs and runs its steps: whole prompts under the token budget, one batch
launched while the previous one is read back (asynchronous scheduling), several kinds of request in
one step, aborts of requests in flight, a failed step, and the GPU's default step size. Results
are held to transformers' fp32 hidden states of a tiny random BERT embedder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, PoolingParams
from tokenmill.pooling.config import PoolerConfig, PoolingModelConfig

ENGINE = dict(dtype="float32", device="cpu", seed=0)


@pytest.fixture(scope="module")
def bert_hidden(tiny_bert_embedder_dir):
    """prompt ids -> transformers' last hidden states [T, H] of the tiny BERT embedder."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_bert_embedder_dir, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    return hidden


@pytest.fixture(scope="module")
def async_embedder(tiny_bert_embedder_dir):
    # A 64-token budget: the 20 prompts below take several steps, each launched before the last is read.
    return LLM(str(tiny_bert_embedder_dir), async_scheduling=True, max_num_batched_tokens=64, **ENGINE)


def _prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 90, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (count,), generator=gen)]


def test_async_steps_match_transformers_and_the_synchronous_engine(async_embedder, tiny_bert_embedder_dir, bert_hidden):
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(20, seed=1)]
    got = async_embedder.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    assert async_embedder.llm_engine.config.async_scheduling
    for prompt, out in zip(prompts, got):
        expected = bert_hidden(prompt["prompt_token_ids"])[0]  # CLS
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=1e-5, atol=1e-5)
    sync = LLM(str(tiny_bert_embedder_dir), async_scheduling=False, max_num_batched_tokens=64, **ENGINE)
    assert [o.outputs.embedding for o in sync.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)] == [
        o.outputs.embedding for o in got
    ]


def test_one_step_serves_different_params_and_tasks(tiny_bert_embedder_dir, bert_hidden):
    llm = LLM(str(tiny_bert_embedder_dir), **ENGINE)  # one step holds every request below
    engine = llm.llm_engine
    prompts = _prompts(5, seed=2)
    asks = [
        PoolingParams(task="embed", normalize=False),
        PoolingParams(task="embed", normalize=True),
        PoolingParams(task="token_embed", normalize=False),
        PoolingParams(task="embed", normalize=False),
        PoolingParams(task="token_embed", normalize=True),
    ]
    for i, (ids, params) in enumerate(zip(prompts, asks)):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    outputs = engine.step()
    assert not engine.has_unfinished_requests() and len(outputs) == 5
    by_id = {o.request_id: o.outputs.data for o in outputs}
    for i, (ids, params) in enumerate(zip(prompts, asks)):
        hidden = bert_hidden(ids)
        expected = hidden if params.task == "token_embed" else hidden[0]
        if params.normalize:
            expected = F.normalize(expected, dim=-1)
        torch.testing.assert_close(by_id[f"r{i}"], expected, rtol=1e-5, atol=1e-5)


def test_a_calls_requests_enter_a_few_steps_ahead_of_the_engine(async_embedder, bert_hidden, monkeypatch):
    """embed() adds its requests while the engine runs the earlier ones (at most two steps' tokens
    queued ahead, plus one prompt), not all before the first step, and turns each output into an
    embedding as it arrives; the results are transformers' in input order."""
    engine = async_embedder.llm_engine
    budget = engine.config.max_num_batched_tokens
    events, queued = [], []
    add, step = engine.queue, engine.step

    def recording_add(request):
        events.append("add")
        return add(request)

    def recording_step(*args, **kwargs):
        events.append("step")
        queued.append(engine.queued_tokens)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "queue", recording_add)
    monkeypatch.setattr(engine, "step", recording_step)
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(40, seed=6)]
    got = async_embedder.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    assert events.index("step") < len(events) - 1 - events[::-1].index("add"), "every request was added before the first step"
    assert max(queued) <= 2 * budget + 40, queued
    for prompt, out in zip(prompts, got):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), bert_hidden(prompt["prompt_token_ids"])[0],
                                   rtol=1e-5, atol=1e-5)
    assert engine.queued_tokens == 0 and not engine.has_unfinished_requests()


def test_an_invalid_prompt_late_in_a_call_still_rejects_the_whole_call(async_embedder):
    """Its error names the prompt before any request runs (tests/test_pooling_call_checks.py has
    every kind of bad prompt), and the engine serves the next call."""
    engine = async_embedder.llm_engine
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(30, seed=7)]
    prompts[27] = {"prompt_token_ids": [5, 6, engine.config.vocab_size]}
    with pytest.raises(ValueError, match=r"prompts\[27\]"):
        async_embedder.embed(prompts, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert len(async_embedder.embed(prompts[:3], use_tqdm=False)) == 3
    assert engine.queued_tokens == 0


def test_texts_are_tokenized_in_batches_as_the_call_reaches_them(async_embedder, random_sentences, monkeypatch):
    """A call's texts go through the tokenizer's batch path a chunk at a time, giving the ids (and so
    the embeddings) one call a text gives; a request that cuts its prompt is tokenized alone, so the
    tokenizer keeps its special tokens."""
    engine = async_embedder.llm_engine
    tokenizer = engine.tokenizer
    texts = random_sentences(40, seed=8, high=12)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __len__(self):
            return len(tokenizer)

        def __call__(self, text, *args, **kwargs):
            if text != "":  # not the empty text whose special tokens the intake's length bound counts
                calls.append(len(text) if isinstance(text, list) else 1)
            return tokenizer(text, *args, **kwargs)

    monkeypatch.setattr(engine, "tokenizer", Counting())
    got = async_embedder.embed(texts, use_tqdm=False)
    assert sum(calls) == 40 and min(calls) > 1, calls  # the bound leaves the texts it clears to the feed: two calls
    one_by_one = [{"prompt_token_ids": tokenizer.encode(t)} for t in texts]
    assert [o.outputs.embedding for o in got] == [o.outputs.embedding for o in async_embedder.embed(one_by_one, use_tqdm=False)]
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in one_by_one]
    calls.clear()
    cut = async_embedder.embed(texts[:3], PoolingParams(truncate_prompt_tokens=4), use_tqdm=False)
    assert calls == [1, 1, 1] and all(o.prompt_token_ids[-1] == tokenizer.sep_token_id for o in cut)


def test_abort_while_in_flight_drops_only_that_result(async_embedder, bert_hidden):
    engine = async_embedder.llm_engine
    prompts = _prompts(4, seed=3)
    for i, ids in enumerate(prompts[:3]):
        engine.add_request(f"a{i}", {"prompt_token_ids": ids[:20]}, PoolingParams(task="embed", normalize=False))
    assert engine.step() == []  # launched; its results come back with the next step
    engine.abort_request("a1")
    # The id is free again at once: a new request with it is a different request.
    engine.add_request("a1", {"prompt_token_ids": prompts[3]}, PoolingParams(task="embed", normalize=False))
    done = []
    while engine.has_unfinished_requests():
        done.extend(engine.step())
    assert sorted(o.request_id for o in done) == ["a0", "a1", "a2"]
    new = next(o for o in done if o.request_id == "a1")
    assert new.prompt_token_ids == prompts[3]
    torch.testing.assert_close(new.outputs.data, bert_hidden(prompts[3])[0], rtol=1e-5, atol=1e-5)


def test_a_failed_step_leaves_no_request_behind(tiny_bert_embedder_dir, monkeypatch):
    llm = LLM(str(tiny_bert_embedder_dir), **ENGINE)
    engine = llm.llm_engine

    def broken(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", broken)
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, PoolingParams(task="embed"))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert not engine.has_unfinished_requests()
    monkeypatch.undo()
    assert len(llm.embed("the cat sat", use_tqdm=False)[0].outputs.embedding) == 32


def _pooling_config() -> PoolingModelConfig:
    return PoolingModelConfig(
        head="embed", architecture="BertModel", pooler=PoolerConfig(pooling_type="CLS"), classify_activation="identity",
        score_activation=None, labels=None, takes_token_type_ids=True, max_seq_length=None, matryoshka_dimensions=None,
        is_matryoshka=False, hidden_size=32,
    )


def test_step_limits_on_a_gpu_and_off_it(monkeypatch):
    import tokenmill.pooling.config as pooling_config

    config = _pooling_config()
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    kw = dict(max_model_len_given=False, batched_given=False, seqs_given=False, tensor_parallel_size=1)
    assert config.step_limits(512, 8192, 256, device=cpu, **kw) == (512, 8192, 256)
    monkeypatch.setattr(pooling_config, "_gpu_step_tokens", lambda device: 65536 if device.type == "cuda" else 0)
    # Defaults: the GPU step is 64K tokens, and the number of prompts in it is left to the budget.
    assert config.step_limits(512, 16384, 1024, device=gpu, **kw) == (512, 65536, 65536)
    # What the user sets stands.
    given = dict(kw, batched_given=True, seqs_given=True)
    assert config.step_limits(512, 4096, 100, device=gpu, **given) == (512, 4096, 100)
    with pytest.raises(ValueError, match="max_num_batched_tokens=256 is smaller than max_model_len=512"):
        config.step_limits(512, 256, 100, device=gpu, **given)
