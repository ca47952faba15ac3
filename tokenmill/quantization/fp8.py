"""The FP8 W8A8 linear method: float8 e4m3 weights with per-output-channel fp32 scales.

Weights come from an fp8 checkpoint (compressed-tensors ``float-quantized``, ``quant_method:
"fp8"``) or are quantized while loading (``quantization="fp8"``: each row's scale is its largest
magnitude over 448, computed shard by shard as the loader hands the rows over, so no
full-precision copy of the model is ever held). Per-tensor checkpoint scales are spread over the
rows of their shard, so q/k/v or gate/up stacked with different scales stay exact.

On a GPU each ``apply`` quantizes the activations to fp8 (a scale per token, or the checkpoint's
static input scale) in one Triton launch and multiplies on the fp8 tensor cores: our swapped,
split-K Triton GEMM at decode sizes (``fp8_gemm.runs_swapped``); otherwise ``torch._scaled_mm``
for bf16 outputs with K and N multiples of 16 (with per-row scales on sm90 that is torch's
CUTLASS kernel, run with fast accumulation as vLLM runs its own), or our plain Triton tiles.
Elsewhere the weight is dequantized once and the layer runs unquantized.

With per-token scales, the kernel before a linear can do that quantization itself (the RMSNorms
before qkv and gate_up, for free; the SiLU-and-mul before down_proj leaves its blocks' maxima for
a quantization a program a block, docs/perf.md 42; ``takes_quantized_input`` says whether the
linear accepts it); it then hands the linear a ``QuantizedActivation`` instead of a tensor, and
``apply`` goes straight to the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill import quantization
from tokenmill.models.layers.linear import LoadedWeight, ParamLayout, Placement, UnquantizedLinearMethod, new_param
from tokenmill.quantization.config import Fp8Scheme

FP8_MAX = 448.0
# fp8 tensor-core products accumulated without the periodic promotion to a separate fp32 sum: on
# sm90 torch then takes its FastAccum CUTLASS schedules, ping-pong for large tiles (without it:
# cooperative for large tiles, plain warp-specialized for small ones). vLLM's sm90 fp8
# GEMM past 128 tokens uses a FastAccum ping-pong schedule too, so the numerics match what its
# users already accept; docs/perf.md entry 26.
FAST_ACCUM = True


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (float8 e4m3 [..., N, K], fp32 scales [..., N]): each row scaled so its largest
    magnitude is 448 (compressed-tensors' symmetric per-channel float8 quantization); stacked
    experts' weights [E, N, K] get a scale per expert and output channel."""
    w = weight.float()
    scales = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


@dataclass(frozen=True)
class QuantizedActivation:
    """A linear layer's input already quantized to fp8 by the kernel that produced it: codes
    [rows, K] float8 e4m3 and fp32 scales [rows] (one per token)."""

    codes: torch.Tensor
    scales: torch.Tensor


def takes_quantized_input(linear: nn.Module | None) -> bool:
    """Whether ``linear`` runs the fp8 kernels with a scale per token, so the kernel before it may hand
    it a QuantizedActivation. False when it takes its input in the model dtype: unquantized, another
    scheme, an fp8 layer dequantized at load off the GPU, or one with a static input_scale. Fixed
    once weights are loaded, so a CUDA graph's capture and replays take the same path."""
    if not isinstance(getattr(linear, "quant_method", None), Fp8LinearMethod):
        return False  # (off the GPU, loading swapped the fp8 method for the unquantized one)
    if getattr(linear, "lora", None) is not None:
        return False  # its LoRA update reads the input in the model dtype
    # A static input_scale is applied by the layer's own quantize_fp8: fused into add+RMSNorm, it gave
    # other codes than that on the H200 (hidden 4096, M 1024), though not in the CPU interpreter.
    return not hasattr(linear, "input_scale")


