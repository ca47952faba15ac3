"""The random draw of the sampler: both forms sample softmax(logits / T), checked by a chi-square test
against the softmax itself.

- The GPU form, ``argmax(logits / T + Gumbel noise)`` with Philox noise keyed by (key, counter), is
  checked here through its plain-torch twin (``reference.gumbel_argmax_ref``'s noise); the Triton
  kernel is checked against that twin in tests/kernel_checks_sampling.py (interpreter) and tests/gpu.
- The CPU form, the exponential race with a generator seeded per row, through the Sampler itself.
- With top-k / top-p / min-p, both forms against the softmax renormalised over the kept tokens (the
  GPU form through its twin: Gumbel noise over the scores >= ``reference.filter_threshold_ref``).
"""

from __future__ import annotations

import pytest
import torch

from reference import CHI2_9DOF_P001, CHI2_P001, draw_test_logits, softmax_chi_square
from tokenmill.kernels.reference import filter_threshold_ref, gumbel_noise_ref, philox_ref
from tokenmill.worker.sampler import Sampler, SamplingBatch

_DRAWS = 40_000


def test_philox_twin_known_answer() -> None:
    # Known-answer vectors of Philox-4x32-10 from Random123's tests/kat_vectors (key words k0, k1 = low, high).
    zeros = philox_ref(0, torch.zeros(1, dtype=torch.int64), 0, 0, 0)
    assert [int(w) for w in zeros] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox_ref(0xFFFFFFFF | (0xFFFFFFFF << 32), torch.full((1,), 0xFFFFFFFF), 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    assert [int(w) for w in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = philox_ref(0x299F31D0A4093822, torch.full((1,), 0x243F6A88), 0x85A308D3, 0x13198A2E, 0x03707344)
    assert [int(w) for w in pi] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gumbel_max_draws_follow_the_softmax(temperature: float) -> None:
    logits = draw_test_logits()
    noise = gumbel_noise_ref(key=12345, counter=torch.arange(_DRAWS), vocab_size=logits.shape[0])
    samples = (logits / temperature + noise).argmax(dim=-1)
    assert softmax_chi_square(samples, logits, temperature) < CHI2_9DOF_P001


def test_gumbel_noise_depends_on_key_and_counter() -> None:
    a = gumbel_noise_ref(1, torch.tensor([0, 1]), 64)
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(gumbel_noise_ref(2, 0, 64), a[0])
    assert torch.equal(gumbel_noise_ref(1, 1, 64), a[1])


def _batch(rows: int, temperature: float, counters: torch.Tensor) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), temperature), all_greedy=False, top_k=None, max_top_k=0, top_p=None,
        min_p=None, draw_keys=torch.full((rows,), 99, dtype=torch.int64), draw_counters=counters,
    )


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_cpu_draws_follow_the_softmax(temperature: float) -> None:
    logits = draw_test_logits()
    rows = 4_000  # the CPU form seeds a generator per row: fewer rows, repeated over counters
    samples = torch.cat([
        Sampler()(logits.expand(rows, -1).contiguous(), _batch(rows, temperature, torch.arange(rows) + start)).token_ids
        for start in range(0, _DRAWS, rows)
    ])
    assert softmax_chi_square(samples, logits, temperature) < CHI2_9DOF_P001


def test_cpu_draw_is_a_function_of_key_and_counter() -> None:
    logits = torch.zeros(3, 1000)
    first = Sampler()(logits, _batch(3, 1.0, torch.tensor([5, 6, 5]))).token_ids.tolist()
    assert first[0] == first[2] and first[0] != first[1]
    again = Sampler()(logits[:1], _batch(1, 1.0, torch.tensor([5]))).token_ids.tolist()
    assert again == first[:1]


# (top_k, top_p, min_p) at temperature 1.5 over draw_test_logits: each keeps 4 to 7 of its 10 tokens.
FILTERS = [(6, 1.0, 0.0), (0, 0.9, 0.0), (7, 0.8, 0.0), (0, 1.0, 0.1), (5, 0.95, 0.05)]


def kept_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    threshold = filter_threshold_ref(logits / temperature, top_k, top_p, min_p)
    kept = logits / temperature >= threshold
    assert 3 <= int(kept.sum()) <= 7 and int(kept.sum()) < int(torch.isfinite(logits).sum())
    return logits.masked_fill(~kept, float("-inf"))


@pytest.mark.parametrize("top_k, top_p, min_p", FILTERS)
def test_filtered_gumbel_draws_follow_the_renormalised_softmax(top_k, top_p, min_p) -> None:
    logits, temperature = draw_test_logits(), 1.5
    allowed = kept_logits(logits, temperature, top_k, top_p, min_p)
    noise = gumbel_noise_ref(key=777, counter=torch.arange(_DRAWS), vocab_size=logits.shape[0])
    samples = (allowed / temperature + noise).argmax(dim=-1)
    dof = int(torch.isfinite(allowed).sum()) - 1
    assert softmax_chi_square(samples, allowed, temperature) < CHI2_P001[dof]


@pytest.mark.parametrize("top_k, top_p, min_p", FILTERS)
def test_filtered_cpu_draws_follow_the_renormalised_softmax(top_k, top_p, min_p) -> None:
    logits, temperature = draw_test_logits(), 1.5
    allowed = kept_logits(logits, temperature, top_k, top_p, min_p)
    rows = 4_000
    batch = _batch(rows, temperature, torch.arange(rows))
    batch.top_k, batch.max_top_k = torch.full((rows,), top_k), top_k
    batch.top_p, batch.min_p = torch.full((rows,), top_p), torch.full((rows,), min_p)
    samples = torch.cat([
        Sampler()(logits.expand(rows, -1).contiguous(), _batch_with(batch, torch.arange(rows) + start)).token_ids
        for start in range(0, 20_000, rows)
    ])
    dof = int(torch.isfinite(allowed).sum()) - 1
    assert softmax_chi_square(samples, allowed, temperature) < CHI2_P001[dof]


def _batch_with(batch: SamplingBatch, counters: torch.Tensor) -> SamplingBatch:
    batch.draw_counters = counters
    return batch
