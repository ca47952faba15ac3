"""The sampled tokens' raw logprobs and ranks (and each row's top-1) in two passes over the logits.

In torch a step that asks for logprobs makes the whole [rows, V] table: a float32 copy of the
logits, ``log_softmax``, then for the rank a [rows, V] comparison, summed through an int64 copy
(~40 bytes an entry moved: ~6 GB a step at 1,024 rows of a 152k vocabulary). Instead one program
a row reads the row's logits twice: first the row's maximum (and its first position) and its sum
of exp(x - max), carried per lane and merged at the end; then it counts the entries whose logprob,
made the same way as the sampled token's, exceeds it. A logprob is (x - max) - log(sum), the form
``log_softmax`` uses, so the values agree with torch's to float32 rounding and the ranks are those
of the logprobs reported (16-bit logits' distinct values stay distinct after the shift).

Each row's max and log(sum) (its log-normaliser, in the two pieces it is subtracted as) come back
too, so that a caller can turn any logit of the row into its logprob exactly as the kernel does:
the top k >= 2 (``sampler.kernel_logprobs``) are ``torch.topk`` of the logits in their own dtype,
made logprobs that way, with no float32 table. ``reference.token_logprobs_ref`` is the plain-torch
twin.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher

BLOCK = 8192  # 16 values a thread at 16 warps: few serial loads a row (latency), no spills


@triton.jit
def _token_logprobs_kernel(
    logits_ptr, stride_row, tokens_ptr, logprob_ptr, rank_ptr, top_id_ptr, top_logprob_ptr, row_max_ptr,
    log_sum_ptr, vocab, BLOCK: tl.constexpr, TOP: tl.constexpr,
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
    tl.store(row_max_ptr + row, top)
    tl.store(log_sum_ptr + row, log_sum)
    if TOP:
        tl.store(top_id_ptr + row, tl.min(tl.where(high == top, where, vocab), axis=0).to(tl.int64))
        tl.store(top_logprob_ptr + row, (top - top) - log_sum)


class TokenLogprobs(NamedTuple):
    """What ``token_logprobs`` returns (``reference.token_logprobs_ref`` returns the same, in order)."""

    logprob: torch.Tensor  # [N] float32: each row's logprob of its token
    rank: torch.Tensor  # [N] int64: 1 + the entries with a larger logprob
    top_id: torch.Tensor | None  # [N, 1] int64 with ``top``: the first of equal largest logits
    top_logprob: torch.Tensor | None  # [N, 1] float32 with ``top``
    row_max: torch.Tensor  # [N] float32: the row's largest logit
    log_sum: torch.Tensor  # [N] float32: log(sum exp(x - row_max)); a logprob is (x - row_max) - log_sum


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: bool, compile_only: bool = False
                   ) -> TokenLogprobs:
    """For [N, V] logits (contiguous rows, any float dtype) and the N ids to score: see
    ``TokenLogprobs`` (top-1 only with ``top``). ``compile_only``: compile the launch and run
    nothing (``precompile.py``)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the logits' rows must be contiguous"
    device = logits.device
    logprob = torch.empty(rows, dtype=torch.float32, device=device)
    rank = torch.empty(rows, dtype=torch.int64, device=device)
    row_max = torch.empty(rows, dtype=torch.float32, device=device)
    log_sum = torch.empty(rows, dtype=torch.float32, device=device)
    top_id = torch.empty((rows, 1), dtype=torch.int64, device=device) if top else rank
    top_logprob = torch.empty((rows, 1), dtype=torch.float32, device=device) if top else logprob
    if rows:
        launcher(_token_logprobs_kernel, (rows,), compile_only)(
            logits, logits.stride(0), token_ids, logprob, rank, top_id, top_logprob, row_max, log_sum, vocab,
            BLOCK=BLOCK, TOP=top, num_warps=16,
        )
    return TokenLogprobs(logprob, rank, top_id if top else None, top_logprob if top else None, row_max, log_sum)
