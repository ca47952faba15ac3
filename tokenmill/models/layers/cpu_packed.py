"""bf16 linear weights kept pre-packed in oneDNN's blocked layout on the CPU.

``F.linear`` on bf16 CPU tensors runs oneDNN's matmul, which first reorders the [N, K] weight
into its blocked layout, on every call: at decode sizes that copy costs about as much as the
product. A step of C1 (SmolLM2-135M, 32 rows; 121 products) took 43.5 ms of products on the
2-core AVX512-BF16 dev machine, 28 ms with the weights reordered once (docs/perf.md 103). The
packed call runs the same kernel on the same blocked weight, so its results are the same bits as
``F.linear``'s (checked at every layer shape the tests use; ``tests/test_cpu_packed.py``).

The packed copy sits beside the weight, which the embedding (tied heads), weight updates, LoRA
and ``apply_model`` keep reading: it doubles the linear weights' memory, so the worker packs
only when that fits beside the KV pool (``pack_linear_weights``). A copy is rebuilt on first use
after its weight changed (``update_weights``, a reload after sleep: the tensor's version moves).
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# The batch size oneDNN is told to pack for; it picks the same layout across 1-512 rows here
# (C1's products within 2% of each other packed for 1, 32 or 256 rows).
_PACK_ROWS = 32


class PackedWeight:
    """One layer's weight in oneDNN's layout, and which version of the weight it was made from."""

    __slots__ = ("_key", "_packed")

    def __init__(self, weight: torch.Tensor) -> None:
        self._key: tuple[int, int] = (0, -1)
        self._packed: torch.Tensor | None = None
        self._current(weight)  # now, so the copy's memory is taken at start-up, not mid-run

    def _current(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight`` as it is now; None if its changes cannot be followed."""
        try:
            key = (weight.data_ptr(), weight._version)
        except RuntimeError:  # an inference tensor keeps no version counter
            return None
        if key != self._key or self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
            self._key = key
        return self._packed

    def drop(self) -> None:
        """Free the copy (its weight was discarded: a level-2 sleep); the next use rebuilds it."""
        self._packed = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, bit for bit, from the packed copy where it applies."""
        packed = None
        # A strided input takes another oneDNN path in F.linear (its bits differ at K = 4,096).
        if x.dtype == weight.dtype and x.device.type == "cpu" and x.is_contiguous() and not torch.is_grad_enabled():
            packed = self._current(weight)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(model: nn.Module) -> Iterator[nn.Module]:
    """Layers whose product is a plain ``F.linear`` of a bf16 CPU weight: the unquantized linear
    layers and the LM head (deterministic mode's batch-invariant products are left as they are)."""
    from tokenmill.models.layers.embedding import ParallelLMHead
    from tokenmill.models.layers.linear import UnquantizedLinearMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        plain = (isinstance(method, UnquantizedLinearMethod) and method.matmul is F.linear) or \
            (isinstance(module, ParallelLMHead) and module.matmul is F.linear)
        weight = getattr(module, "weight", None)
        if plain and isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            yield module


def supported() -> bool:
    """oneDNN's bf16 products run on this CPU (AVX512-BF16 or AMX; not on ARM or older x86)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linear_weights(model: nn.Module, spare_bytes: int) -> int:
    """Give each packable layer of ``model`` a packed copy of its weight, if all of them fit in
    ``spare_bytes``; returns the bytes packed (0: none, and the products stay ``F.linear``)."""
    if not supported():
        return 0
    layers = list(_packable(model))
    total = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    if not layers or total > spare_bytes:
        if layers:
            logger.info("CPU linear weights not pre-packed: %.2f GiB would not fit beside the KV cache (%.2f GiB spare)",
                        total / 2**30, max(spare_bytes, 0) / 2**30)
        return 0
    for layer in layers:
        layer.cpu_packed = PackedWeight(layer.weight)
    return total


def drop_packed_copies(model: nn.Module) -> None:
    """Free every packed copy of ``model`` (their weights are being discarded)."""
    for module in model.modules():
        packed = getattr(module, "cpu_packed", None)
        if packed is not None:
            packed.drop()
