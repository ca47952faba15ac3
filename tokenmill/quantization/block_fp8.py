"""The block-wise FP8 W8A8 linear method: float8 e4m3 weights with an fp32 scale per 128 x 128 block.

Checkpoints: ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` (the block scales named
``weight_scale_inv``, a multiplier despite the name: weight = code * scale over its block) and
compressed-tensors' ``strategy: "block"`` (named ``weight_scale``). The block grid of an
[N, K] weight is [cdiv(N, 128), cdiv(K, 128)]: the last row and column of blocks may be partial.

Stacked projections (q/k/v, gate/up) put each shard's block rows after the previous shard's, so a
shard must start on a 128-row boundary of the stacked weight; a tensor-parallel split must cut
rows (column parallel) or columns (row parallel) on block boundaries, as vLLM requires. Anything
else is refused by the loader, naming the rows or columns.

On a GPU each ``apply`` quantizes the activations per token and 128-feature group
(``quantize_fp8_groups``) and runs ``block_fp8_gemm``. Elsewhere the weight is dequantized once
at load (``dequantize_blocks``) and the layer runs unquantized.

A mixture-of-experts checkpoint's experts (``add_expert_block_scales``) load their codes and block
scales into the stacked expert parameters; after loading each expert is dequantized and, on a GPU,
quantized again per output row for the per-channel fp8 expert kernels: a documented first step
(weight-only GEMMs, a second rounding of each weight), not a block-scaled grouped GEMM.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill import quantization
from tokenmill.models.layers.linear import LoadedWeight, ParamLayout, Placement, UnquantizedLinearMethod, new_param
from tokenmill.quantization.config import WEIGHT_BLOCK, Fp8Scheme


def _blocks(features: int) -> int:
    return -(-features // WEIGHT_BLOCK)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K] float8 e4m3 and scales [..., cdiv(N, 128), cdiv(K, 128)] -> the fp32 weight:
    each code times the scale of its block."""
    n, k = codes.shape[-2:]
    expanded = scales.float().repeat_interleave(WEIGHT_BLOCK, dim=-2)[..., :n, :]
    expanded = expanded.repeat_interleave(WEIGHT_BLOCK, dim=-1)[..., :k]
    return codes.float() * expanded


class BlockFp8LinearMethod:
    """fp8 weights with block scales; activations quantized per token and 128-group (see the module docstring)."""

    def __init__(self, scheme: Fp8Scheme):
        if scheme.weight_scales != "block" or scheme.activations != "dynamic":
            raise ValueError(f"BlockFp8LinearMethod runs block weight scales with dynamic activations, got {scheme}")
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, loader: Any) -> None:
        self.dtype = torch.get_default_dtype()
        layer.weight = new_param((output_size, input_size), loader, ParamLayout(0, 1), dtype=torch.float8_e4m3fn)
        layer.weight.checkpoint_dtype = torch.float8_e4m3fn  # type: ignore[attr-defined]  # codes, not values
        scales = new_param((_blocks(output_size), _blocks(input_size)), loader, None, dtype=torch.float32)
        scales.place = _place_block_scales  # type: ignore[attr-defined]
        scales.dummy_init = lambda data, generator: data.fill_(1.0)  # type: ignore[attr-defined]
        setattr(layer, self.scheme.block_scale_name, scales)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        name = self.scheme.block_scale_name
        weight, scales = layer.weight.data, getattr(layer, name).data.float()
        delattr(layer, name)
        if not quantization.runs_kernels(weight.device):
            layer.weight = nn.Parameter(dequantize_blocks(weight, scales).to(self.dtype), requires_grad=False)
            layer.quant_method = UnquantizedLinearMethod()
            return
        from tokenmill.kernels.triton.fp8_gemm import counters_needed

        layer.register_buffer("weight_scale_blocks", scales.contiguous(), persistent=False)
        layer.register_buffer("splitk_counters", torch.zeros(counters_needed(weight.shape[0]), dtype=torch.int32,
                                                             device=weight.device), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] in the model dtype -> [..., N] in x's dtype."""
        from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm, quantize_fp8_groups

        lead, k = x.shape[:-1], x.shape[-1]
        xq, x_scale = quantize_fp8_groups(x.reshape(-1, k), WEIGHT_BLOCK)
        y = block_fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale_blocks, bias, x.dtype, layer.splitk_counters)
        return y.reshape(*lead, y.shape[-1])


