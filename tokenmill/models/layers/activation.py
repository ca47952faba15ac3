"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate, up stacked by MergedColumnParallelLinear) -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.triton.activation import silu_and_mul

            return silu_and_mul(x)  # one fused kernel on the GPU (see RMSNorm.forward)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
