"""Quantized weights: which scheme a layer runs (config.py), and the linear methods that run them
(fp8.py, block_fp8.py, w4a16.py; the unquantized one lives with the layers in models/layers/linear.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenmill.quantization.config import Fp8Scheme, QuantizationConfig

if TYPE_CHECKING:
    import torch

    from tokenmill.models.layers.linear import LinearMethod


def runs_kernels(device: "torch.device") -> bool:
    """Quantized layers on CUDA keep their quantized weights and run the Triton kernels; elsewhere they
    are dequantized once at load. (The interpreter tests patch this to run the kernel path on the CPU.)"""
    return device.type == "cuda"


def linear_method(config: QuantizationConfig | None, module_names: Sequence[str]) -> "LinearMethod | None":
    """The linear method of a layer built from the checkpoint modules ``module_names`` (HF names, several
    for stacked projections); None: the layer's default, unquantized."""
    scheme = None if config is None else config.scheme_for(module_names)
    if scheme is None:
        return None
    if isinstance(scheme, Fp8Scheme) and scheme.weight_scales == "block":
        from tokenmill.quantization.block_fp8 import BlockFp8LinearMethod

        return BlockFp8LinearMethod(scheme)
    if isinstance(scheme, Fp8Scheme):
        from tokenmill.quantization.fp8 import Fp8LinearMethod

        return Fp8LinearMethod(scheme)
    from tokenmill.quantization.w4a16 import W4A16LinearMethod

    return W4A16LinearMethod(scheme)
