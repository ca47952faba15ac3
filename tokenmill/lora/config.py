"""``LLM(enable_lora=True, max_loras=..., max_lora_rank=..., max_cpu_loras=..., lora_dtype=...)``
checked and resolved once (vLLM's names, defaults and rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.lora.adapter import MAX_LORA_RANKS
from tokenmill.param_checks import is_int

if TYPE_CHECKING:
    import torch


# The projections adapters may adapt (vLLM's lora_target_modules names them so; the stacked layers'
# names stand for their parts).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # adapters one step may mix: the device slots of every adapted layer
    max_rank: int
    max_cpu_loras: int  # adapters each rank keeps read in CPU memory
    # LLM(lora_target_modules=...): the projections that take adapters (None: all); an adapter's
    # other modules are left out, with a warning (vLLM's deployment-time restriction, for speed).
    target_modules: frozenset[str] | None = None


def resolve_lora(enable_lora: Any, max_loras: Any, max_lora_rank: Any, max_cpu_loras: Any, lora_dtype: Any,
                 dtype: "torch.dtype", target_modules: Any = None) -> LoRAConfig | None:
    def check(ok: bool, name: str, value: Any, allowed: str) -> None:
        if not ok:
            raise ValueError(f"LLM({name}={value!r}) is invalid: must be {allowed}")

    check(isinstance(enable_lora, bool), "enable_lora", enable_lora, "True or False")
    if not enable_lora:
        return None
    check(is_int(max_loras) and max_loras >= 1, "max_loras", max_loras, "an integer >= 1")
    check(max_lora_rank in MAX_LORA_RANKS and is_int(max_lora_rank), "max_lora_rank", max_lora_rank,
          f"one of {list(MAX_LORA_RANKS)}")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    check(is_int(cpu) and cpu >= max_loras, "max_cpu_loras", max_cpu_loras, f"None or an integer >= max_loras={max_loras}")
    model_dtype = str(dtype).removeprefix("torch.")
    check(lora_dtype in ("auto", model_dtype, dtype), "lora_dtype", lora_dtype,
          f"'auto' or the model's dtype ({model_dtype!r}): adapters run in the model's dtype")
    targets = None
    if target_modules is not None:
        names = [target_modules] if isinstance(target_modules, str) else target_modules
        check(isinstance(names, (list, tuple, set, frozenset)) and len(names) > 0
              and all(name in PROJECTIONS or name in _STACKED for name in names), "lora_target_modules",
              target_modules, f"None or a list of {list(PROJECTIONS) + list(_STACKED)}")
        targets = frozenset(part for name in names for part in _STACKED.get(name, (name,)))
    return LoRAConfig(max_loras, max_lora_rank, cpu, targets)
