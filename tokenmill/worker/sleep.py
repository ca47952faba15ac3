"""One rank's weights during `LLM.sleep`: kept in pinned CPU memory (level 1) or discarded (level 2).

Each parameter and buffer keeps its identity; only its storage (``.data``) changes, so modules,
tied weights (the LM head that is the embedding) and anything else holding a reference stay
valid. Level 1 copies every device tensor to CPU memory (pinned, so waking is one fast copy);
tensors already on the CPU (the CPU path, layers offloaded by cpu_offload_gb) stay as they are.
Level 2 discards the parameters, wherever they live, and wakes up with uninitialised ones of the
same shapes and places, to be filled by `Worker.reload_weights` or `update_weights` (vLLM's
contract); buffers, which the model derives itself (rotary tables, quantized layouts), are kept
as in level 1 rather than lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _PutAway:
    tensor: torch.Tensor  # the parameter or buffer itself
    shape: torch.Size
    device: torch.device  # where it lives when awake
    pinned: bool  # a pinned CPU tensor when awake (a layer offloaded by cpu_offload_gb)
    saved: torch.Tensor | None  # its contents (level 1), or None: discarded (level 2)


class WeightStash:
    """The model's tensors while it sleeps: ``WeightStash(model, discard)`` puts them away,
    `restore` brings them back."""

    def __init__(self, model: nn.Module, discard: bool):
        self._entries: list[_PutAway] = []
        for tensor, is_param in model_tensors(model):
            on_cpu = tensor.device.type == "cpu"
            if discard and is_param:
                saved = None
            elif on_cpu:
                continue  # already in CPU memory: nothing to free
            else:
                saved = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                saved.copy_(tensor.data, non_blocking=True)
            self._entries.append(_PutAway(tensor, tensor.shape, tensor.device, on_cpu and tensor.is_pinned(), saved))
        _synchronize(self._entries)  # the copies are done before their sources are dropped
        for entry in self._entries:
            entry.tensor.data = entry.saved if entry.saved is not None else torch.empty(0, dtype=entry.tensor.dtype)

    def restore(self) -> None:
        """Every tensor back where it lived (discarded ones uninitialised)."""
        for entry in self._entries:
            if entry.saved is None:
                entry.tensor.data = torch.empty(entry.shape, dtype=entry.tensor.dtype, device=entry.device,
                                                pin_memory=entry.pinned)
            elif entry.device.type != "cpu":
                entry.tensor.data = entry.saved.to(entry.device, non_blocking=True)
        _synchronize(self._entries)  # before the pinned copies are let go
        self._entries = []


def model_tensors(model: nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """Every parameter and buffer once (a tied weight is one tensor), with whether it is a parameter."""
    seen: set[int] = set()
    found = []
    for tensors, is_param in ((model.parameters(), True), (model.buffers(), False)):
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((tensor, is_param))
    return found


def _synchronize(entries: list[_PutAway]) -> None:
    devices = {e.device for e in entries if e.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)
