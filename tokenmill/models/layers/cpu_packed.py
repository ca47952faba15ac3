"""Linear weights kept pre-packed in oneDNN's blocked layout on the CPU (bf16 and fp32).

``F.linear`` on bf16 CPU tensors runs oneDNN's matmul, which first reorders the [N, K] weight into
its blocked layout, on every call: at decode sizes that copy costs about as much as the product.
Reordering once and calling the packed primitive runs the same kernel on the same blocked weight,
so bf16 results are ``F.linear``'s bits (checked at the tests' layer shapes). fp32 ``F.linear``
runs MKL's sgemm instead; the packed oneDNN product sums in another order (a few ulps apart; the
tests against transformers' fp32 hold) and is ~2x faster at decode sizes. C1 on the 2-core
AVX512-BF16 dev machine: a step's 121 products 43.5 -> ~28 ms in bf16 (docs/perf.md 103).

The packed copy sits beside the weight, which the embedding (tied heads), weight updates, LoRA
and ``apply_model`` keep reading: it doubles the linear weights' memory, so the worker packs only
when that fits beside the KV pool (``pack_linear_weights``). A copy is made again on its first use
after its weight changed: ``load_weights`` (checkpoint loads, ``update_weights``) and in-place ops
move the weight's version counter; a write through ``.data`` does not, so the worker drops every
copy after code it does not know ran against the model (``Worker._drop_packed_weights``).
"""

from __future__ import annotations

import logging
import platform
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
        """Free the copy (its weight is discarded, or may have changed unseen); the next use makes it again."""
        self._packed = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` from the packed copy where it applies (bit for bit in bf16)."""
        packed = None
        # A strided input takes another oneDNN path in F.linear (its bits differ at K = 4,096).
        if x.dtype == weight.dtype and x.device.type == "cpu" and x.is_contiguous() and not torch.is_grad_enabled():
            packed = self._current(weight)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(model: nn.Module) -> Iterator[nn.Module]:
    """Layers whose product is a plain ``F.linear`` of a CPU weight oneDNN can pack: the unquantized
    linear layers and the LM head (deterministic mode's batch-invariant products are left as they are)."""
    from tokenmill.models.layers.embedding import ParallelLMHead
    from tokenmill.models.layers.linear import UnquantizedLinearMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        plain = (isinstance(method, UnquantizedLinearMethod) and method.matmul is F.linear) or \
            (isinstance(module, ParallelLMHead) and module.matmul is F.linear)
        weight = getattr(module, "weight", None)
        if plain and isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and supported(weight.dtype):
            yield module


def supported(dtype: torch.dtype) -> bool:
    """oneDNN's packed products for ``dtype`` on this CPU: x86 (measured there only), with
    AVX512-BF16 or AMX for bf16."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module, spare_bytes: int) -> int:
    """Give each packable layer of ``model`` a packed copy of its weight, if all of them fit in
    ``spare_bytes``; returns the bytes packed (0: none, and the products stay ``F.linear``)."""
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
    """Free every packed copy of ``model`` (their weights are discarded, or may have changed unseen)."""
    for module in model.modules():
        packed = getattr(module, "cpu_packed", None)
        if packed is not None:
            packed.drop()
