"""What the sampling kernels (``kernels/triton/sampling.py``) read per row besides the logits, in a
module without triton, so the CPU's sampler builds and reads the same inputs."""

from __future__ import annotations

from typing import NamedTuple

import torch

# Output counts are int16, held at this: half the bytes of int32 in a table the GPU memory plan reserves
# at every sequence slot (~0.3 GB less at 1,024 slots of V = 151,936, which the KV cache gets). Only a
# token output more than 32,767 times in one sequence reads as fewer: its frequency penalty stops at
# 32,767 times the factor, which already decides its draw unless the factor is under ~1e-3.
COUNT_MAX = 32767


def counts_width(vocab_size: int) -> int:
    """Columns of a counts table: the vocabulary rounded up to even. The kernels read the int16 table as
    int32 words, two tokens a word (the even one in the low half), so their loads keep the layout of an
    int32 table: an int16 load changed the wide top-p kernels' register allocation (docs/perf.md 94)."""
    return vocab_size + (vocab_size & 1)


class Filters(NamedTuple):
    """Per-row top-k (int, 0 = off), top-p (float32, 1 = off) and min-p (float32, 0 = off)."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor


class RowState(NamedTuple):
    """Per-row additions to the logits, read from per-sequence state on the device (see
    ``worker/sampling_state.py``); a slot of -1 means none for that row. The bias is added first,
    then the penalties (vLLM's order)."""

    bias_slots: torch.Tensor  # [N] int32
    bias: torch.Tensor  # [S, V] float32: added to the logits (logit_bias; -inf bans a token)
    penalty_slots: torch.Tensor  # [N] int32
    counts: torch.Tensor  # [S', counts_width(V)] int16: occurrences of each token among the slot's outputs
    prompt_bits: torch.Tensor  # [S', ceil(V / 32)] int32: bit i % 32 of word i // 32 = token i is in the prompt
    # The penalties of each penalty slot (not of each row: written once when a sequence takes its
    # slot, so no step rebuilds them from the requests).
    repetition: torch.Tensor  # [S'] float32
    frequency: torch.Tensor  # [S'] float32
    presence: torch.Tensor  # [S'] float32
