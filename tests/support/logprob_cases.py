"""Inputs and the comparison for the sampled tokens' logprobs without a table
(``sampler.kernel_logprobs``) against the sampler's table path (``with_logprobs`` over
``log_softmax``), shared by the interpreter checks (``kernel_checks_sampling.py``) and the GPU
tests (``gpu/test_token_logprobs_gpu.py``). Plain torch.

Which of exactly equal logprobs come first, and which are kept at the k-th place, is
``torch.topk``'s choice on both paths and guaranteed by neither, so the comparison never depends
on it: values place by place (equal values read the same in any order), each returned id's value
read back from the table, and the ids strictly above the k-th value as a set.
"""

from __future__ import annotations

import torch

from tokenmill.engine.step import SamplerOutput
from tokenmill.worker.sampler import with_logprobs

ROWS = 6


def tied_logprob_rows(vocab: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[ROWS, vocab] logits in ``dtype`` and a token a row (CPU tensors):
    0. random; 1. the top k in tie groups of two (exact ties inside the top k, none across its
    boundary: the (k+1)-th is strictly lower), the token tied with the top; 2. random, the token
    the k-th largest (its rank is k); 3. every 7th logit equal, the token among them (ties below
    the top k, for the rank); 4. every logit equal (ties across the boundary: rank 1 and top-1 id 0);
    5. random, the token the row's worst.
    The steps of 0.125 from 12 are exact in every float dtype, above the random ones (std 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, vocab, generator=gen) * 1.5
    tokens = torch.randint(0, vocab, (ROWS,), generator=gen)
    picked = torch.randperm(vocab, generator=gen)[: k + 1]
    for place, column in enumerate(picked.tolist()):  # places 2g and 2g + 1 share a value; place k below all
        logits[1, column] = 12.0 - 0.125 * (place // 2 if place < k else k)
    tokens[1] = int(picked[1]) if k >= 2 else int(picked[0])
    logits[3, ::7] = 0.5
    tokens[3] = 7 * (vocab // 14)
    logits[4] = 0.25
    logits = logits.to(dtype)
    tokens[2] = int(logits[2].float().topk(max(k, 1)).indices[-1])
    tokens[5] = int(logits[5].float().argmin())
    return logits, tokens


def assert_matches_table(got: SamplerOutput, logits: torch.Tensor, k: int, rank_slack: int = 0,
                         atol: float = 2e-5) -> None:
    """``got`` (for ``got.token_ids``) against ``with_logprobs`` over ``log_softmax(logits.float())``.
    ``rank_slack``: how far a rank may be off (float32 logits: two logprobs may round apart on one
    path and together on the other; 16-bit logits' distinct values stay distinct, so 0)."""
    table = torch.log_softmax(logits.float(), dim=-1)
    want = with_logprobs(got.token_ids, table, k)
    tol = dict(atol=atol, rtol=1e-5)
    torch.testing.assert_close(got.sampled_logprobs, want.sampled_logprobs, **tol)
    assert got.sampled_ranks.dtype == torch.int64
    off = (got.sampled_ranks - want.sampled_ranks).abs().max()
    assert off <= rank_slack, (got.sampled_ranks, want.sampled_ranks)
    if k == 0:
        assert got.top_ids is None and got.top_logprobs is None
        return
    assert got.top_ids.shape == got.top_logprobs.shape == (logits.shape[0], k)
    assert got.top_ids.dtype == torch.int64 and got.top_logprobs.dtype == torch.float32
    # Place by place (both sorted from the largest), and each id's own logprob.
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, **tol)
    torch.testing.assert_close(table.gather(1, got.top_ids), got.top_logprobs, **tol)
    assert bool((got.top_logprobs[:, :-1] >= got.top_logprobs[:, 1:]).all()), "not sorted from the largest"
    kth = want.top_logprobs[:, -1:]
    for row in range(logits.shape[0]):
        ids = got.top_ids[row].tolist()
        assert len(set(ids)) == k, f"row {row}: an id twice: {ids}"
        above = set(want.top_ids[row][want.top_logprobs[row] > kth[row]].tolist())
        assert above <= set(ids), f"row {row}: {sorted(above - set(ids))} are above the k-th logprob but not listed"
        token = int(got.token_ids[row])
        if token in ids:  # the token's logprob and its entry are formed alike: the same bits
            place = ids.index(token)
            assert got.top_logprobs[row, place] == got.sampled_logprobs[row], row
            assert got.sampled_ranks[row] <= place + 1, (row, place, got.sampled_ranks[row])
    if k == 1:  # the kernel's own top-1: the first of equal largest logits (torch.argmax's rule)
        first = logits.float().argmax(dim=-1)
        assert torch.equal(got.top_ids[:, 0], first), (got.top_ids[:, 0], first)
