"""RMSNorm with the residual add of the pre-norm transformer block fused in, and LayerNorm with the
residual add of the post-norm block (BERT) fused in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch
from torch import nn

from tokenmill.models.layers.linear import default_weight_loader

if TYPE_CHECKING:
    from tokenmill.quantization.fp8 import QuantizedActivation

Normed = Union[torch.Tensor, "QuantizedActivation"]  # quantized when the norm feeds an fp8 linear


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back, exactly as Hugging Face Llama does.

    ``forward(x, residual)`` first adds the residual (in the activation dtype, as HF does with
    ``residual + hidden``) and returns ``(normed, new_residual)``: the block's skip connection
    and the next norm become one call.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, feeds: nn.Module | None = None
    ) -> "Normed | tuple[Normed, torch.Tensor]":
        """``feeds``: the linear layer that takes the result. When it runs on fp8 with per-token scales
        (on a GPU), the result comes quantized for it, a ``QuantizedActivation`` (the residual sum
        stays a tensor)."""
        if x.is_cuda:
            # One Triton kernel instead of six elementwise ones: on a GPU decode step these small
            # launches, not the arithmetic, are the cost. Same rounding points as below.
            from tokenmill.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_fp8
            from tokenmill.quantization.fp8 import QuantizedActivation, takes_quantized_input

            if x.dim() == 2 and takes_quantized_input(feeds):
                codes, scales, summed = rms_norm_fp8(x, self.weight, self.eps, residual=residual)
                return QuantizedActivation(codes, scales) if summed is None else (QuantizedActivation(codes, scales), summed)
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and names) whose ``forward(x, residual)`` normalises
    ``x + residual``: the end of a post-norm block (BERT's ``LayerNorm(dense(x) + input)``).

    On the GPU the add and the norm are one Triton kernel (three passes over the activations
    instead of five, one launch instead of two), with HF's rounding: the sum in the activation
    dtype, the norm in fp32.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and self.weight is not None and self.bias is not None:
            from tokenmill.kernels.triton.layernorm import add_layer_norm

            return add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        return super().forward(x if residual is None else x + residual)
