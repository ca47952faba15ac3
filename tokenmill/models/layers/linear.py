"""Linear layers that can be split across tensor-parallel ranks (Megatron style).

A transformer block needs two kinds of split to avoid communication inside the block:
- column parallel: each rank owns a slice of the *output* features (q/k/v, gate/up), so the
  following elementwise work (rope, attention per head, SiLU) runs on local data only;
- row parallel: each rank owns a slice of the *input* features (o_proj, down_proj) and produces
  a partial sum; one all-reduce per block half restores the full activation.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``, which takes the
*full* Hugging Face tensor (a ``torch.Tensor``, or a CheckpointTensor that reads from disk only
what ``narrow`` asks for) and copies in this rank's slice. With ``tp_size == 1`` every layer is
a plain ``F.linear`` and no ``torch.distributed`` call is ever made.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.checkpoint_tensor import CheckpointTensor

# What a weight loader receives: both kinds offer .shape, .narrow(dim, start, length) and [...].
LoadedWeight = Union[torch.Tensor, CheckpointTensor]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def check_shape(param: torch.Tensor, loaded: LoadedWeight, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
    """Replicated parameters (norm weights, ...): the checkpoint tensor is copied as is."""
    check_shape(param, loaded_weight, tuple(param.shape))
    param.data.copy_(loaded_weight[...])  # [...]: the whole tensor, read from disk if it is lazy


def _new_param(shape: tuple[int, ...], loader: Any) -> nn.Parameter:
    # torch.empty: weights are always overwritten by the loader, so skip the costly random init.
    # Device and dtype come from the caller's torch.device / default-dtype context.
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along its output dim; each rank returns its slice of y."""

    # The product itself; deterministic mode swaps in a batch-invariant one (kernels/batch_invariant.py).
    matmul = staticmethod(F.linear)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.output_size_per_partition = divide(output_size, tp_size, "output features")
        self.weight = _new_param((self.output_size_per_partition, input_size), self.weight_loader)
        self.bias = _new_param((self.output_size_per_partition,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        check_shape(param, loaded_weight, (self.output_size, *param.shape[1:]))
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked into one matmul (gate_up).

    Rank r holds [gate_r; up_r]: the r-th slice of *each* projection, so SiluAndMul can split
    its local output in halves without talking to other ranks.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, tp_size, "output features")
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        full = self.output_sizes[shard_id]
        check_shape(param, loaded_weight, (full, *param.shape[1:]))
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by attention head across ranks.

    When there are fewer KV heads than ranks (e.g. 8 KV heads on 16 GPUs), each KV head is
    replicated on ``tp_size // total_num_kv_heads`` consecutive ranks so every rank still has
    the KV head its query heads attend to.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            divide(tp_size, total_num_kv_heads, "tensor_parallel_size (replicating KV heads)")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // total_num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # The per-rank output is q_size + 2 * kv_size; express it as a "full" size for the base class.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias, tp_rank, tp_size, tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id == "q":
            full_rows, start, size, offset = self.total_num_heads, self.tp_rank * self.num_heads, self.num_heads, 0
        elif shard_id in ("k", "v"):
            full_rows, start, size = self.total_num_kv_heads, self.kv_head_start, self.num_kv_heads
            offset = self.num_heads + (0 if shard_id == "k" else self.num_kv_heads)
        else:
            raise ValueError(f"QKV linear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        d = self.head_dim
        check_shape(param, loaded_weight, (full_rows * d, *param.shape[1:]))
        param.data.narrow(0, offset * d, size * d).copy_(loaded_weight.narrow(0, start * d, size * d))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along its input dim; ranks' partial sums are all-reduced.

    The input is expected already split (the output of a column-parallel layer). The bias is
    added once, after the reduction, so it is not counted ``tp_size`` times.
    """

    matmul = staticmethod(F.linear)  # as in ColumnParallelLinear

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, tp_size, "input features")
        self.weight = _new_param((output_size, self.input_size_per_partition), self.weight_loader)
        self.bias = _new_param((output_size,), default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        check_shape(param, loaded_weight, (self.output_size, self.input_size))
        size = self.input_size_per_partition
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        if self.tp_size > 1 and self.reduce_results:
            torch.distributed.all_reduce(y, group=self.tp_group)
        # Without the reduction the caller sums the ranks' outputs, so only rank 0 adds the bias.
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            y = y + self.bias
        return y
