"""Text from SentencePiece-style tokenizers (Llama-2, TinyLlama, Mistral, Phi-3: "▁" spaces, byte
fallback, a Strip decoder), checked against the tokenizer's own decode and vLLM 0.26's rules: the
completion's text is what its tokens add to the prompt's text, over random prompts and outputs with
byte-fallback pieces and added tokens; a prompt ending in byte tokens; invalid byte runs; stop
strings across tokens; and, end to end, DELTA streams and the logprobs' decoded tokens."""

from __future__ import annotations

import random
from typing import Any

import pytest

from support.spm_tokenizers import build_spm_tokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer

CHARS = "é🙂東京語ü€😀"  # emoji and some CJK are byte-fallback pieces in this vocabulary


@pytest.fixture(scope="module", params=["legacy", "metaspace", "transformers5"])
def tokenizer(request, tmp_path_factory) -> Any:
    if request.param != "transformers5":
        return build_spm_tokenizer(request.param)
    # What users of transformers 5 get: a Llama-2-layout tokenizer.json loaded as LlamaTokenizer is
    # rebuilt with a Metaspace pre-tokenizer and no normalizer.
    import json

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("spm_tok")
    build_spm_tokenizer("legacy").save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    loaded = AutoTokenizer.from_pretrained(folder)
    assert type(loaded.backend_tokenizer.pre_tokenizer).__name__ == "Metaspace"
    return loaded


def random_ids(tokenizer: Any, rng: random.Random, count: int) -> list[int]:
    """Valid text as a model writes it: any non-byte token (added and special ones too), or a whole
    character as its byte-fallback pieces."""
    plain = [i for t, i in tokenizer.get_vocab().items() if not t.startswith("<0x")]
    ids: list[int] = []
    while len(ids) < count:
        if rng.random() < 0.2:
            ids += tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in rng.choice(CHARS).encode()])
        else:
            ids.append(rng.choice(plain))
    return ids


def stream(tokenizer: Any, prompt: list[int], output: list[int], skip: bool, stop: list[str] | None = None,
           include_stop: bool = False) -> tuple[str, str | None]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip, stop=stop or [],
                                   include_stop_str_in_output=include_stop)
    for token in output:
        found = detok.add_token(token)
        if found is not None:
            return detok.text, found
    return detok.text, None


