"""The sort-free top-k / top-p filters against the sort-based definition, written here from scratch.

Top-k keeps every logit >= the k-th largest (ties with it kept, vLLM's rule). Top-p keeps a token
iff the tokens with a strictly larger logit hold less than top_p of the mass: sort stably by
logit, keep the prefix whose mass before each token is below top_p (cumsum in float64), then
keep every token whose logit equals the last kept one's (ties kept together); top_p = 1 keeps all.
Min-p keeps the tokens with probability >= min_p times the largest.
The kept-set masks must be identical, on random logits with ties, -inf entries, -0.0, peaked and
flat rows: for the CPU sampler's filters and for the threshold that the GPU kernels' twin
(``reference.filter_threshold_ref``) defines, applied in vLLM's order.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.reference import filter_threshold_ref
from tokenmill.worker.sampler import _top_k, _top_p

SHAPES = [(1, 7), (13, 7), (64, 7), (1, 1000), (29, 1000), (64, 1000), (3, 50_000), (16, 50_000)]


def reference_top_k_keep(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    keep = torch.ones_like(logits, dtype=torch.bool)
    for row in range(logits.shape[0]):
        k = int(top_k[row])
        if 0 < k < vocab:
            kth = logits[row].sort(descending=True, stable=True).values[k - 1]
            keep[row] = logits[row] >= kth
    return keep


def reference_top_p_keep(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    keep = torch.ones_like(logits, dtype=torch.bool)
    for row in range(logits.shape[0]):
        p = float(top_p[row])
        if p >= 1.0:
            continue
        order = logits[row].sort(descending=True, stable=True).indices
        ordered = probs[row][order].double()
        mass_before = ordered.cumsum(0) - ordered
        last_kept = logits[row][order][mass_before < p][-1]
        keep[row] = logits[row] >= last_kept
    return keep


def reference_min_p_keep(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1).double()
    return probs >= min_p[:, None].double() * probs.max(dim=-1, keepdim=True).values


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Per-row shapes: very peaked, ordinary, very flat, coarsely rounded (many ties), all equal,
    with some entries -inf (masked earlier) and zeros of both signs."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    kind = torch.arange(rows) % 5
    logits[kind == 0] *= 40.0  # peaked
    logits[kind == 1] *= 2.0
    logits[kind == 2] *= 0.01  # flat
    logits[kind == 3] = (logits[kind == 3] * 2).round() / 2  # few distinct values: ties
    logits[kind == 4] = 0.0  # one value: everything tied
    logits[kind == 4, ::3] = -0.0
    masked = torch.rand(rows, vocab, generator=gen) < 0.2
    masked[:, 0] = False  # every row keeps a finite logit
    return logits.masked_fill(masked, float("-inf"))


def kept(filtered: torch.Tensor) -> torch.Tensor:
    return filtered > float("-inf")


@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_top_p_keeps_the_sorted_nucleus(rows, vocab):
    logits = random_logits(rows, vocab, seed=rows * vocab)
    gen = torch.Generator().manual_seed(vocab)
    top_p = torch.rand(rows, generator=gen).clamp(min=1e-4)
    top_p[::4] = 1.0
    top_p[1::7] = 1e-6  # only the most probable token (and its ties)
    expected = reference_top_p_keep(logits, top_p) & kept(logits)
    out = _top_p(logits, top_p)
    assert torch.equal(kept(out), expected)
    assert torch.equal(out[expected], logits[expected])  # kept logits are untouched


@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_top_k_keeps_the_k_largest_and_their_ties(rows, vocab):
    logits = random_logits(rows, vocab, seed=rows + vocab)
    choices = torch.tensor([0, 1, 5, vocab])
    top_k = choices[torch.randint(0, 4, (rows,), generator=torch.Generator().manual_seed(rows))]
    expected = reference_top_k_keep(logits, top_k) & kept(logits)
    out = _top_k(logits, top_k, max(1, int(top_k.max())))
    assert torch.equal(kept(out), expected)
    assert torch.equal(out[expected], logits[expected])


def test_top_k_then_top_p_on_a_batch_mixing_settings():
    """The sampler's order: top-k, then top-p over what top-k kept (its -inf entries included)."""
    logits = random_logits(32, 1000, seed=5)
    gen = torch.Generator().manual_seed(6)
    top_k = torch.randint(0, 60, (32,), generator=gen)
    top_p = torch.rand(32, generator=gen) * 0.9 + 0.05
    after_k = logits.masked_fill(~reference_top_k_keep(logits, top_k), float("-inf"))
    expected = reference_top_p_keep(after_k, top_p) & kept(after_k)
    assert torch.equal(kept(_top_p(_top_k(logits, top_k, max(1, int(top_k.max()))), top_p)), expected)


def test_a_row_without_a_finite_mass_leaves_the_others_alone():
    """A row holding a NaN logit (a model overflowing in fp16) or none but -inf (every token banned)
    has no nucleus: top-p leaves it as it is, instead of failing the whole step (it raised an index
    error), and the other rows are filtered exactly as without it."""
    logits = random_logits(6, 300, seed=7)
    top_p = torch.full((6,), 0.8)
    alone = _top_p(logits, top_p)
    logits[2, 17] = float("nan")
    logits[4] = float("-inf")
    out = _top_p(logits, top_p)
    others = [0, 1, 3, 5]
    assert torch.equal(out[others], alone[others])
    assert torch.equal(out[2].isnan(), logits[2].isnan()) and torch.equal(out[2][~out[2].isnan()], logits[2][~logits[2].isnan()])
    assert torch.equal(out[4], logits[4])


def test_ties_are_equal_logits_not_equal_float32_probabilities():
    # 1e-8 and 0.0 are distinct logits whose float32 probabilities are equal: the larger one alone
    # holds a third of the mass, so top_p 0.3 keeps only it.
    logits = torch.tensor([[1e-8, 0.0, 0.0]])
    probs = logits.softmax(dim=-1)
    assert probs[0, 0] == probs[0, 1]
    top_p = torch.tensor([0.3])
    assert kept(_top_p(logits, top_p)).tolist() == [[True, False, False]]
    assert reference_top_p_keep(logits, top_p).tolist() == [[True, False, False]]
    assert filter_threshold_ref(logits[0], 0, 0.3, 0.0) == float(logits[0, 0])


@pytest.mark.parametrize("rows, vocab", [(40, 7), (40, 1000), (12, 50_000)])
def test_kernel_threshold_twin_keeps_the_sorted_sets(rows, vocab):
    """The GPU kernels keep scores >= one threshold per row; their twin's threshold must select
    exactly top-k, then top-p over what top-k kept, then min-p."""
    logits = random_logits(rows, vocab, seed=rows * 7 + vocab)
    gen = torch.Generator().manual_seed(rows + 3 * vocab)
    top_k = torch.tensor([0, 1, 3, 20, vocab, vocab + 5])[torch.randint(0, 6, (rows,), generator=gen)]
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen) * 0.98 + 0.01)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, torch.rand(rows, generator=gen) * 0.5)
    after_k = logits.masked_fill(~reference_top_k_keep(logits, top_k), float("-inf"))
    after_p = after_k.masked_fill(~reference_top_p_keep(after_k, top_p), float("-inf"))
    expected = reference_min_p_keep(after_p, min_p) & kept(after_p)
    for row in range(rows):
        threshold = filter_threshold_ref(logits[row], int(top_k[row]), float(top_p[row]), float(min_p[row]))
        assert torch.equal((logits[row] >= threshold) & kept(logits[row]), expected[row]), row
