"""A pooling call checks every prompt before its first step: one bad prompt, even the last of a call
whose requests are fed to the engine a few steps ahead of it, refuses the whole call before any
request runs (vLLM's LLM does the same: it processes every prompt before its engine runs), names
the prompt, and leaves the engine serving the next call."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, PoolingParams

# A 64-token step: the good prompts below fill several steps, so a feed that checked each prompt only
# when it reached it would have run some before meeting the bad last one.
ENGINE = dict(dtype="float32", device="cpu", seed=0, max_num_batched_tokens=64, max_model_len=64)
COUNT = 30  # good prompts before the bad one: prompts[30] is the bad one


@pytest.fixture(scope="module")
def embedder(tiny_bert_embedder_dir):
    return LLM(str(tiny_bert_embedder_dir), **ENGINE)


@pytest.fixture(scope="module")
def classifier(tiny_bert_classifier_dir):
    return LLM(str(tiny_bert_classifier_dir), **ENGINE)


@pytest.fixture(scope="module")
def cross_encoder(tiny_cross_encoder_dir):
    return LLM(str(tiny_cross_encoder_dir), **ENGINE)


def _good(count: int = COUNT) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(5, 90, (int(n),), generator=gen).tolist()}
            for n in torch.randint(10, 40, (count,), generator=gen)]


def _launches(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the size of every batch the engine launches from now on."""
    runner = llm.llm_engine.runner
    launch, launched = runner.launch, []

    def recording(batch):
        launched.append(len(batch))
        return launch(batch)

    monkeypatch.setattr(runner, "launch", recording)
    return launched


def _assert_nothing_ran_and_engine_serves(llm: LLM, launched: list[int]) -> None:
    engine = llm.llm_engine
    assert launched == [], f"batches ran before the bad prompt was refused: {launched}"
    assert not engine.has_unfinished_requests() and engine.queued_tokens == 0 and not engine.waiting
    assert len(llm.encode(_good(3), use_tqdm=False)) == 3 and launched


