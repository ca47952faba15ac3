"""Per-position log-probabilities as the user gets them: `Logprob`, and the two containers of a
request's positions (vLLM's `vllm.logprobs` names).

Each position is a dict ``token id -> Logprob``: the sampled (or prompt) token first, then its
alternatives. A request's positions are kept either as a list of such dicts (the default) or, with
``SamplingParams(flat_logprobs=True)``, as one `FlatLogprobs`: a few flat lists for the whole
request. A long output with many alternatives per position then holds a constant number of Python
objects instead of a dict and a `Logprob` per entry, which the garbage collector would otherwise
walk again and again for as long as the outputs live. `FlatLogprobs` reads like the list of dicts
(len, indexing, slicing, iteration, equality), building each dict only when it is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import Any, overload


@dataclass(slots=True)
class Logprob:
    """Log probability of one token at one position, its rank in the distribution, and its text.
    Slotted: a scoring job holds one or two a prompt position (56 bytes each, not 152)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass(eq=False)
class FlatLogprobs(MutableSequence):
    """A request's per-position logprobs in flat lists: position ``i`` holds the entries
    ``start_indices[i] : end_indices[i]`` of ``token_ids``, ``logprobs``, ``ranks`` and
    ``decoded_tokens`` (vLLM's field names, so code reading them directly works unchanged).

    A position is one dict when read; a position without logprobs (the first prompt token, which
    nothing predicts: None in the list form) reads as ``{}``, as in vLLM. Positions are only ever
    appended: setting, deleting or inserting one is a TypeError.
    """

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append_position(self, token_ids: Iterable[int], logprobs: Iterable[float], ranks: Iterable[int | None],
                        decoded_tokens: Iterable[str | None]) -> None:
        """Append one position from parallel sequences, without building its dict. A token id
        given twice keeps its first place and its last values, as a dict built from the same
        pairs would, so a position reads back the same in both forms."""
        start = len(self.token_ids)
        self.start_indices.append(start)
        placed: dict[int, int] = {}
        for token_id, logprob, rank, text in zip(token_ids, logprobs, ranks, decoded_tokens):
            at = placed.get(token_id)
            if at is None:
                placed[token_id] = len(self.token_ids)
                self.token_ids.append(token_id)
                self.logprobs.append(logprob)
                self.ranks.append(rank)
                self.decoded_tokens.append(text)
            else:
                self.logprobs[at], self.ranks[at], self.decoded_tokens[at] = logprob, rank, text
        self.end_indices.append(len(self.token_ids))

    def extend_ranked(self, tokens: list[int], logprobs: list[float], ranks: list[int],
                      top_ids: list[list[int]] | None, top_logprobs: list[list[float]] | None) -> None:
        """Append positions whose entries are the token (its logprob and rank), then its top ones
        ranked 1, 2, ... (a top one that is the token itself left out, so the token keeps its rank),
        without decoded tokens: what `append_position` gives for each, in one pass (a scoring job
        appends every prompt position; the top ids of a position are distinct)."""
        ids, values, ranked, starts, ends = self.token_ids, self.logprobs, self.ranks, self.start_indices, self.end_indices
        for i, token in enumerate(tokens):
            starts.append(len(ids))
            ids.append(token)
            values.append(logprobs[i])
            ranked.append(ranks[i])
            if top_ids is not None and top_logprobs is not None:
                for rank, (top, value) in enumerate(zip(top_ids[i], top_logprobs[i]), start=1):
                    if top != token:
                        ids.append(top)
                        values.append(value)
                        ranked.append(rank)
            ends.append(len(ids))
        self.decoded_tokens.extend([None] * (len(ids) - len(self.decoded_tokens)))

    def append(self, position: LogprobsOnePosition | None) -> None:
        """Append one position given as a dict (None: a position without logprobs)."""
        entries = (position or {}).items()
        self.append_position((t for t, _ in entries), (lp.logprob for _, lp in entries),
                             (lp.rank for _, lp in entries), (lp.decoded_token for _, lp in entries))

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> "FlatLogprobs": ...

    def __getitem__(self, index: int | slice) -> "LogprobsOnePosition | FlatLogprobs":
        if isinstance(index, slice):
            return self._positions(range(len(self))[index])
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"FlatLogprobs indices must be integers or slices, not {type(index).__name__}")
        start, end = self.start_indices[index], self.end_indices[index]  # IndexError past the end, like a list
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i]) for i in range(start, end)}

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of per-position dicts with the same contents (a flat one or the
        list form); a position without logprobs equals both None and {}."""
        if not isinstance(other, (FlatLogprobs, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(mine == (theirs or {}) for mine, theirs in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  (mutable: it grows as the request runs)

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("FlatLogprobs positions cannot be replaced; append new ones")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("FlatLogprobs positions cannot be deleted")

    def insert(self, index: int, value: Any) -> None:
        raise TypeError("FlatLogprobs positions can only be appended")

    def _positions(self, positions: range) -> "FlatLogprobs":
        """A new container holding copies of ``positions`` (a contiguous run costs one slice per list)."""
        if positions.step == 1 and len(positions) > 0:
            first = self.start_indices[positions[0]]
            last = self.end_indices[positions[-1]]
            return FlatLogprobs(
                [s - first for s in self.start_indices[positions.start : positions.stop]],
                [e - first for e in self.end_indices[positions.start : positions.stop]],
                self.token_ids[first:last], self.logprobs[first:last], self.ranks[first:last],
                self.decoded_tokens[first:last],
            )
        picked = FlatLogprobs()
        for p in positions:
            span = slice(self.start_indices[p], self.end_indices[p])
            picked.append_position(self.token_ids[span], self.logprobs[span], self.ranks[span], self.decoded_tokens[span])
        return picked


# A request's logprobs: one entry per generated position, or per prompt position (the first None).
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]


def create_sample_logprobs(flat: bool) -> SampleLogprobs:
    """An empty container for a sequence's sample logprobs."""
    return FlatLogprobs() if flat else []


def create_prompt_logprobs(flat: bool) -> PromptLogprobs:
    """A request's prompt logprobs, holding the first position already: nothing predicts it."""
    container: PromptLogprobs = FlatLogprobs() if flat else []
    container.append(None)
    return container


def append_position(container: SampleLogprobs | PromptLogprobs, token_ids: list[int], logprobs: list[float],
                    ranks: list[int | None], decoded_tokens: list[str | None]) -> None:
    """Append one position to either form. A token id given twice keeps its first place and its
    last values (what a dict built from the pairs holds)."""
    if isinstance(container, FlatLogprobs):
        container.append_position(token_ids, logprobs, ranks, decoded_tokens)
    else:
        container.append({t: Logprob(lp, r, d) for t, lp, r, d in zip(token_ids, logprobs, ranks, decoded_tokens)})
