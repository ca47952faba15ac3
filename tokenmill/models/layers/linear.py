"""Linear layers that can be split across tensor-parallel ranks (Megatron style).

A transformer block needs two kinds of split to avoid communication inside the block:
- column parallel: each rank owns a slice of the *output* features (q/k/v, gate/up), so the
  following elementwise work (rope, attention per head, SiLU) runs on local data only;
- row parallel: each rank owns a slice of the *input* features (o_proj, down_proj) and produces
  a partial sum; one all-reduce per block half restores the full activation.

What a layer stores and how it multiplies belongs to its *linear method*: ``UnquantizedLinearMethod``
below (the model's dtype), or the fp8 / 4-bit methods of ``tokenmill.quantization``. The method
creates the layer's parameters, says how each lies along the output and input features
(``ParamLayout``, packed or grouped), prepares them after loading and computes ``x W^T``. The
layers only decide which features this rank keeps (a ``Placement``).

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``, which takes the
*full* Hugging Face tensor (a ``torch.Tensor``, or a CheckpointTensor that reads from disk only
what ``narrow`` asks for) and copies in this rank's slice. With ``tp_size == 1`` every layer is
a plain ``F.linear`` and no ``torch.distributed`` call is ever made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Union

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


@dataclass(frozen=True)
class ParamLayout:
    """Which dims of a parameter run along the output and input features, and how many features
    one stored element covers there (8 for int4 packed in int32, the group size for group scales)."""

    output_dim: int | None = None
    input_dim: int | None = None
    output_pack: int = 1
    input_pack: int = 1


@dataclass(frozen=True)
class Placement:
    """The part of a checkpoint tensor this rank keeps, in features (unpacked): output features
    [row_src, row_src + rows) go to [row_dst, row_dst + rows) of the parameter, input features
    [col_src, col_src + cols) are kept; the checkpoint tensor has full_rows x full_cols features."""

    row_dst: int
    row_src: int
    rows: int
    col_src: int
    cols: int
    full_rows: int
    full_cols: int


def new_param(shape: tuple[int, ...], loader: Any, layout: ParamLayout | None = None, dtype: torch.dtype | None = None) -> nn.Parameter:
    # torch.empty: weights are always overwritten by the loader, so skip the costly random init.
    # Device and dtype come from the caller's torch.device / default-dtype context.
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.feature_layout = layout  # type: ignore[attr-defined]
    return param


def load_placed(param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
    """Copy this rank's part of ``loaded`` into ``param`` as its ParamLayout describes it (or hand it
    to the parameter's own ``place`` hook: per-tensor scales, weights quantized while loading)."""
    hook: Callable[[nn.Parameter, LoadedWeight, Placement], None] | None = getattr(param, "place", None)
    if hook is not None:
        hook(param, loaded, where)
        return
    layout: ParamLayout = param.feature_layout  # type: ignore[attr-defined]
    expected = list(param.shape)
    cuts: list[tuple[int, int | None, int, int]] = []  # (dim, src start or None: all, dst start, length) in stored elements
    for dim, pack, dst, src, size, full in (
        (layout.output_dim, layout.output_pack, where.row_dst, where.row_src, where.rows, where.full_rows),
        (layout.input_dim, layout.input_pack, 0, where.col_src, where.cols, where.full_cols),
    ):
        if dim is None:
            continue
        expected[dim] = -(-full // pack)
        whole = size == full  # the whole extent is read, so a partial last pack is fine
        if dst % pack or (not whole and (src % pack or size % pack)):
            raise ValueError(
                f"features [{src}, {src + size}) of {full} (placed at {dst}) do not fall on the {pack}-feature "
                "boundaries this parameter is stored in (packed or grouped); choose a tensor_parallel_size that splits them evenly"
            )
        cuts.append((dim, None if whole else src // pack, dst // pack, expected[dim] if whole else size // pack))
    check_shape(param, loaded, tuple(expected))
    source, target = loaded, param.data
    for dim, src, dst, length in cuts:
        if src is not None:
            source = source.narrow(dim, src, length)
        target = target.narrow(dim, dst, length)
    target.copy_(source if isinstance(source, torch.Tensor) else source[...])


class LinearMethod(Protocol):
    """How a linear layer stores its weight and computes ``x W^T + b`` (see the module docstring)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, loader: Any) -> None:
        """Register the layer's weight parameters for a per-rank [output_size, input_size] weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint tensors into what ``apply`` reads (once, after loading)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, input_size] -> x W^T (+ bias) [T, output_size] in x's dtype."""


class UnquantizedLinearMethod:
    """The weight in the model's dtype, one matmul: the full-precision GEMM of every layer lives here."""

    # The product itself; deterministic mode swaps in a batch-invariant one (kernels/batch_invariant.py).
    matmul = staticmethod(F.linear)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, loader: Any) -> None:
        layer.weight = new_param((output_size, input_size), loader, ParamLayout(output_dim=0, input_dim=1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = getattr(layer, "cpu_packed", None)  # on the CPU: the weight pre-packed for oneDNN (cpu_packed.py)
        if packed is not None:
            return packed.linear(x, layer.weight, bias)
        return self.matmul(x, layer.weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along its output dim; each rank returns its slice of y."""

    lora: Any = None  # with LoRA adapters, the update added to y (tokenmill/lora/layers.py)
    cpu_packed: Any = None  # on the CPU, a PackedWeight of the weight (cpu_packed.pack_linear_weights)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        quant_method: LinearMethod | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.output_size_per_partition = divide(output_size, tp_size, "output features")
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_size_per_partition, self.weight_loader)
        self.bias = new_param((self.output_size_per_partition,), self.weight_loader, ParamLayout(output_dim=0)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        size = self.output_size_per_partition
        load_placed(param, loaded_weight, self._placement(0, self.tp_rank * size, size, self.output_size))

    def _placement(self, row_dst: int, row_src: int, rows: int, full_rows: int) -> Placement:
        return Placement(row_dst, row_src, rows, 0, self.input_size, full_rows, self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora(x, y)


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
        quant_method: LinearMethod | None = None,
    ):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, tp_size, "output features")
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, tp_group, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        full = self.output_sizes[shard_id]
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        load_placed(param, loaded_weight, self._placement(offset, self.tp_rank * size, size, full))


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
        quant_method: LinearMethod | None = None,
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
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias, tp_rank, tp_size, tp_group, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id == "q":
            full_rows, start, size, offset = self.total_num_heads, self.tp_rank * self.num_heads, self.num_heads, 0
        elif shard_id in ("k", "v"):
            full_rows, start, size = self.total_num_kv_heads, self.kv_head_start, self.num_kv_heads
            offset = self.num_heads + (0 if shard_id == "k" else self.num_kv_heads)
        else:
            raise ValueError(f"QKV linear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        d = self.head_dim
        load_placed(param, loaded_weight, self._placement(offset * d, start * d, size * d, full_rows * d))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along its input dim; ranks' partial sums are all-reduced.

    The input is expected already split (the output of a column-parallel layer). The bias is
    added once, after the reduction, so it is not counted ``tp_size`` times.
    """

    lora: Any = None  # with LoRA adapters, the update added to the partial sums (tokenmill/lora/layers.py)
    cpu_packed: Any = None  # as ColumnParallelLinear's

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        reduce_results: bool = True,
        quant_method: LinearMethod | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, tp_size, "input features")
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition, output_size, self.weight_loader)
        self.bias = new_param((output_size,), default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        size = self.input_size_per_partition
        where = Placement(0, 0, self.output_size, self.tp_rank * size, size, self.output_size, self.input_size)
        load_placed(param, loaded_weight, where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)
        if self.lora is not None:
            y = self.lora(x, y)
        if self.tp_size > 1 and self.reduce_results:
            torch.distributed.all_reduce(y, group=self.tp_group)
        # Without the reduction the caller sums the ranks' outputs, so only rank 0 adds the bias.
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            y = y + self.bias
        return y
