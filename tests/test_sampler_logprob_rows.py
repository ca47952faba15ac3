"""The sampler's raw logprobs where the controls write into the logits (bans, grammars): formed a few
rows at a time from the raw values (``sampler.raw_outputs``), they must equal plain torch's answer from
the whole [N, V] table of the logits before the controls, at every row of every chunk: a grammar row's
masked by its grammar (vLLM masks them before its sampler), a beam's ranked within its grammar not."""

from __future__ import annotations

import pytest
import torch

from tokenmill.worker import sampler as sampler_module
from tokenmill.worker.sampler import Sampler, SamplingBatch
from tokenmill.worker.sampling_state import LogprobIdsState, StepRows

ROWS, VOCAB, TOP = 11, 50, 3


def _case(dtype: torch.dtype, controls: bool) -> tuple[torch.Tensor, SamplingBatch, torch.Tensor, torch.Tensor]:
    """Logits, a greedy batch wanting 3 top logprobs and some rows' logprob_token_ids; with ``controls``
    every row's argmax banned and a grammar allowing ~2/3 of the tokens, beams (odd rows) ranked within
    it. Returns the logits, the batch, the tokens the grammar allows and the rows ranked within it."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(ROWS, VOCAB, generator=gen) * 3).to(dtype)
    allowed = torch.rand(ROWS, VOCAB, generator=gen) < 0.66
    allowed[torch.arange(ROWS), logits.float().argmax(dim=-1)] = True  # the ban, not the grammar, removes it
    ranked_rows = torch.arange(ROWS) % 2 == 1
    ids_state = LogprobIdsState(torch.device("cpu"))
    ids_state.ids = torch.tensor([[4, 7, 0], [9, 2, 33]])  # slot 0: two ids (padded), slot 1: three
    banned = torch.stack((torch.arange(ROWS), logits.float().argmax(dim=-1)))
    batch = SamplingBatch(
        temperature=torch.zeros(ROWS), all_greedy=True, top_k=None, max_top_k=0, top_p=None, min_p=None,
        max_num_logprobs=TOP, logprob_ids=(ids_state, StepRows(torch.tensor([1, 5, 9]), torch.tensor([0, 1, 0]))),
        banned=banned if controls else None,
        grammar_bitmask=torch.zeros((ROWS, 2), dtype=torch.int32) if controls else None,
        # A row whose bitmask allows everything (-1) keeps its values, as xgrammar's apply does.
        apply_grammar=(lambda x, bitmask: x.masked_fill_(~allowed & (bitmask[:, :1] != -1), float("-inf")))
        if controls else None,
        rank_within_grammar=ranked_rows if controls else None,
    )
    return logits, batch, allowed, ranked_rows


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
@pytest.mark.parametrize("controls", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_logprobs_a_few_rows_at_a_time_equal_the_whole_table(monkeypatch, mode, controls, dtype):
    monkeypatch.setattr(sampler_module, "LOGPROB_TABLE_ROWS", 4)  # 11 rows: chunks of 4, 4 and 3
    logits, batch, allowed, ranked_rows = _case(dtype, controls)
    batch.logprobs_mode = mode
    raw = logits.float().clone()
    if controls:  # the grammar rows' raw values masked first; the beams' (odd rows) the vocabulary's
        raw = raw.masked_fill(~ranked_rows[:, None] & ~allowed, float("-inf"))
    table = torch.log_softmax(raw, dim=-1) if mode == "raw_logprobs" else raw
    after = raw.masked_fill(~allowed, float("-inf")) if controls else raw.clone()
    if controls:
        after[batch.banned[0], batch.banned[1]] = float("-inf")

    out = Sampler()(logits, batch)

    tokens = after.argmax(dim=-1)
    assert torch.equal(out.token_ids, tokens)
    if controls:  # every row's first choice was banned: the tokens moved, the logprobs did not
        assert not torch.equal(tokens, raw.argmax(dim=-1))
    sampled = table.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(out.sampled_logprobs, sampled, rtol=0, atol=0)
    assert torch.equal(out.sampled_ranks, (table > sampled[:, None]).sum(dim=-1) + 1)
    # Ranked rows list their top logprobs among the tokens left after the controls (the grammar's, and
    # here the ban too: a beam row has no bans in the engine, so the sampler does not tell them apart).
    ranked = table.masked_fill(ranked_rows[:, None] & (after == float("-inf")), float("-inf")) if controls else table
    top_values, top_ids = ranked.topk(TOP, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top_values, rtol=0, atol=0)
    assert torch.equal(out.top_ids, top_ids)
    requested = torch.zeros(ROWS, 3)
    requested[[1, 5, 9]] = table[[1, 5, 9]].gather(1, torch.tensor([[4, 7, 0], [9, 2, 33], [4, 7, 0]]))
    torch.testing.assert_close(out.requested_logprobs, requested, rtol=0, atol=0)
