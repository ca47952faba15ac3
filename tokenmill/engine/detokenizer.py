"""Incremental detokenization and stop-string matching for one sequence.

Text is produced with the `tokenizers` library's DecodeStream, primed with the prompt's last
tokens so the first generated token decodes with the right leading space, and buffering
partial UTF-8 characters until they are complete. Stop strings are searched only in the
newly produced text plus a tail long enough to catch a stop string spanning two tokens.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 8


def _context_start(backend: Any, prompt_token_ids: list[int], window: int = _PROMPT_CONTEXT_TOKENS) -> int:
    """Where the priming window starts: the last ``window`` tokens, moved back (at most
    3 tokens: a UTF-8 character has at most 3 continuation bytes) past byte-fallback tokens of
    continuation bytes (``<0x80>``..``<0xBF>``). A window starting inside a character made the
    ByteFallback decoder turn the window's whole run of byte tokens into U+FFFD, and the first
    output token then carried that garbage in (a prompt ending in emoji or CJK byte tokens)."""
    start = max(0, len(prompt_token_ids) - window)
    lowest = max(0, start - 3)
    while start > lowest and _is_continuation_byte(backend.id_to_token(prompt_token_ids[start])):
        start -= 1
    return start


def _is_continuation_byte(token: str | None) -> bool:
    # Byte-fallback pieces are spelled "<0xNN>"; continuation bytes are 0x80-0xBF: "<0x8?>".."<0xB?>".
    return token is not None and len(token) == 6 and token.startswith("<0x") and token[3] in "89AB" and token[5] == ">"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
        spaces_between_special_tokens: bool = True,
    ):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        # Primed a token at a time, not seeded with DecodeStream(ids=...): a seed whose text ends
        # inside a character (a token-id prompt may end mid UTF-8) made the first generated token
        # bring the whole seed's text along. Primed, a dangling byte is held back as in any stream.
        self._skip_special_tokens = skip_special_tokens
        window = _PROMPT_CONTEXT_TOKENS
        start = _context_start(self._backend, prompt_token_ids, window)
        while True:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            decoded = False
            for token_id in prompt_token_ids[start:]:
                try:
                    decoded |= bool(self._stream.step(self._backend, token_id))
                except Exception as exc:  # invalid bytes in the prompt: see _restart
                    decoded |= bool(self._restart(exc, token_id))
            # A window that decoded to nothing (special tokens skipped) leaves the first output token
            # without the text before it, and a Metaspace decoder then strips its leading space:
            # widen it (vLLM primes with the whole prompt).
            if decoded or start == 0:
                break
            window *= 9
            start = _context_start(self._backend, prompt_token_ids, window)
        # vLLM 0.26's rule for skip_special_tokens=False, spaces_between_special_tokens=False: an added
        # token right after an added token is its raw content (the decoder may give it a space: a
        # normalized added token of a Llama-2-layout tokenizer decodes as " foo bar").
        self._added: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()} or None
            self._last_added = False
        self.text = ""
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Appends the token's text; returns the stop string it completed, if any (text is then cut).

        ``check_stop`` is False while the sequence is below min_tokens: stop strings don't count yet.
        """
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as exc:
            chunk = self._restart(exc, token_id)
        if self._added is not None:
            content = self._added.get(token_id)
            if content is not None and self._last_added:
                chunk = content
            self._last_added = content is not None
        if not chunk:
            return None
        old_len = len(self.text)
        self.text += chunk
        if not self._stop or not check_stop:
            return None
        return self._cut_at_stop(old_len)

    def _restart(self, exc: Exception, token_id: int) -> str | None:
        """A fresh stream from ``token_id`` on, as vLLM 0.26 recovers (its issue 17448). A byte-fallback
        decoder (SentencePiece vocabularies: ``<0xE2>`` tokens) turns a whole run of byte tokens into
        U+FFFD once one byte in it is invalid, so text already emitted (a byte that decoded as "H")
        can change afterwards, and DecodeStream raises "Invalid prefix"; that must not end the engine."""
        if not str(exc).startswith("Invalid prefix encountered"):
            raise exc
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._backend, token_id)

    @property
    def settled_text(self) -> str:
        """The text no later stop string can cut: all of it but the last len(longest stop) - 1
        characters, which may be the start of a stop string still arriving. Streams show this."""
        if not self._stop:
            return self.text
        return self.text[: max(0, len(self.text) - self._max_stop_len + 1)]

    def _cut_at_stop(self, old_len: int) -> str | None:
        """Cut at the stop string that starts earliest among those ending in the new chunk (the text
        past ``old_len``). Each stop string is searched from its own length back (vLLM's check_stop_strings), not the
        longest one's: text below min_tokens was never checked, and a short stop string lying wholly
        in it (before the new chunk) must not count, as in vLLM."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop
