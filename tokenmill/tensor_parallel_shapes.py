"""Whether a model can be split over ``tensor_parallel_size`` ranks, decided from its config before
any worker process starts (vLLM checks the heads in its config too).

Each rank computes an equal share of the attention heads, of the kv heads (or, with fewer kv heads
than ranks, a copy of one kv head shared by an equal number of ranks) and of the MLP's width (or of
each expert's, and of a shared expert's). The layers refuse a size that splits unevenly (models/layers/linear.py,
moe.py), but they are built in the worker processes, seconds after they started; this check refuses
it in ``LLM()`` with the sizes that fit.
"""

from __future__ import annotations

from typing import Any


def tensor_parallel_problem(tp_size: int, config: Any) -> str | None:
    """Why ``config``'s model cannot be split over ``tp_size`` ranks (the field, its value and the
    rule), or None when it can. Fields the config does not have are not checked."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads % tp_size:
        return (f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size} "
                "(each rank computes an equal share of the heads)")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads is not None and kv_heads >= tp_size and kv_heads % tp_size:
        return (f"num_key_value_heads={kv_heads} is not divisible by tensor_parallel_size={tp_size} "
                "(each rank computes an equal share of the kv heads)")
    if kv_heads is not None and kv_heads < tp_size and tp_size % kv_heads:
        return (f"tensor_parallel_size={tp_size} is not a multiple of num_key_value_heads={kv_heads} "
                "(with fewer kv heads than ranks, each kv head is copied to an equal number of ranks)")
    for name, width in _mlp_widths(config):
        if width % tp_size:
            return (f"{name}={width} is not divisible by tensor_parallel_size={tp_size} "
                    "(each rank computes an equal share of the MLP's width)")
    return None


def _mlp_widths(config: Any) -> list[tuple[str, int]]:
    """The widths the MLPs split (config field, value): the dense MLP's; for mixture-of-experts
    models each expert's (Qwen's moe_intermediate_size, Mixtral's intermediate_size), Qwen2-MoE's
    shared expert's, and the dense MLP's only where some layer keeps one (mlp_only_layers, or a
    decoder_sparse_step above 1)."""
    dense = ("intermediate_size", getattr(config, "intermediate_size", None))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts or not getattr(config, "moe_intermediate_size", None):
        return [dense] if dense[1] else []
    widths = [("moe_intermediate_size", config.moe_intermediate_size)]
    if getattr(config, "shared_expert_intermediate_size", None):
        widths.append(("shared_expert_intermediate_size", config.shared_expert_intermediate_size))
    if dense[1] and (getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) > 1):
        widths.append(dense)
    return widths


def check_tensor_parallel(tp_size: int, config: Any) -> None:
    """Refuse a ``tensor_parallel_size`` the model cannot be split over, naming the sizes that fit."""
    problem = tensor_parallel_problem(tp_size, config)
    if problem is None:
        return
    heads = getattr(config, "num_attention_heads", None) or tp_size
    fitting = [size for size in range(1, heads + 1) if heads % size == 0 and tensor_parallel_problem(size, config) is None]
    raise ValueError(f"LLM(tensor_parallel_size={tp_size}) does not fit this model: {problem}; "
                     f"allowed: tensor_parallel_size in {fitting}")
