"""The sampled tokens' raw logprobs and ranks (and each row's top-1) in two passes over the logits.

In torch a step that asks for logprobs makes the whole [rows, V] table: a float32 copy of the
logits, ``log_softmax``, then for the rank a [rows, V] comparison, summed through an int64 copy
(~40 bytes an entry moved: ~6 GB a step at 1,024 rows of a 152k vocabulary). When a step wants
at most the top-1 (``logprobs`` 0 or 1: RL rollouts, most evaluations), one program a row reads
the row's logits twice instead: first the row's maximum (and its first position) and its sum of
exp(x - max), carried per lane and merged at the end; then it counts the entries whose logprob,
made the same way as the sampled token's, exceeds it. A logprob is (x - max) - log(sum), the form
``log_softmax`` uses, so the values agree with torch's to float32 rounding and the ranks are those
of the logprobs reported (16-bit logits' distinct values stay distinct after the shift).
``reference.token_logprobs_ref`` is the plain-torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher

BLOCK = 8192  # 16 values a thread at 16 warps: few serial loads a row (latency), no spills


@triton.jit
def _token_logprobs_kernel(
    logits_ptr, stride_row, tokens_ptr, logprob_ptr, rank_ptr, top_id_ptr, top_logprob_ptr, vocab,
    BLOCK: tl.constexpr, TOP: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    # Pass 1, per lane: the largest logit, where it first is, and sum exp(x - largest), rescaled
    # whenever the largest grows (lanes past the vocabulary stay at -inf and add nothing).
    high = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_high = tl.maximum(high, x)
        seen = new_high > float("-inf")
        total = tl.where(seen, total * tl.exp(high - new_high) + tl.exp(x - new_high), 0.0)
        where = tl.where(x > high, cols, where)
        high = new_high
    top = tl.max(high, axis=0)
    log_sum = tl.log(tl.sum(tl.where(high > float("-inf"), total * tl.exp(high - top), 0.0), axis=0))
    token = tl.load(tokens_ptr + row)
    chosen = (tl.load(base + token).to(tl.float32) - top) - log_sum
    # Pass 2: how many entries have a larger logprob than the sampled token's.
    larger = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        larger += (((x - top) - log_sum) > chosen).to(tl.int32)
    tl.store(logprob_ptr + row, chosen)
    tl.store(rank_ptr + row, tl.sum(larger, axis=0).to(tl.int64) + 1)
    if TOP:
        tl.store(top_id_ptr + row, tl.min(tl.where(high == top, where, vocab), axis=0).to(tl.int64))
        tl.store(top_logprob_ptr + row, (top - top) - log_sum)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: bool, compile_only: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """For [N, V] logits (contiguous rows, any float dtype) and the N sampled ids: each row's
    logprob of its token (float32), its rank (1 + the entries with a larger logprob; int64) and, with
    ``top``, the row's top-1 id (the first of equal largest ones) and logprob as [N, 1] tensors.
    ``compile_only``: compile the launch and run nothing (``precompile.py``)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the logits' rows must be contiguous"
    device = logits.device
    logprob = torch.empty(rows, dtype=torch.float32, device=device)
    rank = torch.empty(rows, dtype=torch.int64, device=device)
    top_id = torch.empty((rows, 1), dtype=torch.int64, device=device) if top else rank
    top_logprob = torch.empty((rows, 1), dtype=torch.float32, device=device) if top else logprob
    if rows:
        launcher(_token_logprobs_kernel, (rows,), compile_only)(
            logits, logits.stride(0), token_ids, logprob, rank, top_id, top_logprob, vocab,
            BLOCK=BLOCK, TOP=top, num_warps=16,
        )
    return logprob, rank, (top_id if top else None), (top_logprob if top else None)
