"""Prompt logprobs: the prompt tokens a step's prefill chunks predict (position p predicts p + 1),
scored on the device for the whole step at once and read on the host with the step's samples.

Every chunk of the step that asks is scored together: its rows of the hidden states are gathered a
slice of ``slice_rows`` rows at a time (a whole step at once would hold [tokens, V] float32
log-probabilities and their rank comparison: a 16k-token step of a 152k vocabulary, ~10 GB each;
a slice stays within what the GPU memory plan set aside for the sampler, ``ModelRunner.profile_run``
sets the rows), and the results go into flat tensors that the runner copies to the host with the
sampled ids (`ScoredPrompts.tensors`). Nothing here waits for the device: scoring a chunk at a time
with its results read back at once (as before) cost a few launches and three device syncs per
sequence a step, so a step of a scoring job (lm-eval's loglikelihood: prompt_logprobs and one output
token) ran its sequences one after another and the host never ran ahead of the GPU. On a GPU each
slice takes the sampled tokens' path without the table (``sampler.kernel_logprobs``: the two-pass
kernel, and for k >= 2 ``topk`` of the slice's logits in their own dtype); the CPU's, the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from tokenmill.engine.step import PromptLogprobs
from tokenmill.worker.sampler import kernel_logprobs, with_logprobs

if TYPE_CHECKING:
    from torch import nn

    from tokenmill.engine.step import ScheduledSequence, StepSequence

PROMPT_LOGPROB_ROWS = 1024  # the slice before a memory plan sets it (the CPU's, where none is made)
MIN_PROMPT_LOGPROB_ROWS = 64  # the smallest slice the plan sets, so long prompts are not scored a few rows at a time


@dataclass
class _Chunk:
    """One sequence's prompt positions scored in this step: hidden rows [row, row + count) predict
    prompt tokens first .. first + count - 1."""

    seq: "StepSequence"
    first: int
    row: int
    count: int


@dataclass
class _Scored:
    """The chunks that ask for the same number of top logprobs ``k``, scored into flat tensors (one
    entry a position, in chunk order)."""

    chunks: list[_Chunk]
    logprobs: torch.Tensor  # [positions] float32
    ranks: torch.Tensor  # [positions] int64
    top_ids: torch.Tensor | None  # [positions, k] int64 (k >= 1)
    top_logprobs: torch.Tensor | None  # [positions, k] float32


class ScoredPrompts:
    """A step's prompt logprobs: device tensors until the runner moves them to the host (`tensors`,
    `replace`), then per chunk `PromptLogprobs` once the step is done (`read`)."""

    def __init__(self, groups: list[_Scored]):
        self._groups = groups
        self._read: list[PromptLogprobs] | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for g in self._groups for t in (g.logprobs, g.ranks, g.top_ids, g.top_logprobs) if t is not None]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        """Take ``tensors`` (host copies of `tensors()`, in its order) in place of the device ones."""
        it = iter(tensors)
        for g in self._groups:
            g.logprobs, g.ranks = next(it), next(it)
            if g.top_ids is not None:
                g.top_ids, g.top_logprobs = next(it), next(it)

    def read(self) -> list[PromptLogprobs]:
        """Per chunk, its positions' logprobs, ranks and top ones as lists (the step must be done)."""
        if self._read is None:
            self._read = [part for g in self._groups for part in _split(g)]
        return self._read


def score_prompts(model: "nn.Module", scheduled: list["ScheduledSequence"], query_lens: list[int],
                  hidden: torch.Tensor, slice_rows: int,
                  to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> ScoredPrompts | None:
    """The prompt logprobs of this step's sequences that asked for them (None if none did), launched
    on the device; ``to_device`` moves a host tensor there (the runner's pinned copy on a GPU)."""
    by_k: dict[int, list[_Chunk]] = {}
    row = 0
    for item, query_len in zip(scheduled, query_lens):
        seq = item.seq
        request = seq.request
        if request.params.prompt_logprobs is None:  # nearly every row, every step: the cheapest test first
            row += query_len
            continue
        start = seq.num_computed_tokens
        end = min(start + query_len, seq.num_prompt_tokens - 1)  # the last prompt token predicts output
        if seq.index == 0 and request.needs_prompt_logprobs and start < end:
            by_k.setdefault(request.params.prompt_logprobs, []).append(_Chunk(seq, start + 1, row, end - start))
        row += query_len
    if not by_k:
        return None
    return ScoredPrompts([_score(model, chunks, k, hidden, slice_rows, to_device) for k, chunks in by_k.items()])


def _score(model: "nn.Module", chunks: list[_Chunk], k: int, hidden: torch.Tensor, slice_rows: int,
           to_device: Callable[[torch.Tensor], torch.Tensor]) -> _Scored:
    """The logprob and rank of every chunk's prompt tokens (and the top ``k``), ``slice_rows`` rows at a time."""
    rows = np.concatenate([np.arange(c.row, c.row + c.count) for c in chunks])
    targets = np.concatenate([np.asarray(c.seq.request.prompt_token_ids[c.first : c.first + c.count]) for c in chunks])
    rows_dev = to_device(torch.from_numpy(rows))
    targets_dev = to_device(torch.from_numpy(targets.astype(np.int64)))
    total, device = len(rows), hidden.device
    logprobs = torch.empty(total, dtype=torch.float32, device=device)
    ranks = torch.empty(total, dtype=torch.int64, device=device)
    top_ids = torch.empty((total, k), dtype=torch.int64, device=device) if k else None
    top_logprobs = torch.empty((total, k), dtype=torch.float32, device=device) if k else None
    contiguous = bool((np.diff(rows) == 1).all())  # one chunk, or chunks side by side: slices of hidden, no gather
    for first in range(0, total, slice_rows):
        last = min(first + slice_rows, total)
        states = hidden[rows[first] : rows[first] + last - first] if contiguous else hidden[rows_dev[first:last]]
        logits = model.compute_logits(states)
        wanted = targets_dev[first:last]
        if logits.is_cuda and logits.stride(1) == 1:  # no table (perplexity jobs ask for 0)
            scored = kernel_logprobs(logits, wanted, k)
        else:  # the sampler's own table path
            scored = with_logprobs(wanted, torch.log_softmax(logits.float(), dim=-1), k)
        logprobs[first:last] = scored.sampled_logprobs
        ranks[first:last] = scored.sampled_ranks
        if top_ids is not None and top_logprobs is not None:
            top_ids[first:last] = scored.top_ids
            top_logprobs[first:last] = scored.top_logprobs
    return _Scored(chunks, logprobs, ranks, top_ids, top_logprobs)


def _split(scored: _Scored) -> list[PromptLogprobs]:
    logprobs, ranks = scored.logprobs.tolist(), scored.ranks.tolist()
    top_ids = scored.top_ids.tolist() if scored.top_ids is not None else None
    top_logprobs = scored.top_logprobs.tolist() if scored.top_logprobs is not None else None
    parts, at = [], 0
    for c in scored.chunks:
        end = at + c.count
        parts.append(PromptLogprobs(c.seq, c.first, logprobs[at:end], ranks[at:end],
                                    top_ids[at:end] if top_ids is not None else None,
                                    top_logprobs[at:end] if top_logprobs is not None else None))
        at = end
    return parts
