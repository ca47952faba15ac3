"""The sampling side of the GPU memory plan (``sizing.py``, through ``ModelRunner.profile_run``):
the largest per-sequence sampling state the engine can reach, and the sampler's working memory at
the most rows a step can sample, both made for real so that ``max_memory_allocated`` sees them.

State: the penalty and logit-bias tables (``sampling_state.py``) grow to ``slot_capacity(n)`` rows
for n sequences holding slots at once, and only running sequences hold slots when a table grows,
so ``slot_capacity(max_num_seqs)`` rows is their largest size. Their highest point is a step where
``max_num_seqs`` sequences with penalties and logit_bias sample for the first time: the tables
grow to that size and ``LogitBiasState._fill`` copies the new rows to the device beside them (a
growth by doubling holds at most 1.5 times a table, less than that). ``largest_state`` makes that
step with the real state classes. Bad words and logprob_token_ids keep a few hundred bytes a slot
and are left out.

Sampler: one pass of the real ``Sampler`` over the profile's logits (one row per sequence, at most
``min(max_num_seqs, max_num_batched_tokens)``: the most a step samples) with every row using the
bias and penalty tables, the three filters (top-k just below the vocabulary, what a processed-
logprobs mode's torch top-k pays most for), a random draw and ``max_logprobs`` logprobs, in the
engine's ``logprobs_mode``, and a banned token a row (eos below min_tokens): a ban is written into
the logits, so the raw logprobs take the [rows, V] table, not the two-pass kernel that steps
without bans take (the table is what such a step holds at most). Structured outputs and Python
logits processors send the logits through a float32 copy first, whose kernels are compiled only
when first met (``Sampler.precompile``), so that path is not run here: float32 tensors of
``float32_path_shapes`` stand for what it holds beyond this pass. Measured on an H200 (1,024 rows,
V = 151,936, above the logits) while raw logprobs were one [rows, V] float32 table: this pass peaked
at 13 V bytes a row in raw_logprobs mode, the float32 path at 17, and with the ranks of beams under a
grammar at 21, which the pass with its two copies matched (21.0); in processed_logprobs mode 48, 52
and 52 against the profile's 56. The raw values are now a copy in the logits' dtype, their float32
logprobs formed ``sampler.LOGPROB_TABLE_ROWS`` rows at a time, and the float32 path's bias gathered
as many rows at a time: predicted (not yet measured) 12-16 V a row at 1,024 rows (of the 21, ~8 V
were the whole-table path's float32 logprobs and the copy they were made from, ~3 V the second
stand-in at every row).
tests/gpu/test_memory_plan_gpu.py checks a whole engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.kernels.sampling_args import RowState
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import Sampler, SamplingBatch
from tokenmill.worker.sampling_state import BIAS_ROWS_AT_A_TIME, LogitBiasState, PenaltyState, StepRows, ToDevice

def float32_path_shapes(rows: int, vocab: int) -> list[tuple[int, int]]:
    """What the float32 controls path (Python logits processors) holds beyond the kernels' path: the
    float32 copy of the logits it works on, and the bias rows torch gathers to add to it
    (``apply_bias``, BIAS_ROWS_AT_A_TIME rows at a time; +4 V bytes a row each, measured when the
    gather took every row). The masked copy of the logprobs that beams ranked under a grammar took
    (+8 V) is now formed with the logprobs, a few rows at a time (``sampler.raw_outputs``)."""
    return [(rows, vocab), (min(rows, BIAS_ROWS_AT_A_TIME), vocab)]

# Penalties and a bias on every probe sequence: both tables needed, as the worst case has them.
_PROBE_PARAMS = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 1.0})


@dataclass
class _ProbeSequence:
    """What the slotted states read of a sequence (see ``StepSequence``): a one-token prompt, no outputs."""

    seq_id: int
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return _PROBE_PARAMS

    @property
    def request(self) -> "_ProbeSequence":  # the states read the request's sampler_needs
        return self

    @property
    def sampler_needs(self) -> int:
        return int(self.params.sampler_needs)


@dataclass
class SamplingReserve:
    """What the profile held for sampling: the state tables' rows and bytes, the sampler's rows."""

    state_rows: int
    state_bytes: int
    sampler_rows: int


def largest_state(vocab_size: int, device: torch.device, max_num_seqs: int,
                  to_device: ToDevice) -> tuple[PenaltyState, LogitBiasState]:
    """Fresh penalty and bias tables after ``max_num_seqs`` sequences with both sampled for the
    first time in one step, through the runner's own calls (``ModelRunner._sampling_batch``)."""
    penalties, bias = PenaltyState(vocab_size, device), LogitBiasState(vocab_size, device)
    seqs = [_ProbeSequence(seq_id) for seq_id in range(max_num_seqs)]
    penalties.slots(seqs, to_device)
    bias.slots(seqs, to_device)
    return penalties, bias


def state_bytes(penalties: PenaltyState, bias: LogitBiasState) -> int:
    """The device bytes the two tables hold."""
    tensors = (penalties.counts, penalties.prompt_bits, penalties.repetition, penalties.frequency, penalties.presence,
               bias.bias)
    return sum(t.numel() * t.element_size() for t in tensors)


def worst_case_batch(logits: torch.Tensor, penalties: PenaltyState, bias: LogitBiasState, max_logprobs: int,
                     logprobs_mode: str) -> SamplingBatch:
    """A step's sampling settings with every row using what costs the sampler memory (see the module
    docstring); row i reads slot i of the tables. ``max_logprobs`` -1: the whole vocabulary."""
    rows, vocab = logits.shape
    device = logits.device
    every = torch.arange(rows, device=device)
    slots = every.to(torch.int32)
    step = StepRows(every, every)
    # top-k just below the vocabulary on every other row, top-p alone on the rest (the kernels' wide passes).
    top_k = torch.where(every % 2 == 0, vocab - 1, 0)
    return SamplingBatch(
        temperature=torch.full((rows,), 0.7, device=device),
        all_greedy=False,
        top_k=top_k,
        max_top_k=vocab - 1,
        top_p=torch.full((rows,), 0.9, device=device),
        min_p=torch.full((rows,), 0.05, device=device),
        top_p_alone=True,
        draw_keys=every,
        draw_counters=every,
        state=RowState(slots, bias.bias, slots, penalties.counts, penalties.prompt_bits, penalties.repetition,
                       penalties.frequency, penalties.presence),
        bias_rows=step,
        penalty_rows=step,
        # Token 0 banned on every row: the table path for the logprobs (see the module docstring).
        banned=torch.stack((every, torch.zeros_like(every))),
        max_num_logprobs=vocab if max_logprobs < 0 else min(max_logprobs, vocab),
        logprobs_mode=logprobs_mode,
    )


def profile_sampling(sampler: Sampler, logits: torch.Tensor, penalties: PenaltyState, bias: LogitBiasState,
                     max_logprobs: int, logprobs_mode: str) -> SamplingReserve:
    """One sampler pass over ``logits`` with the tables of ``largest_state``, the float32 path's
    extra tensors held meanwhile; all of it is freed on return."""
    batch = worst_case_batch(logits, penalties, bias, max_logprobs, logprobs_mode)
    extra = [torch.empty(shape, dtype=torch.float32, device=logits.device) for shape in float32_path_shapes(*logits.shape)]
    sampler(logits, batch)
    del extra
    return SamplingReserve(penalties.table.capacity, state_bytes(penalties, bias), logits.shape[0])
