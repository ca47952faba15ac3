"""What the sampling kernels (``kernels/triton/sampling.py``) read per row besides the logits, in a
module without triton, so the CPU's sampler builds and reads the same inputs."""

from __future__ import annotations

from typing import NamedTuple

import torch


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
    counts: torch.Tensor  # [S', V] int32: occurrences of each token among the slot's outputs
    prompt_bits: torch.Tensor  # [S', ceil(V / 32)] int32: bit i % 32 of word i // 32 = token i is in the prompt
    # The penalties of each penalty slot (not of each row: written once when a sequence takes its
    # slot, so no step rebuilds them from the requests).
    repetition: torch.Tensor  # [S'] float32
    frequency: torch.Tensor  # [S'] float32
    presence: torch.Tensor  # [S'] float32