def expected_text(tokenizer: Any, prompt: list[int], output: list[int], skip: bool) -> str:
    """decode(prompt + output) past decode(prompt), the output cut after its last complete character
    (a stream holds back an unfinished one, as vLLM's does)."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip)

    k = len(output)
    while k and decode(prompt + output[:k]).endswith("\ufffd"):
        k -= 1
    if not k:
        return ""
    complete = list(prompt)
    while complete and decode(complete).endswith("\ufffd"):
        complete.pop()
    return decode(prompt + output[:k])[len(decode(complete)):]


def test_completion_text_is_what_the_tokens_add_to_the_prompt(tokenizer):
    rng = random.Random(0)
    for _ in range(150):
        ids = random_ids(tokenizer, rng, 24)
        cut = rng.randrange(0, 14)  # prompts cut anywhere: inside characters, after added tokens, empty
        prompt, output = ids[:cut], ids[cut:rng.randrange(cut + 1, len(ids) + 1)]
        for skip in (True, False):
            got, _ = stream(tokenizer, prompt, output, skip)
            assert got == expected_text(tokenizer, prompt, output, skip), (tokenizer.convert_ids_to_tokens(prompt + output), skip)


def test_first_output_token_keeps_its_space_and_characters_join_across_tokens(tokenizer):
    prompt = tokenizer.encode("Hello")
    world = tokenizer.encode("Hello world 🙂", add_special_tokens=False)[len(prompt) - 1:]
    assert stream(tokenizer, prompt, world, True)[0] == " world 🙂"  # the Strip decoder's space is kept
    assert stream(tokenizer, [tokenizer.bos_token_id], world, True)[0] == "world 🙂"  # as decode strips it


def test_a_prompt_ending_in_skipped_special_tokens_keeps_the_first_tokens_space(tokenizer):
    """The priming window (the prompt's last tokens) all special and skipped: the window widens to
    text, as vLLM primes with the whole prompt, so " world" keeps its space."""
    prompt = tokenizer.encode("Hello") + [tokenizer.eos_token_id] * 12
    world = tokenizer.encode("Hello world", add_special_tokens=False)[len(tokenizer.encode("Hello")) - 1:]
    assert stream(tokenizer, prompt, world, True)[0] == expected_text(tokenizer, prompt, world, True) == " world"
    assert stream(tokenizer, [tokenizer.eos_token_id] * 12, world, True)[0] == "world"  # no text at all before it


def test_a_prompt_ending_in_byte_pieces_does_not_leak_into_the_output(tokenizer):
    # 12 byte-fallback pieces (é € 😀 京): the last 8 start inside "€". A window starting there made the
    # ByteFallback decoder turn the whole run into U+FFFD, which the first output token carried in.
    prompt = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in "é€😀京".encode()])
    if tokenizer.decode(prompt[-1:]) != "\ufffd":  # the vocabulary spells them as bytes (all layouts here do)
        pytest.skip("these characters are whole tokens in this vocabulary")
    output = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in "🙂".encode()]) + tokenizer.encode("the", add_special_tokens=False)
    for skip in (True, False):
        want = expected_text(tokenizer, prompt, output, skip)
        assert stream(tokenizer, prompt, output, skip)[0] == want and want.startswith("🙂") and "\ufffd" not in want


def test_an_invalid_byte_run_restarts_the_stream_as_vllm_does(tokenizer):
    # <0x48> ("H") then a stray continuation byte: once a later token ends the run, ByteFallback
    # decodes the whole run as U+FFFD, so "H", already emitted, changes: DecodeStream raises
    # "Invalid prefix". vLLM 0.26 (detokenizer.py, its issue 17448) starts a fresh stream at that token.
    h, stray = tokenizer.convert_tokens_to_ids(["<0x48>", "<0x9B>"])
    x = tokenizer.encode("x", add_special_tokens=False)
    assert tokenizer.decode([h, stray] + x).startswith("\ufffd\ufffd")  # "H" is gone from the whole decode
    assert stream(tokenizer, [], [h, stray] + x, True)[0] == "H" + tokenizer.decode(x)  # x decoded afresh
    # In the prompt too: a request must not fail while its detokenizer is primed.
    assert stream(tokenizer, [h, stray] + x, x, True)[0] == tokenizer.decode(x + x)[len(tokenizer.decode(x)):]


def vllm_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """vLLM 0.26's check_stop_strings over the whole text (where every stop first appears)."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    at, stop = min(hits)
    return (text[: at + len(stop)] if include else text[:at]), stop


def test_stop_strings_found_across_tokens_and_cut_as_vllm_cuts(tokenizer):
    rng = random.Random(1)
    found = 0
    for _ in range(120):
        ids = random_ids(tokenizer, rng, 20)
        prompt, output = ids[:4], ids[4:]
        text = expected_text(tokenizer, prompt, output, True)
        if len(text) < 4:
            continue
        start = rng.randrange(0, len(text) - 3)
        stops = [text[start:start + rng.randrange(2, 4)], "zzq"]  # a stop string from the text, one absent
        for include in (False, True):
            want = vllm_cut(text, stops, include)
            # The stop string may end inside an unfinished character's pieces: compare what was emitted.
            assert stream(tokenizer, prompt, output, True, stops, include) == want, (stops, include, text)
        found += 1
    assert found > 50


def test_spaces_between_special_tokens_false_gives_an_added_token_after_an_added_one_raw(tokenizer):
    """vLLM 0.26's fast detokenizer, skip_special_tokens=False and spaces_between_special_tokens=False:
    an added token right after an added token is its raw content. The legacy layout decodes its
    normalized added token "foo bar" as " foo bar" there; everything else is the decode's text."""
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    rng = random.Random(2)
    for _ in range(60):
        ids = random_ids(tokenizer, rng, 16) + rng.sample(sorted(added), 3)
        rng.shuffle(ids)
        prompt, output = ids[:4], ids[4:]
        reference = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False, stop=[], include_stop_str_in_output=False)
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False, stop=[], include_stop_str_in_output=False,
                                       spaces_between_special_tokens=False)
        want, last_added = "", False  # vLLM's flag starts False: the prompt's last token does not count
        for token in output:
            before = len(reference.text)
            reference.add_token(token)
            detok.add_token(token)
            want += added[token] if token in added and last_added else reference.text[before:]
            last_added = token in added
        assert detok.text == want
    with_spaces = stream(tokenizer, [], [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("foo bar")], False)[0]
    assert with_spaces in ("</s> foo bar", "</s>foo bar")  # legacy layout: the decoder's space
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, stop=[], include_stop_str_in_output=False,
                                   spaces_between_special_tokens=False)
    for token in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("foo bar")):
        detok.add_token(token)
    assert detok.text == "</s>foo bar"


def test_logprob_tokens_decoded_alone_as_vllm_reports_them(tokenizer):
    """vLLM 0.26 (convert_ids_list_to_tokens) decodes each logprob token alone and, for a Metaspace
    pre-tokenizer (Mistral v0.3; Llama-2 / TinyLlama / Mistral files as transformers 5 loads them),
    puts back the leading spaces the Strip decoder took: "▁world" is " world", not "world"."""
    from tokenmill.engine.output_processor import OutputProcessor

    metaspace = type(tokenizer.backend_tokenizer.pre_tokenizer).__name__ == "Metaspace"
    processor = OutputProcessor(tokenizer)
    for token_id in range(len(tokenizer)):
        piece, alone = tokenizer.convert_ids_to_tokens(token_id), tokenizer.decode([token_id])
        markers = len(piece) - len(piece.lstrip("\u2581"))
        want = " " * max(0, markers - (len(alone) - len(alone.lstrip(" ")))) + alone if metaspace else alone
        assert processor.decoded_alone(token_id) == want, piece
    world = tokenizer.convert_tokens_to_ids("\u2581the")
    assert processor.decoded_alone(world) == (" the" if metaspace else "the")
