"""Prompt logprobs: the prompt tokens a step's prefill chunks predict (position p predicts p + 1),
scored from the chunk's hidden states a slice of rows at a time.

A whole chunk at once would hold [tokens, V] float32 log-probabilities and their rank comparison
(a 16k-token chunk of a 152k vocabulary: ~10 GB each); a slice of ``slice_rows`` rows stays within
what the GPU memory plan set aside for the sampler (``ModelRunner.profile_run`` sets the rows). On
a GPU the sampled tokens' path without the table scores each slice (``sampler.kernel_logprobs``:
the two-pass kernel, and for k >= 2 ``topk`` of the slice's logits in their own dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.engine.step import PromptLogprobs
from tokenmill.worker.sampler import kernel_logprobs, with_logprobs

if TYPE_CHECKING:
    from torch import nn

    from tokenmill.engine.step import ScheduledSequence, StepSequence

PROMPT_LOGPROB_ROWS = 1024  # the slice before a memory plan sets it (the CPU's, where none is made)
MIN_PROMPT_LOGPROB_ROWS = 64  # the smallest slice the plan sets, so long prompts are not scored a few rows at a time


def score_prompts(model: "nn.Module", scheduled: list["ScheduledSequence"], query_lens: list[int],
                  hidden: torch.Tensor, slice_rows: int) -> list[PromptLogprobs] | None:
    """The prompt logprobs of this step's sequences that asked for them (None if none did)."""
    found = []
    offset = 0
    for item, query_len in zip(scheduled, query_lens):
        seq = item.seq
        request = seq.request
        if request.params.prompt_logprobs is None:  # nearly every row, every step: the cheapest test first
            offset += query_len
            continue
        start = seq.num_computed_tokens
        end = min(start + query_len, seq.num_prompt_tokens - 1)  # the last prompt token predicts output
        if seq.index == 0 and request.needs_prompt_logprobs and start < end:
            found.append(_score_prompt(model, seq, hidden[offset : offset + end - start], start, slice_rows))
        offset += query_len
    return found or None


def _score_prompt(model: "nn.Module", seq: "StepSequence", hidden: torch.Tensor, start: int,
                  slice_rows: int) -> PromptLogprobs:
    """The logprob and rank of prompt tokens start + 1 ... (and the top ones), ``slice_rows`` rows at a time."""
    request = seq.request
    k = request.params.prompt_logprobs
    targets = request.prompt_token_ids[start + 1 : start + 1 + hidden.shape[0]]
    chosen: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    for first in range(0, hidden.shape[0], slice_rows):
        rows = hidden[first : first + slice_rows]
        logits = model.compute_logits(rows)
        wanted = torch.tensor(targets[first : first + rows.shape[0]], device=logits.device)
        if logits.is_cuda and logits.stride(1) == 1:  # no table (perplexity jobs ask for 0)
            scored = kernel_logprobs(logits, wanted, k)
        else:  # the sampler's own table path
            scored = with_logprobs(wanted, torch.log_softmax(logits.float(), dim=-1), k)
        chosen += scored.sampled_logprobs.tolist()
        ranks += scored.sampled_ranks.tolist()
        if k:
            top_ids += scored.top_ids.tolist()
            top_logprobs += scored.top_logprobs.tolist()
    return PromptLogprobs(seq, start + 1, chosen, ranks, top_ids if k else None, top_logprobs if k else None)
