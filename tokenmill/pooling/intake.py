"""A pooling call's intake: every prompt checked before the call's first step, then the requests
handed to the engine in input order as the call's feed reaches them.

vLLM's LLM processes every prompt of a call before its engine runs, so one bad prompt refuses the
call with nothing computed. tokenmill feeds a call's requests to the engine a few steps ahead of it
(docs/perf.md 100), so it checks them all first: params, prompt forms, token ids' types and range,
lengths, token types. A text needs its token ids for the length check, and tokenizing every text
before the first step would put all of the tokenizer's time in front of the device: on a byte-level
BPE such as Qwen's that is about as long as the device's own work (docs/perf.md, P6 texts). So a text
whose token count a bound proves within max_model_len, and whose ids cannot leave the vocabulary, is
tokenized only when the feed reaches it (`CallIntake.next_request`); every other text is tokenized
in the check, its ids kept for its request. Texts go through the tokenizer's batch path
``TOKENIZE_CHUNK`` at a time either way, unless their request cuts them (the tokenizer then cuts
each text itself, keeping its special tokens: `PoolingEngine._tokenize`).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tokenmill.inputs import TOKENIZE_CHUNK, tokenize_prompts
from tokenmill.pooling.request import PoolingRequest

if TYPE_CHECKING:
    from tokenmill.inputs import PromptType
    from tokenmill.pooling.engine import PoolingEngine
    from tokenmill.pooling_params import PoolingParams

# Pre-tokenizers that split a byte-level BPE's input without adding to it (Split only if it keeps what it
# matches), and those that split a WordPiece's input (dropping whitespace at most).
_SPLITTERS = {"Split", "ByteLevel", "Digits", "Punctuation"}
_WORD_SPLITTERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits"}


class CallIntake:
    """The requests of one pooling call, every prompt checked in the constructor (a ValueError
    names the first bad one and leaves the engine untouched), then given out in order."""

    def __init__(self, engine: "PoolingEngine", request_ids: Sequence[str], prompts: Sequence["PromptType"],
                 params: Sequence["PoolingParams"]):
        self.engine = engine
        self._ids = request_ids
        self._params: list["PoolingParams"] = []  # resolved, one per prompt (shared objects)
        # A request made, or a text the bound cleared, tokenized when the feed reaches it.
        self._items: list[PoolingRequest | str | None] = []
        self._next = 0
        bound = engine.text_bound()
        resolved: dict[int, "PoolingParams"] = {}  # a call's requests share one or a few params objects
        for start in range(0, len(prompts), TOKENIZE_CHUNK):
            part = list(prompts[start : start + TOKENIZE_CHUNK])
            for index, given in enumerate(params[start : start + TOKENIZE_CHUNK], start):
                made = resolved.get(id(given))
                if made is None:
                    made = resolved[id(given)] = engine.resolve(given, index)
                self._params.append(made)
            cleared, now = set(), []  # texts left for the feed; texts tokenized here (their length needs their ids)
            for k, prompt in enumerate(part):
                text = _plain_text(prompt)
                if text is None or self._params[start + k].truncate_prompt_tokens is not None:
                    continue
                if bound is not None and 0 < bound(text) <= engine.config.max_model_len:
                    cleared.add(k)
                    part[k] = text
                else:
                    now.append(k)
            if now and engine.tokenizer is not None:
                for k, prompt in zip(now, tokenize_prompts([part[k] for k in now], engine.tokenizer, {})):
                    part[k] = prompt
            for k, prompt in enumerate(part):
                index = start + k
                if request_ids[index] in engine.requests:
                    raise ValueError(f"request_id {request_ids[index]!r} is already in use")
                self._items.append(prompt if k in cleared else
                                   engine.make_request(request_ids[index], prompt, self._params[index], index))

    def next_request(self) -> PoolingRequest | None:
        """The next request in input order (None after the last); the intake lets go of it."""
        if self._next == len(self._items):
            return None
        if isinstance(self._items[self._next], str):
            self._tokenize_cleared(self._next)
        request = self._items[self._next]
        assert isinstance(request, PoolingRequest)
        self._items[self._next] = None
        self._next += 1
        return request

    def _tokenize_cleared(self, start: int) -> None:
        """The cleared texts among the next ``TOKENIZE_CHUNK`` prompts, tokenized in one call and made
        requests. Their checks pass: the bound proved each one's length and the tokenizer's ids
        are all in the vocabulary."""
        places = [i for i in range(start, min(start + TOKENIZE_CHUNK, len(self._items))) if isinstance(self._items[i], str)]
        prompts = tokenize_prompts([self._items[i] for i in places], self.engine.tokenizer, {})
        for i, prompt in zip(places, prompts):
            self._items[i] = self.engine.make_request(self._ids[i], prompt, self._params[i], i)


def _plain_text(prompt: Any) -> str | None:
    """The text of a prompt that is nothing but text ("text" or {"prompt": "text"}), else None."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and len(prompt) == 1 and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def token_bound(tokenizer: Any, vocab_size: int) -> Callable[[str], int] | None:
    """A text -> an upper bound on its token count (special tokens included), without tokenizing it,
    for tokenizers that make one provable and whose ids all lie in the model's vocabulary; None
    for the others (their texts are tokenized in the check). A text the bound cannot judge gets
    ``sys.maxsize``. Working it out reads the whole vocabulary (0.1-0.25 s for Qwen's on the dev
    CPU): `PoolingEngine.text_bound` does it once per tokenizer.

    Provable here: a byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) whose pre-tokenizers only split
    and whose normaliser is none or NFC: each of its tokens covers at least one byte of the
    normalised text, and NFC leaves ASCII as it is and makes UTF-8 text at most 3x longer (Unicode's
    normalisation FAQ). And BERT's WordPiece on ASCII text: BERT's normaliser only drops control
    characters and lowercases there, its pre-tokenizer only splits, and each piece (or [UNK] for
    a whole word) covers at least one character. Either way the post-processor adds the same
    special tokens to every text, as many as it adds to an empty one.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or max(backend.get_vocab(with_added_tokens=True).values(), default=0) >= vocab_size:
        return None
    model = type(backend.model).__name__
    normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    parts = pre.get("pretokenizers", [pre])
    specials = len(tokenizer("")["input_ids"])
    if model == "BPE":
        if normalizer not in (None, {"type": "NFC"}) or not any(
                p.get("type") == "ByteLevel" and not p.get("add_prefix_space") for p in parts) or not all(
                p.get("type") in _SPLITTERS and p.get("behavior") != "Removed" for p in parts):
            return None
        per_byte = 1 if normalizer is None else 3

        def byte_level(text: str) -> int:
            return len(text) + specials if text.isascii() else per_byte * len(text.encode("utf-8")) + specials

        return byte_level
    # A WordPiece text of nothing but whitespace has no tokens of its own: only its special tokens keep it from being empty.
    if model == "WordPiece" and specials and (normalizer is None or normalizer["type"] == "BertNormalizer") and all(
            p.get("type") in _WORD_SPLITTERS for p in parts):

        def word_piece(text: str) -> int:
            return len(text) + specials if text.isascii() else sys.maxsize

        return word_piece
    return None
