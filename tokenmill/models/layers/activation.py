"""Gated activation of the SwiGLU MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenmill.quantization.fp8 import QuantizedActivation


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate, up stacked by MergedColumnParallelLinear) -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor, *, feeds: nn.Module | None = None) -> "torch.Tensor | QuantizedActivation":
        """``feeds``: the linear layer that takes the result; when it runs on fp8 with per-token
        scales (on a GPU), the result comes quantized for it (as from ``RMSNorm.forward``)."""
        if x.is_cuda:
            from tokenmill.kernels.triton.activation import silu_and_mul, silu_and_mul_fp8
            from tokenmill.quantization.fp8 import QuantizedActivation, takes_quantized_input

            if x.dim() == 2 and takes_quantized_input(feeds):
                return QuantizedActivation(*silu_and_mul_fp8(x))
            return silu_and_mul(x)  # one fused kernel on the GPU (see RMSNorm.forward)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
