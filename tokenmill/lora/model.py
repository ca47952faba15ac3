"""A model's adaptable linear layers by Hugging Face module name, and adapters loaded into device
slots (on every tensor-parallel rank: each keeps its part, as for the base weights).

``ModelLoRA`` gives every column- and row-parallel linear layer of the model a ``LoRAUpdate``
(layers.py): the attention and MLP projections of each decoder layer (and a Qwen2-MoE shared
expert's). Stacked layers (q/k/v, gate/up) are adapted per part, under the checkpoint's names
(``q_proj``...), which are the names PEFT writes. The one-hot mask of each step is made from the
forward context (``ForwardContext.lora_slots``) by a forward pre-hook on the model, so every
forward (rank 0's, a mirrored rank's, a CUDA graph's capture) sets it the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.lora.adapter import read_adapter
from tokenmill.lora.layers import LoRABatch, LoRAUpdate
from tokenmill.models.layers.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, ParamLayout, QKVParallelLinear, RowParallelLinear,
)

if TYPE_CHECKING:
    from tokenmill.lora.adapter import AdapterSpec


@dataclass(frozen=True)
class _Target:
    """One adaptable module: the layer holding it, its part there (q, k, v: 0, 1, 2) and the shard
    id its weight loader takes, and its full (unsplit) features."""

    linear: nn.Module
    sublayer: int
    shard_id: Any
    in_features: int
    out_features: int


class ModelLoRA:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device, target_modules: frozenset[str] | None = None):
        """``target_modules``: the projection names (``q_proj``...) that take adapters, None: all; the
        others get no update (``excluded``: adapters' tensors for them are left out)."""
        _refuse_reordered_heads(model)
        self.dtype = dtype
        self.batch = LoRABatch(max_loras, device)
        self.targets: dict[str, _Target] = {}
        self.excluded: set[str] = set()
        stacked = getattr(model, "stacked", ())
        for name, module in model.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            parts = [(name[: -len(whole) + 1] + part[:-1], shard) for whole, part, shard in stacked
                     if (name + ".").endswith(whole)] or [(name, None)]
            if target_modules is not None:
                self.excluded.update(p for p, _ in parts if p.rsplit(".", 1)[-1] not in target_modules)
                parts = [(p, shard) for p, shard in parts if p not in self.excluded]
                if not parts:
                    continue
            row = isinstance(module, RowParallelLinear)
            in_rank = module.input_size_per_partition if row else module.input_size
            out_rank = module.output_size if row else module.output_size_per_partition
            module.lora = LoRAUpdate(self.batch, in_rank, out_rank, len(parts), max_rank, dtype, device)
            # Buffers of the layer (not saved with it): LLM.sleep puts them away with the weights.
            module.register_buffer("lora_a", module.lora.a, persistent=False)
            module.register_buffer("lora_b", module.lora.b, persistent=False)
            for sublayer, (hf_name, shard) in enumerate(parts):
                self.targets[hf_name] = _Target(module, sublayer, shard, module.input_size, _full_out(module, shard))
        self.fused = self._fused_modules(model)
        model.register_forward_pre_hook(self._begin)
        # Adapters read from disk, kept in CPU memory: loading one into a slot again needs no read.
        # Keys: (lora_int_id, uid).
        self._cached: OrderedDict[tuple[int, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._max_cached = max_cpu_loras
        self.pinned: set[int] = set()

    def _fused_modules(self, model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
        """Checkpoint modules fused from several parts (Phi-3's qkv_proj): name -> (part, first row, rows);
        one some of whose parts lora_target_modules leaves out is left out whole."""
        fused: dict[str, list[tuple[str, int, int]]] = {}
        lookup = getattr(model, "fused_lora_modules", None)
        for leaf, parts in (lookup() if lookup is not None else {}).items():
            first = "." + parts[0][0]
            for prefix in [name[: -len(first)] for name in {*self.targets, *self.excluded} if name.endswith(first)]:
                names = [f"{prefix}.{part}" for part, _ in parts]
                if any(name in self.excluded for name in names):
                    self.excluded.add(f"{prefix}.{leaf}")
                    continue
                starts = [sum(rows for _, rows in parts[:i]) for i in range(len(parts))]
                fused[f"{prefix}.{leaf}"] = [(name, start, rows) for name, start, (_, rows) in zip(names, starts, parts)]
        return fused

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        """Module name -> (in, out) features of the full model: what an adapter may adapt (a fused
        checkpoint module's out: its parts' together)."""
        shapes = {name: (t.in_features, t.out_features) for name, t in self.targets.items()}
        for name, parts in self.fused.items():
            shapes[name] = (self.targets[parts[0][0]].in_features, sum(rows for _, _, rows in parts))
        return shapes

    def _begin(self, model: nn.Module, args: tuple) -> None:
        ctx = args[2]
        self.batch.begin(getattr(ctx, "lora_slots", None))

    # ---- adapters in slots ------------------------------------------------------------------------
    def cache(self, spec: "AdapterSpec") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's tensors, read from disk unless kept; the least recently used unpinned adapter
        beyond max_cpu_loras is dropped."""
        key = (spec.lora_int_id, spec.uid)
        tensors = self._cached.pop(key, None)
        if tensors is None:
            tensors = read_adapter(spec, self.dtype)
        self._cached[key] = tensors
        while len(self._cached) > self._max_cached:
            victim = next((k for k in self._cached if k[0] not in self.pinned), None)
            if victim is None:
                break
            del self._cached[victim]
        return tensors

    def drop(self, lora_id: int) -> None:
        for key in [k for k in self._cached if k[0] == lora_id]:
            del self._cached[key]

    def load(self, slot: int, spec: "AdapterSpec") -> None:
        """Put the adapter into ``slot`` of every layer (layers it does not adapt get zeros there)."""
        tensors = self.cache(spec)
        for update in {id(t.linear): t.linear.lora for t in self.targets.values()}.values():
            update.clear_slot(slot)
        for module, (a, b) in _unfused(tensors, self.fused):
            target = self.targets[module]
            linear = target.linear
            if isinstance(linear, RowParallelLinear):  # this rank's input features of A, all of B
                a = _placed(linear, a, (a.shape[0], linear.input_size_per_partition), ParamLayout(input_dim=1), None)
            else:  # all of A, this rank's output features of B (in its part's rows)
                b = _placed(linear, b, (linear.output_size_per_partition, b.shape[1]), ParamLayout(output_dim=0),
                            target.shard_id)
            linear.lora.set_slot(slot, target.sublayer, a.to(linear.lora.a.device), b.to(linear.lora.b.device))


def _unfused(tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
             fused: dict[str, list[tuple[str, int, int]]]) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Each module's (A, B); a fused module's split into its parts (A shared, B cut by rows)."""
    out = []
    for module, (a, b) in tensors.items():
        parts = fused.get(module)
        out += [(module, (a, b))] if parts is None else [(part, (a, b[start : start + rows])) for part, start, rows in parts]
    return out


def _full_out(linear: nn.Module, shard_id: Any) -> int:
    if isinstance(linear, QKVParallelLinear):
        heads = linear.total_num_heads if shard_id == "q" else linear.total_num_kv_heads
        return heads * linear.head_dim
    if isinstance(linear, MergedColumnParallelLinear):
        return linear.output_sizes[shard_id]
    return linear.output_size


def _placed(linear: nn.Module, full: torch.Tensor, shape: tuple[int, ...], layout: ParamLayout,
            shard_id: Any) -> torch.Tensor:
    """This rank's part of ``full``, placed by the layer's own weight loader (its tensor-parallel split,
    KV heads replicated over ranks, a stacked part's rows) into zeros of ``shape``."""
    holder = nn.Parameter(torch.zeros(shape, dtype=full.dtype), requires_grad=False)
    holder.feature_layout = layout  # type: ignore[attr-defined]
    linear.weight_loader(holder, full, shard_id)
    return holder.data


def _refuse_reordered_heads(model: nn.Module) -> None:
    """Partial rotary reorders each q/k head's rows at load (models/layers/rotary.py); an adapter's
    B rows would need the same order, which nothing gives them yet."""
    from tokenmill.models.layers.rotary import partial_rotary_permutation

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    if attn is not None and partial_rotary_permutation(attn.head_dim, attn.rotary_emb.rope) is not None:
        raise ValueError("enable_lora=True is not supported for models with partial rotary embeddings "
                         "(partial_rotary_factor < 1)")
