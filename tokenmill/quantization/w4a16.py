"""The W4A16 linear method: 4-bit weights from compressed-tensors, GPTQ or AWQ checkpoints.

The layer gets the checkpoint's own tensors under their own names (so loading, tensor-parallel
slicing included, is the layers' generic ``load_placed`` with each tensor's packing described by
a ParamLayout); ``process_weights_after_loading`` converts them to our one layout
(``int4.Int4Weights``). On a GPU the weight stays packed (repacked once into the kernel's
tile-interleaved order) and ``apply`` runs the Triton W4A16 GEMM for up to 64 tokens, and for more
(prefill, large decode batches) dequantizes it into a scratch that lives for one call (torch's caching allocator hands the
same block to every layer, so no layer keeps a full-precision copy) and calls cuBLAS; elsewhere it
is dequantized once into the model's dtype and the layer becomes an ordinary unquantized one
(correct, not fast).

Activation-order checkpoints (``Int4Scheme.act_order``) bring each feature's group in ``g_idx``
(compressed-tensors: ``weight_g_idx``), split with the input features like the codes; a
row-parallel rank then keeps every group's scales and zero points, since its features may belong to
any group. The projections stacked into one layer (q/k/v, gate/up) must share one g_idx (they do
when quantized from the same inputs). On a GPU the features are reordered group by group at load
(``int4.group_contiguous``) and ``apply`` gathers the input's columns in the same order first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill import quantization
from tokenmill.models.layers.linear import (LoadedWeight, ParamLayout, Placement, UnquantizedLinearMethod, load_placed,
                                           new_param)
from tokenmill.quantization import int4
from tokenmill.quantization.config import Int4Scheme

# Dummy weights (load_format="dummy"): random codes around zero point 8 times this scale have a
# standard deviation near 0.02, like the full-precision dummy weights.
_DUMMY_SCALE = 0.02 / 4.6


class W4A16LinearMethod:
    def __init__(self, scheme: Int4Scheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, loader: Any) -> None:
        n, k, g = output_size, input_size, self.scheme.group_size
        groups = 1 if g == -1 else -(-k // g)
        per_group = g if g != -1 else 1  # per channel: the group dim is not split (ParamLayout input_dim None)
        self.dtype = torch.get_default_dtype()
        self.in_features = k
        layout = self.scheme.layout
        self.act_order = self.scheme.act_order
        if layout == "compressed-tensors":
            params: dict[str, tuple[tuple[int, ...], torch.dtype, ParamLayout]] = {
                "weight_packed": ((n, -(-k // 8)), torch.int32, ParamLayout(0, 1, 1, 8)),
                "weight_scale": ((n, groups), torch.float32, ParamLayout(0, 1 if g != -1 else None, 1, per_group)),
            }
            if not self.scheme.symmetric:
                params["weight_zero_point"] = ((-(-n // 8), groups), torch.int32, ParamLayout(0, 1 if g != -1 else None, 8, per_group))
        else:
            qweight = ((-(-k // 8), n), ParamLayout(1, 0, 1, 8)) if layout == "gptq" else ((k, -(-n // 8)), ParamLayout(1, 0, 8, 1))
            params = {
                "qweight": (qweight[0], torch.int32, qweight[1]),
                "qzeros": ((groups, -(-n // 8)), torch.int32, ParamLayout(1, 0 if g != -1 else None, 8, per_group)),
                "scales": ((groups, n), torch.float32, ParamLayout(1, 0 if g != -1 else None, 1, per_group)),
            }
        for name, (shape, dtype, param_layout) in params.items():
            param = new_param(shape, loader, param_layout, dtype=dtype)
            param.dummy_init = _dummy_init(name, self.scheme)  # type: ignore[attr-defined]
            if self.act_order and g != -1 and name in ("weight_scale", "weight_zero_point", "qzeros", "scales"):
                param.place = _place_every_group  # type: ignore[attr-defined]
            setattr(layer, name, param)
        if layout == "compressed-tensors":
            layer.weight_shape = _checked_param((2,), torch.int64, loader, _place_weight_shape)
            if self.act_order:
                layer.weight_g_idx = _g_idx_param(k, g, loader, self._place_g_idx)
        elif layout == "gptq":
            layer.g_idx = _g_idx_param(k, g, loader, self._place_g_idx)
            # Some desc_act=False exports leave g_idx out: the plain order it would have to be anyway.
            layer.g_idx.checkpoint_optional = not self.act_order  # type: ignore[attr-defined]

    def _place_g_idx(self, param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
        full, g = where.full_cols, self.scheme.group_size if self.scheme.group_size != -1 else where.full_cols
        if tuple(loaded.shape) != (full,):
            raise ValueError(f"g_idx has shape {tuple(loaded.shape)}, the layer has {full} input features")
        idx = loaded[...].to(torch.int64)
        if not self.act_order:
            # desc_act=False checkpoints still save g_idx; it must be the plain order feature // group.
            if not torch.equal(idx, torch.arange(full) // g):
                raise ValueError("g_idx is not the plain group order, but quantization_config says the checkpoint is "
                                 "not in activation order (GPTQ desc_act=false); set desc_act=true if it is")
            return
        groups = -(-full // g)
        if bool(((idx < 0) | (idx >= groups)).any()):
            raise ValueError(f"g_idx holds groups outside 0..{groups - 1} ({full} features in groups of {g})")
        mine = idx[where.col_src : where.col_src + where.cols]  # this rank's input features
        if param.is_meta:
            return
        if getattr(param, "parts_loaded", False) and not torch.equal(param.data.to(torch.int64), mine):
            raise ValueError("g_idx differs from the g_idx of a projection stacked with it into one matmul (q/k/v or "
                             "gate/up); tokenmill needs them alike (one reordering of the input serves the whole layer)")
        param.data.copy_(mine)
        param.parts_loaded = True  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s, k = self.scheme, self.in_features
        if s.layout == "compressed-tensors":
            zero_point = getattr(layer, "weight_zero_point", None)
            g_idx = layer.weight_g_idx.data if self.act_order else None
            weights = int4.from_compressed_tensors(layer.weight_packed.data, layer.weight_scale.data,
                                                   None if zero_point is None else zero_point.data, k, s.group_size, g_idx)
            names = ["weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"]
        elif s.layout == "gptq":
            g_idx = layer.g_idx.data if self.act_order else None
            weights = int4.from_gptq(layer.qweight.data, layer.qzeros.data, layer.scales.data, k, s.group_size,
                                     s.gptq_zeros_minus_one, g_idx)
            names = ["qweight", "qzeros", "scales", "g_idx"]
        else:
            weights = int4.from_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, k, s.group_size)
            names = ["qweight", "qzeros", "scales"]
        for name in names:
            if hasattr(layer, name):
                delattr(layer, name)
        if not quantization.runs_kernels(weights.qweight.device):
            # CPU: dequantize once; from now on this is an ordinary full-precision layer.
            layer.weight = nn.Parameter(weights.dequantize(self.dtype), requires_grad=False)
            layer.quant_method = UnquantizedLinearMethod()
            return
        from tokenmill.kernels.triton.w4a16_gemm import counters_needed, pack_for_kernel

        weights, index = int4.group_contiguous(weights)
        # The input's columns in the reordered features' order (None: as they are); past K, padding
        # features that read a zero column appended to the input.
        layer.register_buffer("input_order", index, persistent=False)
        self.pads_input = index is not None and len(index) > k
        # The narrowest float that holds the checkpoint's scales exactly (GPTQ's fp16, compressed-tensors'
        # model dtype); fp32 rather than rounding them. The kernel reads any of them.
        exact = [dt for dt in (torch.bfloat16, torch.float16) if torch.equal(weights.scales.to(dt).float(), weights.scales)]
        scales = weights.scales.to(exact[0] if exact else torch.float32)
        # Repacked once for the kernel (tile-interleaved K: see kernels/triton/w4a16_gemm.py).
        layer.register_buffer("qweight_tiles", pack_for_kernel(weights.qweight, weights.in_features), persistent=False)
        layer.register_buffer("scales_gn", scales.contiguous(), persistent=False)
        layer.register_buffer("zeros_gn", weights.zeros, persistent=False)
        layer.register_buffer("splitk_counters", torch.zeros(counters_needed(weights.qweight.shape[1]), dtype=torch.int32,
                                                             device=weights.qweight.device), persistent=False)
        self.group_size = weights.group_size

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from tokenmill.kernels.triton.w4a16_gemm import w4a16_linear

        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if layer.input_order is not None:
            if self.pads_input:
                x = torch.nn.functional.pad(x, (0, 1))
            x = x.index_select(1, layer.input_order)
        y = w4a16_linear(x, layer.qweight_tiles, layer.scales_gn, layer.zeros_gn, self.group_size,
                         bias, layer.splitk_counters)
        return y.reshape(*lead, y.shape[-1])


def _checked_param(shape: tuple[int, ...], dtype: torch.dtype, loader: Any, place: Any) -> nn.Parameter:
    """A checkpoint tensor that is only checked while loading, then dropped (kept as a parameter so
    the loader expects it and counts it)."""
    param = new_param(shape, loader, None, dtype=dtype)
    param.place = place  # type: ignore[attr-defined]
    param.dummy_init = lambda data, generator: None  # type: ignore[attr-defined]
    return param


def _g_idx_param(k: int, group_size: int, loader: Any, place: Any) -> nn.Parameter:
    """Each input feature's group: split with the input features, checked while loading."""
    param = new_param((k,), loader, ParamLayout(input_dim=0), dtype=torch.int32)
    param.place = place  # type: ignore[attr-defined]
    plain = torch.arange(k) // (k if group_size == -1 else group_size)  # dummy weights: the plain order
    param.dummy_init = lambda data, generator: data.copy_(plain)  # type: ignore[attr-defined]
    return param