class Fp8LinearMethod:
    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, loader: Any) -> None:
        self.dtype = torch.get_default_dtype()
        layer.weight = new_param((output_size, input_size), loader, ParamLayout(0, 1), dtype=torch.float8_e4m3fn)
        if self.scheme.quantize_at_load:
            # Not a checkpoint tensor: a buffer, filled as the weight's rows are quantized.
            layer.register_buffer("weight_scale", torch.empty(output_size, dtype=torch.float32), persistent=False)
            layer.weight.place = lambda param, loaded, where: _quantize_into(layer, loaded, where)  # type: ignore[attr-defined]
            layer.weight.dummy_init = lambda data, generator: fill_random_fp8(data, layer.weight_scale, generator)  # type: ignore[attr-defined]
            return
        layer.weight.checkpoint_dtype = torch.float8_e4m3fn  # type: ignore[attr-defined]  # codes, not values
        layer.weight_scale = new_param((output_size,), loader, None, dtype=torch.float32)
        layer.weight_scale.place = _place_weight_scale  # type: ignore[attr-defined]
        layer.weight_scale.dummy_init = lambda data, generator: data.fill_(1.0)  # type: ignore[attr-defined]
        if self.scheme.activations == "static":
            layer.input_scale = new_param((1,), loader, None, dtype=torch.float32)
            layer.input_scale.data.zero_()  # the loader keeps the largest of the stacked shards' scales
            layer.input_scale.place = _place_input_scale  # type: ignore[attr-defined]
            layer.input_scale.dummy_init = lambda data, generator: data.fill_(0.05)  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = layer.weight.data, layer.weight_scale.data.float()
        del layer.weight_scale
        if not quantization.runs_kernels(weight.device):
            layer.weight = nn.Parameter((weight.float() * scale[:, None]).to(self.dtype), requires_grad=False)
            if hasattr(layer, "input_scale"):
                del layer.input_scale
            layer.quant_method = UnquantizedLinearMethod()
            return
        from tokenmill.kernels.triton.fp8_gemm import counters_needed

        layer.register_buffer("weight_scale", scale.contiguous(), persistent=False)
        n, k = weight.shape
        layer.register_buffer("splitk_counters", torch.zeros(counters_needed(n), dtype=torch.int32, device=weight.device),
                              persistent=False)
        self.use_scaled_mm = self.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and hasattr(torch, "_scaled_mm")

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] in the model dtype, or already quantized by the kernel before (see takes_quantized_input)."""
        from tokenmill.kernels.triton.fp8_gemm import fp8_gemm, quantize_fp8, runs_swapped
        from tokenmill.kernels.triton.sm_count import num_sms

        if isinstance(x, QuantizedActivation):
            xq, x_scale, lead, out_dtype = x.codes, x.scales, x.codes.shape[:-1], self.dtype
        else:
            lead, k, out_dtype = x.shape[:-1], x.shape[-1], x.dtype
            xq, x_scale = quantize_fp8(x.reshape(-1, k), getattr(layer, "input_scale", None))
        if self.use_scaled_mm and not runs_swapped(xq.shape[0], layer.weight.shape[0], num_sms(xq.device)):
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale[:, None], scale_b=layer.weight_scale[None, :],
                                 out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)
            if bias is not None:
                y = y + bias
        else:
            y = fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, bias, out_dtype, layer.splitk_counters)
        return y.reshape(*lead, y.shape[-1])


def _rows_of(loaded: LoadedWeight, where: Placement) -> torch.Tensor:
    """This rank's [rows, cols] part of a full-precision checkpoint weight."""
    if tuple(loaded.shape) != (where.full_rows, where.full_cols):
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"expected {(where.full_rows, where.full_cols)}")
    part = loaded.narrow(0, where.row_src, where.rows) if where.rows != where.full_rows else loaded[...]
    return part.narrow(1, where.col_src, where.cols) if where.cols != where.full_cols else part


def _quantize_into(layer: nn.Module, loaded: LoadedWeight, where: Placement) -> None:
    codes, scales = quantize_rows(_rows_of(loaded, where).to(layer.weight.device))
    layer.weight.data[where.row_dst : where.row_dst + where.rows] = codes
    layer.weight_scale[where.row_dst : where.row_dst + where.rows] = scales


def fill_random_fp8(codes: torch.Tensor, scales: torch.Tensor, generator: torch.Generator) -> None:
    """load_format="dummy" for weights quantized while loading: N(0, 0.02) values (the unquantized
    layers' dummy draw) quantized per row into ``codes`` [..., N, K] and ``scales`` [..., N]."""
    values = torch.randn(codes.shape, generator=generator, device=codes.device) * 0.02
    new_codes, new_scales = quantize_rows(values)
    codes.copy_(new_codes)
    scales.copy_(new_scales)


def _place_weight_scale(param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
    """A per-tensor scale ([] or [1]) fills the shard's rows; a per-channel one ([N] or [N, 1]) is sliced."""
    rows = param.data[where.row_dst : where.row_dst + where.rows]
    if loaded.shape in ((), (1,)):
        rows.fill_(float(loaded[...].reshape(())))
        return
    if tuple(loaded.shape) not in ((where.full_rows,), (where.full_rows, 1)):
        raise ValueError(f"weight_scale has shape {tuple(loaded.shape)}; expected [], [1], [{where.full_rows}] "
                         f"or [{where.full_rows}, 1] (per-tensor or per-channel)")
    rows.copy_(loaded.narrow(0, where.row_src, where.rows).reshape(-1))


def _place_input_scale(param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
    # q/k/v (gate/up) share one input, so one activation scale: the largest is safe for all of them.
    if loaded.shape not in ((), (1,)):
        raise ValueError(f"input_scale has shape {tuple(loaded.shape)}; expected a per-tensor scale ([] or [1])")
    param.data.clamp_(min=float(loaded[...].reshape(())))

