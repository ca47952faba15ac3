"""Deterministic mode's matmul: ``x @ W^T + b`` whose every row has the same bits whatever else is
in the batch.

The model's full-precision products go through a ``matmul`` attribute (``F.linear`` by default) of
the linear layers' ``UnquantizedLinearMethod`` and of the lm_head; ``use_batch_invariant_matmuls``
points it here for a whole model. (Quantized GEMMs pick their tile by M: deterministic mode refuses
them.) On a GPU the product is
the Triton kernel of ``kernels/triton/matmul.py`` (one tile shape per weight, no split-K); cuBLAS
is not used because its kernel choice follows M.

On the CPU torch's own matmul is not batch-invariant either. Measured with torch 2.13 (MKL and
oneDNN, AVX-512, 1 and 2 threads): in fp32 a row's bits depend on how many rows share the call
(one row, two or three, and four or more each give other bits) and, with two threads, on where
the row sits (the tail rows of a call go to the second thread's kernel); bf16 happened to be
invariant on this CPU, which nothing promises for another one. What held in every case measured
(fp32 and bf16, 1 and 2 threads, calls of 4 to 64 rows, K up to 1024, N up to 6144): for one fixed
shape, a row's result depended neither on its place in the call nor on the other rows. So the CPU
path multiplies in chunks of ``CPU_CHUNK_ROWS`` rows, the last one padded with zeros: every call
has the same shape, and a row's bits depend only on the row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CPU_CHUNK_ROWS = 32  # rows per CPU matmul call (a decode batch of few rows pays for up to 32)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x of shape [..., K], each row's bits independent of the others."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from tokenmill.kernels.triton.matmul import matmul

        out = matmul(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, bias)
    else:
        out = _chunked_linear(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _chunked_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    count = rows.shape[0]
    if count == 0:
        return rows.new_empty(0, weight.shape[0])
    padding = -count % CPU_CHUNK_ROWS
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    return torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(CPU_CHUNK_ROWS)])[:count]


def use_batch_invariant_matmuls(model: nn.Module) -> None:
    """Make every full-precision product of ``model`` use ``batch_invariant_linear``: the linear layers'
    ``UnquantizedLinearMethod``, their LoRA updates and the lm_head multiply through a ``matmul`` attribute."""
    for module in model.modules():
        for owner in (module, getattr(module, "quant_method", None), getattr(module, "lora", None)):
            if getattr(owner, "matmul", None) is F.linear:
                owner.matmul = batch_invariant_linear