LONG_TEXT = " ".join(["the cat sat on the mat"] * 20)  # > 64 tokens for the tiny BERT tokenizer
# Every kind of prompt the intake refuses: (the bad last prompt, what its error says).
BAD_PROMPTS = {
    "too many token ids": ({"prompt_token_ids": [5] * 65}, r"prompts\[30\] has 65 tokens, more than max_model_len=64"),
    "a text too long": (LONG_TEXT, r"prompts\[30\] has \d+ tokens, more than max_model_len=64"),
    "no token ids": ([], r"prompts\[30\] is empty"),
    "an id past the vocabulary": ({"prompt_token_ids": [5, 6, 133]}, r"prompts\[30\] holds token id 133, outside the vocabulary \[0, 133\)"),
    "a negative id": ([5, -1, 7], r"prompts\[30\] holds token id -1"),
    "a string among ids": ([5, "6"], r"prompts\[30\] is a list, so it must be token ids"),
    "a float": (3.5, r"prompts\[30\] has type float"),
    "None": (None, r"prompts\[30\] has type NoneType"),
    "a dict without a prompt": ({"text": "a cat"}, r"prompts\[30\] is a dict without 'prompt' or 'prompt_token_ids'"),
    "a prompt that is no text": ({"prompt": 7}, r"prompts\[30\]\.prompt must be a string"),
    "ids that are no list": ({"prompt_token_ids": "5 6"}, r"prompts\[30\]\.prompt_token_ids must be a list of integers"),
    "an image": ({"prompt": "a cat", "multi_modal_data": {"image": "x.png"}}, r"prompts\[30\]\.multi_modal_data is not supported"),
    "token types of another length": ({"prompt_token_ids": [5, 6, 7], "token_type_ids": [0, 1]},
                                      r"prompts\[30\]\.token_type_ids must be 3 integers in \[0, 2\)"),
}
# Each pooling method (as LLM's, on a model that serves it) with a list of prompts.
METHODS = {
    "embed": ("embedder", lambda llm, prompts, **kw: llm.embed(prompts, use_tqdm=False, **kw)),
    "encode": ("embedder", lambda llm, prompts, **kw: llm.encode(prompts, use_tqdm=False, pooling_task="token_embed", **kw)),
    "classify": ("classifier", lambda llm, prompts, **kw: llm.classify(prompts, use_tqdm=False, **kw)),
    "reward": ("classifier", lambda llm, prompts, **kw: llm.reward(prompts, use_tqdm=False, **kw)),
    "score": ("embedder", lambda llm, prompts, **kw: llm.score(prompts[0], prompts[1:], use_tqdm=False, **kw)),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", BAD_PROMPTS)
def test_a_bad_last_prompt_refuses_the_call_before_any_step(method, kind, request, monkeypatch):
    model, call = METHODS[method]
    llm = request.getfixturevalue(model)
    bad, message = BAD_PROMPTS[kind]
    launched = _launches(llm, monkeypatch)
    prompts = _good() + [bad]
    if method == "score":  # data_1 is the first prompt; data_2's last is prompts[30] of the embedded list
        prompts = [{"prompt": "a cat"}] + prompts[1:]
    with pytest.raises(ValueError, match=message):
        call(llm, prompts)
    _assert_nothing_ran_and_engine_serves(llm, launched)


@pytest.mark.parametrize("method", ["embed", "encode", "classify", "reward"])
def test_a_bad_last_pooling_params_refuses_the_call_before_any_step(method, request, monkeypatch):
    """Per-prompt PoolingParams are checked before the first step too: the last one's cut longer
    than max_model_len, or (an embedder) its dimensions on a model without Matryoshka training."""
    model, call = METHODS[method]
    llm = request.getfixturevalue(model)
    launched = _launches(llm, monkeypatch)
    prompts = _good() + [{"prompt_token_ids": [5, 6, 7]}]
    params = [PoolingParams()] * COUNT + [PoolingParams(truncate_prompt_tokens=65)]
    with pytest.raises(ValueError, match=r"prompts\[30\]: truncate_prompt_tokens=65 is larger than max_model_len=64"):
        call(llm, prompts, pooling_params=params)
    _assert_nothing_ran_and_engine_serves(llm, launched)
    if model == "embedder":
        params = [PoolingParams()] * COUNT + [PoolingParams(dimensions=8)]
        launched.clear()
        with pytest.raises(ValueError, match=r"pooling_params\[30\]: PoolingParams.dimensions=8: .* Matryoshka"):
            call(llm, prompts, pooling_params=params)
        _assert_nothing_ran_and_engine_serves(llm, launched)


def test_an_empty_text_is_refused_before_any_step(tiny_qwen3_classifier_dir, monkeypatch):
    """A tokenizer that adds no special tokens makes no ids of an empty text: refused by its index."""
    llm = LLM(str(tiny_qwen3_classifier_dir), **ENGINE)
    assert llm.get_tokenizer()("")["input_ids"] == []
    launched = _launches(llm, monkeypatch)
    texts = [" ".join(["hello world"] * (i % 4 + 2)) for i in range(COUNT)] + [""]
    with pytest.raises(ValueError, match=r"prompts\[30\] is empty"):
        llm.classify(texts, use_tqdm=False)
    _assert_nothing_ran_and_engine_serves(llm, launched)


def test_a_cross_encoders_pair_too_long_is_refused_before_any_step(cross_encoder, monkeypatch):
    launched = _launches(cross_encoder, monkeypatch)
    documents = [" ".join(["a cat"] * (i % 9 + 2)) for i in range(COUNT)] + [LONG_TEXT]
    with pytest.raises(ValueError, match=r"prompts\[30\] has \d+ tokens, more than max_model_len=64"):
        cross_encoder.score("a query", documents, use_tqdm=False)
    _assert_nothing_ran_and_engine_serves(cross_encoder, launched)


def test_a_request_id_in_use_is_refused_before_any_step(embedder, monkeypatch):
    """A request the user queued in the engine under the id the call's last prompt would get."""
    engine = embedder.llm_engine
    launched = _launches(embedder, monkeypatch)
    taken = str(next(embedder._request_counter) + 1 + COUNT)  # the call's ids follow this one
    engine.add_request(taken, {"prompt_token_ids": [5, 6]}, PoolingParams(task="embed"))
    with pytest.raises(ValueError, match=rf"request_id '{taken}' is already in use"):
        embedder.embed(_good() + [[5, 6, 7]], use_tqdm=False)
    assert launched == [] and list(engine.requests) == [taken]
    engine.abort_request(taken)
    assert len(embedder.encode(_good(3), use_tqdm=False)) == 3
    assert not engine.has_unfinished_requests() and engine.queued_tokens == 0


def test_a_good_call_still_runs_ahead_of_its_feed(embedder, monkeypatch):
    """The checks come first; the requests still enter the engine a few steps ahead of it, not all
    before its first step (docs/perf.md 100)."""
    engine = embedder.llm_engine
    queued = []
    step = engine.step

    def recording_step(*args, **kwargs):
        queued.append(len(engine.waiting))
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", recording_step)
    prompts = _good()
    got = embedder.embed(prompts, use_tqdm=False)
    assert len(got) == COUNT and [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in prompts]
    assert max(queued) < COUNT, queued


# ---- texts: tokenized in the check only where their length needs it ---------------------------

TRICKY_TEXTS = [
    "", " ", "a", "hello world", "  two  spaces ", "line\nbreaks\r\n", "tab\tand\x00nul", "<|im_end|> a special in text",
    "café naïve", "日本語のテキスト", "emoji 👍🏽 and flags 🇫🇷", "\U0001d160 expands 3x under NFC", "\ufb2c\u0958 too",
    "e\u0301 combining", "\u212b angstrom sign", "x" * 300,
]


def _with_normalizer(tokenizer, normalizer):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|im_end|>")


def test_the_token_bound_holds_where_it_is_given(minilm_dir, random_sentences):
    """The bound is never below the count transformers' tokenizer gives: a byte-level BPE (the tiny
    one has no merges past ASCII, so its tokens are nearly bytes and the bound is tight), with and
    without NFC, and all-MiniLM-L6-v2's WordPiece (ASCII texts only); other tokenizers get none."""
    import sys

    from tokenizers import normalizers
    from transformers import AutoTokenizer

    from tests.support.tiny_models import build_tiny_tokenizer
    from tokenmill.pooling.intake import token_bound

    plain = build_tiny_tokenizer()
    nfc = _with_normalizer(plain, normalizers.NFC())
    minilm = AutoTokenizer.from_pretrained(minilm_dir)
    texts = TRICKY_TEXTS + random_sentences(50, seed=3) + ["[SEP] a special, in text", "x" * 120, "\x00\x01 \t", "a-b.c,d!e"]
    for tokenizer in (plain, nfc, minilm):
        bound = token_bound(tokenizer, len(tokenizer))
        assert bound is not None
        for text in texts:
            assert bound(text) >= len(tokenizer(text)["input_ids"]), (tokenizer.backend_tokenizer.model, text)
    assert token_bound(nfc, len(nfc))("\U0001d160") == len(nfc("\U0001d160")["input_ids"]) == 12  # 4 bytes, 12 under NFC
    assert token_bound(minilm, len(minilm))("café") == sys.maxsize  # WordPiece: ASCII only
    assert token_bound(plain, len(plain) - 1) is None  # ids past the model's vocabulary: checked by tokenizing
    assert token_bound(plain, len(plain)) is not None
    assert token_bound(_with_normalizer(plain, normalizers.NFKC()), len(plain)) is None  # NFKC expands more
    assert token_bound(_with_normalizer(plain, normalizers.Replace("a", "aaaa")), len(plain)) is None


def test_texts_the_bound_clears_are_tokenized_as_the_feed_reaches_them(tiny_qwen3_classifier_dir, monkeypatch):
    """On a byte-level BPE, texts the bound clears wait for the feed (the tokenizer's batch path, a
    chunk a call, interleaved with the steps), a text it cannot clear is tokenized in the check and
    refused there; the ids are transformers' for each text alone, the results those of token ids."""
    import tokenmill.pooling.intake as intake

    llm = LLM(str(tiny_qwen3_classifier_dir), **ENGINE)
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    launched = _launches(llm, monkeypatch)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __len__(self):
            return len(tokenizer)

        def __call__(self, text, *args, **kwargs):
            calls.append((len(text) if isinstance(text, list) else text, len(launched)))
            return tokenizer(text, *args, **kwargs)

    monkeypatch.setattr(engine, "tokenizer", Counting())
    monkeypatch.setattr(intake, "TOKENIZE_CHUNK", 8)
    texts = [" ".join(["hello world"] * (i % 4 + 1)) for i in range(COUNT)]
    got = llm.classify(texts, use_tqdm=False)
    text_calls = [c for c in calls if c[0] != ""]
    assert [n for n, _ in text_calls] == [8, 8, 8, 6], calls
    assert text_calls[0][1] == 0 and text_calls[-1][1] > 0, "the cleared texts were all tokenized before the first step"
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert [o.prompt_token_ids for o in got] == ids
    assert [o.outputs.probs for o in got] == [o.outputs.probs for o in llm.classify([{"prompt_token_ids": i} for i in ids], use_tqdm=False)]
    assert [n for n, _ in calls].count("") == 1  # the bound's probe of the special tokens
    calls.clear()
    launched.clear()
    with pytest.raises(ValueError, match=r"prompts\[30\] has 65 tokens, more than max_model_len=64"):
        llm.classify(texts + ["x" * 65], use_tqdm=False)
    assert launched == [] and [n for n, _ in calls] == [1]  # only the long text, in the check; the bound kept
