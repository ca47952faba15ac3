"""Incremental detokenization and stop-string matching for one sequence.

Text is produced with the `tokenizers` library's DecodeStream, primed with the prompt's last
tokens so the first generated token decodes with the right leading space, and buffering
partial UTF-8 characters until they are complete. Stop strings are searched only in the
newly produced text plus a tail long enough to catch a stop string spanning two tokens.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
    ):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        # Primed a token at a time, not seeded with DecodeStream(ids=...): a seed whose text ends
        # inside a character (a token-id prompt may end mid UTF-8) made the first generated token
        # bring the whole seed's text along. Primed, a dangling byte is held back as in any stream.
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]:
            self._stream.step(self._backend, token_id)
        self.text = ""
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Appends the token's text; returns the stop string it completed, if any (text is then cut).

        ``check_stop`` is False while the sequence is below min_tokens: stop strings don't count yet.
        """
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return None
        searched_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += chunk
        if not self._stop or not check_stop:
            return None
        return self._cut_at_stop(searched_from)

    @property
    def settled_text(self) -> str:
        """The text no later stop string can cut: all of it but the last len(longest stop) - 1
        characters, which may be the start of a stop string still arriving. Streams show this."""
        if not self._stop:
            return self.text
        return self.text[: max(0, len(self.text) - self._max_stop_len + 1)]

    def _cut_at_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop
