"""Stop conditions over random outputs, without a model: the scheduler's check_stop and the output
processor's DELTA outputs, driven token by token, against a model of vLLM's rules written here from
the tokenizer's own decode (not from the detokenizer): the final text is cut before (or after, with
include_stop_str_in_output) the stop string, finish_reason and stop_reason are vLLM's, and the
deltas join into the final output without ever carrying text a later cut takes back.

The tokenizer is the byte-level BPE one of the tiny models: emoji and CJK characters are split over
several byte tokens, raw bytes can form invalid UTF-8, and its special tokens are in the outputs."""

from __future__ import annotations

import random
from typing import Any

import pytest

from support.tiny_models import build_tiny_tokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request, Sequence, SequenceStatus
from tokenmill.engine.scheduler import check_stop
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

TEXTS = ["héllo 東京 🙂 world", "  spaced  out\n\ttabs", "emoji 😀🙂👍🏽 cjk 语言模型", "naïve café — ok", "x=1; y = [1,2]"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def random_ids(tokenizer: Any, rng: random.Random, count: int) -> list[int]:
    """Pieces of real text (characters split across tokens), special tokens, lone bytes, any id."""
    from tokenizers import pre_tokenizers

    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    special = sorted(tokenizer.added_tokens_decoder)
    ids: list[int] = []
    while len(ids) < count:
        r = rng.random()
        if r < 0.4:
            text = rng.choice(TEXTS)
            start = rng.randrange(len(text))
            ids += tokenizer.encode(text[start:rng.randrange(start, len(text) + 1)], add_special_tokens=False)
        elif r < 0.5:
            ids.append(rng.choice(special))
        elif r < 0.6:
            ids.append(tokenizer.convert_tokens_to_ids(rng.choice(byte_tokens)))
        else:
            ids.append(rng.randrange(len(tokenizer)))
    return ids[:count]


def decoded_chunks(tokenizer: Any, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    """What each output token adds to decode(prompt + outputs so far), a character split over
    tokens given with its last piece (a stream holds back an unfinished one)."""
    def complete_text(ids: list[int]) -> str:
        ids = list(ids)
        while ids and tokenizer.decode(ids, skip_special_tokens=skip).endswith("\ufffd"):
            ids.pop()
        return tokenizer.decode(ids, skip_special_tokens=skip)

    base = complete_text(prompt)
    texts = [complete_text(prompt + output[:k])[len(base):] for k in range(len(output) + 1)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    return [b[len(a):] for a, b in zip(texts, texts[1:])]


def vllm_outcome(chunks: list[str], output: list[int], params: SamplingParams, eos: int) -> tuple[str, str | None, Any, int]:
    """vLLM's rules, a token at a time: a stop id (eos unless ignore_eos, stop_token_ids) once
    min_tokens are out, its text left out unless include_stop_str_in_output; a stop string once past
    min_tokens, counted where it ends in the new text; the one starting earliest of those (tokenmill's
    tie rule, docs/from-vllm.md); then max_tokens. Returns (text, finish_reason, stop_reason, tokens)."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    text = ""
    for k, (token, chunk) in enumerate(zip(output, chunks), start=1):
        stop_id = k >= params.min_tokens and token in stop_ids
        old = len(text)
        if not stop_id or params.include_stop_str_in_output:
            text += chunk
        if k > params.min_tokens and len(text) > old:
            hits = [(at, s) for s in params.stop if (at := text.find(s, max(0, old - len(s) + 1))) != -1]
            if hits:
                at, stop = min(hits, key=lambda hit: hit[0])
                return (text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]), "stop", stop, k
        if stop_id:
            return text, "stop", None if token == eos and not params.ignore_eos else token, k
        if params.max_tokens is not None and k >= params.max_tokens:
            return text, "length", None, k
    return text, None, None, len(output)


def drive(tokenizer: Any, prompt: list[int], output: list[int], params: SamplingParams) -> tuple[Sequence, str, list[int]]:
    """Feed the tokens through check_stop as the scheduler does, taking a DELTA output after each;
    every delta joined so far must be the start of the text every later output grows from."""
    eos = tokenizer.eos_token_id
    params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    request = Request("r", None, prompt, params)
    if params.max_tokens is not None:
        request.max_output_tokens = params.max_tokens
    seq = Sequence(0, 0, request, prompt)
    seq.detokenizer = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens, params.stop,
                                             params.include_stop_str_in_output, params.spaces_between_special_tokens)
    request.sequences = [seq]
    processor = OutputProcessor(tokenizer)
    joined, joined_ids = "", []
    for token in output:
        seq.output_token_ids.append(token)
        check_stop(seq, token, frozenset({eos}))
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
        completion = processor.request_output(request).outputs[0]
        joined, joined_ids = joined + completion.text, joined_ids + completion.token_ids
        assert seq.text.startswith(joined), "a delta carried text the stop cut took back"
        if seq.is_finished:
            break
    return seq, joined, joined_ids


def test_stops_against_vllms_rules_and_deltas_join_into_the_final_output(tokenizer):
    rng = random.Random(0)
    eos = tokenizer.eos_token_id
    stopped_by_string = 0
    for case in range(250):
        ids = random_ids(tokenizer, rng, 28)
        prompt, output = ids[:5], ids[5:]
        if rng.random() < 0.3:
            output.insert(rng.randrange(len(output)), eos)
        skip = rng.random() < 0.7
        chunks = decoded_chunks(tokenizer, prompt, output, skip)
        full = "".join(chunks)
        stops = []
        for _ in range(rng.randrange(1, 4)):  # pieces of the text (across token boundaries), or absent ones
            start = rng.randrange(len(full)) if full else 0
            stops.append(full[start:start + rng.randrange(1, 6)] if full and rng.random() < 0.8 else "zq" * rng.randrange(1, 4))
        min_tokens = rng.choice([0, 0, 1, 3, 6])
        params = SamplingParams(
            stop=list(dict.fromkeys(s for s in stops if s)), include_stop_str_in_output=rng.random() < 0.5,
            stop_token_ids=[rng.choice(output + [eos])] if rng.random() < 0.3 else [], skip_special_tokens=skip,
            min_tokens=min_tokens, ignore_eos=rng.random() < 0.2, max_tokens=rng.choice([None, None, max(12, min_tokens)]),
            output_kind=RequestOutputKind.DELTA,
        )
        want = vllm_outcome(chunks, output, params, eos)
        seq, joined, joined_ids = drive(tokenizer, prompt, output, params)
        where = (case, params.stop, params.stop_token_ids, params.include_stop_str_in_output, min_tokens, params.ignore_eos)
        assert (seq.text, seq.finish_reason, seq.stop_reason, len(seq.output_token_ids)) == want, where
        assert joined_ids == output[: want[3]], where
        if seq.is_finished:
            assert joined == seq.text, where
        stopped_by_string += isinstance(seq.stop_reason, str)
    assert stopped_by_string > 80