def _place_block_scales(param: nn.Parameter, loaded: LoadedWeight, where: Placement) -> None:
    """This rank's block rows and columns of a [cdiv(N, 128), cdiv(K, 128)] scale tensor, after
    checking that its shard and its tensor-parallel cut fall on block boundaries."""
    b = WEIGHT_BLOCK
    expected = (_blocks(where.full_rows), _blocks(where.full_cols))
    if tuple(loaded.shape) != expected:
        raise ValueError(f"block scales have shape {tuple(loaded.shape)}; expected {list(expected)}: one per "
                         f"{b}x{b} block of the [{where.full_rows}, {where.full_cols}] weight")
    if where.row_dst % b:
        raise ValueError(f"a projection stacked at row {where.row_dst} of a merged block-quantized fp8 layer does "
                         f"not start on a {b}-row block boundary: the projections stacked into one matmul (q/k/v, "
                         f"gate/up) need row counts (per tensor-parallel rank) that are multiples of {b}")
    for what, src, size, full in (("output rows", where.row_src, where.rows, where.full_rows),
                                  ("input columns", where.col_src, where.cols, where.full_cols)):
        if size != full and (src % b or size % b):
            raise ValueError(f"tensor parallelism gives this rank {what} [{src}, {src + size}) of {full}, which cut "
                             f"a {b}x{b} fp8 weight block; choose a tensor_parallel_size that splits the {full} "
                             f"{what} into multiples of {b}")
    part = loaded.narrow(0, where.row_src // b, _blocks(where.rows)) if where.rows != where.full_rows else loaded
    part = part.narrow(1, where.col_src // b, _blocks(where.cols)) if where.cols != where.full_cols else part
    rows = _blocks(where.rows)
    param.data[where.row_dst // b : where.row_dst // b + rows].copy_(part if isinstance(part, torch.Tensor) else part[...])


def add_expert_block_scales(experts: nn.Module) -> None:
    """Block-wise fp8 experts (HF's ``weight_block_size`` in a MoE checkpoint, Qwen3-30B-A3B-FP8):
    ``experts``' stacked ``w13`` / ``w2`` take the checkpoint's fp8 codes as they are, and its
    ``weight_scale_inv`` tensors fill ``w13_scale_inv`` [E, 2 (gate, up), cdiv(I_rank, 128),
    cdiv(H, 128)] and ``w2_scale_inv`` [E, cdiv(H, 128), cdiv(I_rank, 128)] (the stacking's name
    fragments ``experts.{e}.gate_proj.weight`` map ``...weight_scale_inv`` onto them). After loading,
    ``_BlockFp8Experts`` dequantizes each expert's blocks and, on a GPU, quantizes its rows again for
    the per-channel fp8 expert kernels (a first step: weight-only, the block structure not kept)."""
    i_full, i_rank, h = experts.intermediate_size, experts.rank_size, experts.hidden_size
    if i_rank != i_full and i_rank % WEIGHT_BLOCK:
        raise ValueError(f"tensor parallelism gives each rank {i_rank} of the experts' {i_full} intermediate features, "
                         f"which cuts a {WEIGHT_BLOCK}x{WEIGHT_BLOCK} fp8 weight block; choose a tensor_parallel_size "
                         f"that splits them into multiples of {WEIGHT_BLOCK}")
    for codes in (experts.w13, experts.w2):
        codes.checkpoint_dtype = torch.float8_e4m3fn  # type: ignore[attr-defined]
    start = experts.tp_rank * i_rank // WEIGHT_BLOCK

    def load_w13(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any) -> None:
        expert, part = experts._shard(shard_id, (0, 1))
        _check_expert_scales(loaded, (_blocks(i_full), _blocks(h)), (i_full, h))
        part_scales = loaded.narrow(0, start, _blocks(i_rank))
        param.data[expert, part].copy_(part_scales if isinstance(part_scales, torch.Tensor) else part_scales[...])

    def load_w2(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any) -> None:
        expert, _ = experts._shard(shard_id, (None,))
        _check_expert_scales(loaded, (_blocks(h), _blocks(i_full)), (h, i_full))
        part_scales = loaded.narrow(1, start, _blocks(i_rank))
        param.data[expert].copy_(part_scales if isinstance(part_scales, torch.Tensor) else part_scales[...])

    e = experts.num_experts
    experts.w13_scale_inv = new_param((e, 2, _blocks(i_rank), _blocks(h)), load_w13, None, dtype=torch.float32)
    experts.w2_scale_inv = new_param((e, _blocks(h), _blocks(i_rank)), load_w2, None, dtype=torch.float32)
    for scales in (experts.w13_scale_inv, experts.w2_scale_inv):
        scales.dummy_init = lambda data, generator: data.fill_(1.0)  # type: ignore[attr-defined]
    experts.quant_method = _BlockFp8Experts()  # the loader calls its process_weights_after_loading


def _check_expert_scales(loaded: LoadedWeight, expected: tuple[int, int], weight: tuple[int, int]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"expert block scales have shape {tuple(loaded.shape)}; expected {list(expected)}: one per "
                         f"{WEIGHT_BLOCK}x{WEIGHT_BLOCK} block of the {list(weight)} weight")


class _BlockFp8Experts:
    """After loading: each expert's fp8 blocks dequantized (fp32); on a GPU quantized again per output
    row (``fp8.quantize_rows``, ``Experts.fp8``: the kernels' per-channel scales), elsewhere kept in
    the model's dtype, after which the layer runs as an unquantized one."""

    def process_weights_after_loading(self, experts: nn.Module) -> None:
        from tokenmill.quantization.fp8 import quantize_rows

        kernels = quantization.runs_kernels(experts.w13.device)
        i = experts.rank_size
        s13, s2 = experts.w13_scale_inv.data, experts.w2_scale_inv.data
        del experts.w13_scale_inv, experts.w2_scale_inv, experts.quant_method
        w13, w2 = experts.w13, experts.w2
        if kernels:
            experts.register_buffer("w13_scale", torch.empty(w13.shape[:2], dtype=torch.float32, device=w13.device),
                                    persistent=False)
            experts.register_buffer("w2_scale", torch.empty(w2.shape[:2], dtype=torch.float32, device=w2.device),
                                    persistent=False)
        else:
            full13 = torch.empty(w13.shape, dtype=experts.dtype, device=w13.device)
            full2 = torch.empty(w2.shape, dtype=experts.dtype, device=w2.device)
        for e in range(experts.num_experts):  # one expert at a time: no fp32 copy of the whole layer
            up_gate = torch.cat([dequantize_blocks(w13.data[e, :i], s13[e, 0]), dequantize_blocks(w13.data[e, i:], s13[e, 1])])
            down = dequantize_blocks(w2.data[e], s2[e])
            if kernels:
                w13.data[e], experts.w13_scale[e] = quantize_rows(up_gate)
                w2.data[e], experts.w2_scale[e] = quantize_rows(down)
            else:
                full13[e], full2[e] = up_gate, down
        experts.fp8 = kernels
        if not kernels:
            for name, full in (("w13", full13), ("w2", full2)):
                dequantized = nn.Parameter(full, requires_grad=False)
                dequantized.weight_loader = getattr(experts, name).weight_loader  # type: ignore[attr-defined]
                setattr(experts, name, dequantized)
