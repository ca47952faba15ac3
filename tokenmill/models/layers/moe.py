"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, each a SwiGLU MLP, and the token's output is their outputs weighted by the router.

Every expert's weights are stacked into two parameters, so the whole layer is two grouped
matmuls however many experts there are: ``w13`` [E, 2 I, H] (each expert's gate rows, then its
up rows) and ``w2`` [E, H, I] (down). Under tensor parallelism each rank keeps the same slice of
every expert's intermediate features, as a dense SwiGLU MLP is split (gate/up by rows, down by
columns), and the ranks' partial outputs are summed by one all-reduce; the router is replicated,
so every rank routes every token the same way.

On a GPU the experts run in two Triton grouped GEMMs (``kernels/triton/fused_moe.py``) whose
launch shapes depend only on the token count, so a decode step's MoE layers are captured in its
CUDA graph like any other layer. On the CPU a loop over the experts that received tokens does the
same arithmetic with ``F.linear``.

The routing follows Hugging Face: router logits in the model's dtype, softmax in float32, top-k,
then (Mixtral always; the Qwen models when ``norm_topk_prob``) renormalised over the k chosen; on a
GPU one Triton launch does all but the logits' GEMM (``kernels/triton/moe_routing.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear import LoadedWeight, check_shape, default_weight_loader, divide, new_param

# The checkpoint's names for an expert's three projections, by architecture family:
# (gate, up, down) under ``experts.{e}.``.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def expert_stacking(num_experts: int, names: tuple[str, str, str] = QWEN_EXPERT_NAMES) -> list[tuple[str, str, Any]]:
    """``weights.load_hf_weights``'s stacked fragments for the experts: each expert's gate and up
    fill its rows of ``w13``, its down fills its slice of ``w2``. A dot follows each expert's index,
    so the fragments of expert 1 never match inside expert 12's names."""
    gate, up, down = names
    stacking: list[tuple[str, str, Any]] = []
    for e in range(num_experts):
        stacking += [(".experts.w13", f".experts.{e}.{gate}.weight", (e, 0)),
                     (".experts.w13", f".experts.{e}.{up}.weight", (e, 1)),
                     (".experts.w2", f".experts.{e}.{down}.weight", (e, None))]
    return stacking