def _place_every_group(param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
    """An act-order layer's scales or zero points: every group's, also on a row-parallel rank (whose
    input features may belong to any group); the output features are split as usual."""
    if where.cols != where.full_cols:
        layout: ParamLayout = param.feature_layout  # type: ignore[attr-defined]
        where = Placement(where.row_dst, where.row_src, where.rows, 0, where.full_cols, where.full_rows, where.full_cols)
        shape = list(param.shape)
        shape[layout.input_dim] = -(-where.full_cols // layout.input_pack)  # type: ignore[index]
        if list(param.shape) != shape:
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
    whole = nn.Parameter(param.data, requires_grad=False)  # the same storage, without this hook
    whole.feature_layout = param.feature_layout  # type: ignore[attr-defined]
    load_placed(whole, loaded, where)


def _place_weight_shape(param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
    shape = tuple(int(v) for v in loaded[...].tolist())
    if shape != (where.full_rows, where.full_cols):
        raise ValueError(f"weight_shape says {shape}, the model expects {(where.full_rows, where.full_cols)}")


def _dummy_init(name: str, scheme: Int4Scheme) -> Any:
    """Random codes, scales near _DUMMY_SCALE (fp16 values, as GPTQ stores them), and zero points that
    are 8 for symmetric schemes (stored as 7 by GPTQ's v1 format) and random otherwise."""
    if name in ("weight_scale", "scales"):
        return _dummy_scales
    if name in ("qzeros", "weight_zero_point") and scheme.symmetric:
        stored = 8 - int(scheme.gptq_zeros_minus_one)
        word = sum(stored << (4 * j) for j in range(8))
        return lambda data, generator: data.fill_(word - 2**32 if word >= 2**31 else word)
    return _dummy_bits


def _dummy_bits(data: torch.Tensor, generator: torch.Generator) -> None:
    data.copy_(torch.randint(-(2**31), 2**31 - 1, data.shape, generator=generator, device=data.device, dtype=torch.int64))


def _dummy_scales(data: torch.Tensor, generator: torch.Generator) -> None:
    noise = torch.rand(data.shape, generator=generator, device=data.device, dtype=torch.float32)
    data.copy_(((0.75 + 0.5 * noise) * _DUMMY_SCALE).half())
