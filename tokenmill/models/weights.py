"""Filling a model's parameters from Hugging Face-named checkpoint tensors.

Our models keep Hugging Face's parameter names, except that projections HF stores separately
are stacked into one matmul (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). A model
describes that with ``stacked`` fragments ``(our name part, HF name part, shard id)``; each
stacked parameter's ``weight_loader`` places a shard. Every expected tensor must be loaded
exactly once, and a tensor the model does not know is an error, not silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.models.layers.linear import default_weight_loader

Stacked = Sequence[tuple[str, str, Any]]


def stacked_param(hf_name: str, stacked: Stacked) -> tuple[str, Any]:
    """Our parameter name for an HF tensor name, and the shard it fills (None: the whole parameter)."""
    for ours, hf, shard_id in stacked:
        if hf in hf_name:
            return hf_name.replace(hf, ours), shard_id
    return hf_name, None


def hf_weight_names(model: nn.Module, stacked: Stacked) -> set[str]:
    """The HF tensor names that fill ``model``'s parameters."""
    names: set[str] = set()
    for name, _ in model.named_parameters():
        split = {name.replace(ours, hf) for ours, hf, _ in stacked if ours in name}
        names.update(split or {name})
    return names


def each_weight(
    weights: Iterable[tuple[str, Any]], fn: Callable[[str, Any], Iterable[tuple[str, Any]]]
) -> Iterable[tuple[str, Any]]:
    """``fn(name, tensor)``'s pairs for every checkpoint tensor, in order, as they are asked for."""
    return (pair for name, tensor in weights for pair in fn(name, tensor))


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Stacked,
    rename: Callable[[str], str | None] = lambda name: name,
    partial: bool = False,
    check_only: bool = False,
) -> None:
    """Copy checkpoint tensors into ``model``. ``rename`` maps a checkpoint name to the HF name this
    model uses (e.g. adds a prefix), or to None for a tensor it deliberately does not use.
    ``partial``: tensors may be missing (an update of some weights); unknown ones are still an error.
    ``check_only``: write nothing, only refuse (ValueError) what would not load (`check_update`)."""
    if check_only:
        check_update(model, weights, stacked, rename)
        return
    params = dict(model.named_parameters())
    expected = hf_weight_names(model, stacked)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        local = rename(name)
        if local is None:
            continue
        target, shard_id = stacked_param(local, stacked)
        param = params.get(target)
        if param is None or local not in expected:
            unexpected.append(name)
            continue
        if local in loaded and not partial:
            # Two shard files hold it (each file's tensors are read, whatever the index says), or
            # two checkpoint names map to it: the later copy would silently win.
            raise ValueError(f"checkpoint tensor {name!r} appears twice (in two shard files, or under two names)")
        problem = _dtype_problem(name, tensor, param)
        if problem:
            raise ValueError(f"cannot load checkpoint tensor {name!r}: {problem}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"cannot load checkpoint tensor {name!r}: {exc}") from exc
        # Loaders write through param.data, which has a version counter of its own: mark the
        # parameter changed, so what was derived from it (a CPU packed copy) is made again.
        torch.autograd.graph.increment_version(param)
        loaded.add(local)
    # A parameter marked checkpoint_optional (GPTQ's g_idx, only checked when present) may be absent.
    missing = [] if partial else sorted(name for name in expected - loaded
                                        if not getattr(params.get(stacked_param(name, stacked)[0]), "checkpoint_optional", False))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing tensors {_summary(missing)}; unexpected tensors {_summary(sorted(unexpected))}"
        )


def check_update(model: nn.Module, weights: Iterable[tuple[str, Any]], stacked: Stacked,
                 rename: Callable[[str], str | None]) -> None:
    """Refuse an update (update_weights) that would not load, before any of its tensors is replaced:
    an unknown name, a tensor that is not floating point for a floating-point weight (it would be
    cast in silently), or a shape the weight does not take. ``weights`` may be meta tensors (their
    dtype and shape only): each parameter's own loader is run against a meta twin of it, so the
    shape rules are the loaders' own and nothing is written."""
    params = dict(model.named_parameters())
    expected = hf_weight_names(model, stacked)
    twins: dict[str, nn.Parameter] = {}
    unknown: list[str] = []
    for name, tensor in weights:
        local = rename(name)
        if local is None:
            continue
        target, shard_id = stacked_param(local, stacked)
        param = params.get(target)
        if param is None or local not in expected:
            unknown.append(name)
            continue
        problem = _dtype_problem(name, tensor, param)
        if problem:
            raise ValueError(problem)
        twin = twins.get(target)
        if twin is None:
            twin = twins[target] = _meta_twin(param)
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(twin, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r} does not fit {type(model).__name__}: {exc}") from exc
    if unknown:
        raise ValueError(f"{type(model).__name__} has no tensors {_summary(sorted(unknown))} (names are the "
                         "checkpoint's, e.g. q_proj / k_proj / v_proj, not the fused qkv_proj)")


def _meta_twin(param: nn.Parameter) -> nn.Parameter:
    """A parameter of ``param``'s shape and dtype that holds no data, with its attributes (the
    weight loader, the feature layout): a loader writing into it checks shapes and writes nothing."""
    twin = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
    twin.__dict__.update(param.__dict__)
    return twin


def _dtype_problem(name: str, tensor: Any, param: nn.Parameter) -> str | None:
    """Why ``tensor`` cannot fill ``param``, or None: integer or bool values for a floating-point
    weight would be cast into it silently (int8 codes without their scales, a norm of 0s and 1s).
    Quantized layers' integer parameters take integer tensors."""
    dtype = getattr(tensor, "dtype", None)  # CheckpointTensors carry the file's dtype too
    if isinstance(dtype, torch.dtype) and param.dtype.is_floating_point and not dtype.is_floating_point:
        return f"tensor {name!r} has dtype {dtype}: must be a floating-point dtype (the model's is {param.dtype})"
    # A quantized parameter whose values only mean something in the stored dtype (fp8 codes, which
    # their scale multiplies): a full-precision tensor would be cast into it and scaled twice.
    required = getattr(param, "checkpoint_dtype", None)
    if required is not None and dtype != required:
        return (f"tensor {name!r} has dtype {dtype}, but the quantization_config says it holds {required} values "
                "(full-precision weights under a quantized config?)")
    return None


def _summary(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return f"({len(names)}) {shown}" + (f", ... and {len(names) - limit} more" if len(names) > limit else "")