class Router(nn.Module):
    """The replicated [E, H] gate: which experts each token goes to, and with what weight."""

    matmul = staticmethod(F.linear)  # deterministic mode points it at batch_invariant_linear

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = new_param((num_experts, hidden_size), default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = self.matmul(x, self.weight)
        if logits.is_cuda:  # the same steps in one launch (kernels/triton/moe_routing.py)
            from tokenmill.kernels.triton.moe_routing import route_top_k

            return route_top_k(logits, self.top_k, self.renormalize)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def compile_variants(self) -> None:
        """Compile the routing kernel's one variant (GPU only; ``SparseMoeBlock.precompile``)."""
        if not self.weight.is_cuda:
            return
        from tokenmill.kernels.triton.moe_routing import route_top_k

        logits = torch.empty((1, self.weight.shape[0]), dtype=self.weight.dtype, device=self.weight.device)
        route_top_k(logits, self.top_k, self.renormalize, compile_only=True)


class Experts(nn.Module):
    """E SwiGLU experts, stacked: ``w13`` [E, 2 I_rank, H] and ``w2`` [E, H, I_rank].

    ``matmul``: the CPU loop's product; deterministic mode points it at ``batch_invariant_linear``,
    and on a GPU that also asks the grouped GEMMs for one fixed tile and the k pairs' sum for one
    fixed order, so a token's output does not depend on the others in the step.

    ``fp8`` (``quantization="fp8"``): each expert's rows are quantized to float8 e4m3 as the loader
    hands them over, a scale per output channel (``w13_scale`` [E, 2 I_rank], ``w2_scale`` [E, H];
    the dense layers' rule, ``quantization.fp8.quantize_rows``), so no full-precision copy is held.
    ``block_fp8`` (a block-wise fp8 checkpoint): the checkpoint's codes and block scales, dequantized
    and (on a GPU) quantized per row after loading, then as ``fp8`` (``quantization.block_fp8``).
    The GEMMs stay in the model's dtype (weight-only fp8: a decode step of a MoE model is a stream
    of expert weights, which this halves); off the GPU the weights are dequantized once at load."""

    matmul = staticmethod(F.linear)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp_rank: int = 0, tp_size: int = 1,
                 fp8: bool = False, block_fp8: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # every expert's, before the split
        self.tp_rank = tp_rank
        self.rank_size = divide(intermediate_size, tp_size, "moe intermediate size")
        self.dtype = torch.get_default_dtype()
        self.fp8 = fp8
        stored = torch.float8_e4m3fn if fp8 or block_fp8 else None
        self.w13 = new_param((num_experts, 2 * self.rank_size, hidden_size), self._load_w13, dtype=stored)
        self.w2 = new_param((num_experts, hidden_size, self.rank_size), self._load_w2, dtype=stored)
        if fp8:
            # Buffers, not checkpoint tensors: filled as the rows are quantized.
            self.register_buffer("w13_scale", torch.empty(self.w13.shape[:2], dtype=torch.float32), persistent=False)
            self.register_buffer("w2_scale", torch.empty(self.w2.shape[:2], dtype=torch.float32), persistent=False)
            from tokenmill.quantization.fp8 import fill_random_fp8

            self.w13.dummy_init = lambda data, gen: fill_random_fp8(data, self.w13_scale, gen)  # type: ignore[attr-defined]
            self.w2.dummy_init = lambda data, gen: fill_random_fp8(data, self.w2_scale, gen)  # type: ignore[attr-defined]
            self.quant_method = _Fp8Experts()  # the loader calls its process_weights_after_loading
        elif block_fp8:  # a block-wise fp8 checkpoint: codes as stored, block scales beside (quantization/block_fp8.py)
            from tokenmill.quantization.block_fp8 import add_expert_block_scales

            add_expert_block_scales(self)

    def _load_w13(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any) -> None:
        expert, part = self._shard(shard_id, (0, 1))
        check_shape(param, loaded, (self.intermediate_size, self.hidden_size))
        rows = slice(part * self.rank_size, (part + 1) * self.rank_size)
        self._store(param, getattr(self, "w13_scale", None), expert, rows,
                    loaded.narrow(0, self.tp_rank * self.rank_size, self.rank_size))

    def _load_w2(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any) -> None:
        expert, _ = self._shard(shard_id, (None,))
        check_shape(param, loaded, (self.hidden_size, self.intermediate_size))
        self._store(param, getattr(self, "w2_scale", None), expert, slice(None),
                    loaded.narrow(1, self.tp_rank * self.rank_size, self.rank_size))

    def _store(self, param: nn.Parameter, scale: torch.Tensor | None, expert: int, rows: slice, values: torch.Tensor) -> None:
        """Write an expert's rows: as they are, or (fp8, still unconverted) as codes and their scales."""
        if scale is None:
            param.data[expert, rows].copy_(values)
            return
        from tokenmill.quantization.fp8 import quantize_rows

        codes, scales = quantize_rows(values.to(param.device))
        param.data[expert, rows] = codes
        scale[expert, rows] = scales

    def _shard(self, shard_id: Any, parts: tuple) -> tuple[int, Any]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.num_experts
                and shard_id[1] in parts):
            raise ValueError(f"an expert weight needs shard_id (expert < {self.num_experts}, part in {parts}), got {shard_id!r}")
        return shard_id

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[T, H] tokens, their experts' [T, k] float32 weights and ids -> [T, H] (this rank's partial sum)."""
        if x.is_cuda:
            from tokenmill.kernels.triton.fused_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, ids, **self._kernel_options())
        return experts_by_loop(x, self.w13, self.w2, weights, ids, self.matmul)

    def _kernel_options(self) -> dict[str, Any]:
        """How the GPU kernels take these experts: deterministic mode or not, fp8 scales if any."""
        options: dict[str, Any] = {"batch_invariant": self.matmul is not F.linear}
        if self.fp8:
            options.update(w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        return options

    def compile_variants(self, top_k: int, max_tokens: int) -> None:
        """Compile every grouped-GEMM and alignment variant a step of up to ``max_tokens`` tokens can
        launch (GPU only; ``ModelRunner.precompile_kernels``): the variant follows the token count
        (the tile class, the alignment's way), so a size first met mid-run would stall it ~1 s."""
        if not self.w13.is_cuda:
            return
        from tokenmill.kernels.triton.fused_moe import precompile_experts

        precompile_experts(self.w13, self.w2, top_k, max_tokens, self.dtype, **self._kernel_options())


class _Fp8Experts:
    """After loading: on a GPU the fp8 codes and scales stay for the kernels; elsewhere each expert is
    dequantized once into the model's dtype, and the layer runs as an unquantized one."""

    def process_weights_after_loading(self, experts: Experts) -> None:
        from tokenmill import quantization

        if quantization.runs_kernels(experts.w13.device):
            return
        for name in ("w13", "w2"):
            codes, scale = getattr(experts, name), getattr(experts, f"{name}_scale")
            delattr(experts, f"{name}_scale")
            dequantized = nn.Parameter((codes.data.float() * scale[..., None]).to(experts.dtype), requires_grad=False)
            dequantized.weight_loader = codes.weight_loader  # type: ignore[attr-defined]
            setattr(experts, name, dequantized)
        experts.fp8 = False
        del experts.quant_method


def experts_by_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, matmul: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """The experts one after another, each over the tokens routed to it (the CPU's path: its token
    counts are read on the host, which a captured CUDA graph could not do). A token's k expert
    outputs are added to its row in expert order, each rounded to x's dtype first, as transformers
    adds them; the routing weights stay fp32 (transformers rounds the Qwen models' to the model's
    dtype before the product, Mixtral's not: in bf16 a rounding apart)."""
    top_k = ids.shape[1]
    pairs = torch.argsort(ids.flatten(), stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        chosen = pairs[start : start + count]
        start += count
        tokens = chosen // top_k
        gate, up = matmul(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = matmul(F.silu(gate) * up, w2[expert]) * weights.flatten()[chosen, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """Router + experts (+ an always-on shared expert with a sigmoid gate: Qwen2-MoE)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None, shared_expert: nn.Module | None = None,
                 fp8_experts: bool = False, block_fp8_experts: bool = False):
        super().__init__()
        self.gate = Router(num_experts, hidden_size, top_k, renormalize)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp_rank, tp_size, fp8_experts, block_fp8_experts)
        self.tp_size, self.tp_group = tp_size, tp_group
        # Built without its own all-reduce (its down_proj's reduce_results=False): the gate is the same on
        # every rank, so the ranks' gated partial sums add up with the experts' in one all-reduce.
        self.shared_expert = shared_expert
        self.shared_expert_gate = SharedExpertGate(hidden_size) if shared_expert is not None else None

    def precompile(self, max_tokens: int) -> None:
        """The runner's hook before the first step (``ModelRunner.precompile_kernels``): see
        ``Experts.compile_variants`` and ``Router.compile_variants``."""
        self.gate.compile_variants()
        self.experts.compile_variants(self.gate.top_k, max_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(x) * self.shared_expert(x)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's replicated [1, H] gate: how much of the shared expert each token takes."""

    matmul = staticmethod(F.linear)

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = new_param((1, hidden_size), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.matmul(x, self.weight))
