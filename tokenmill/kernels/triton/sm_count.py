"""How many SMs a launch heuristic fills: the attention split rule and the split-K GEMMs both ask."""

from __future__ import annotations

import functools

import torch


def num_sms(device: torch.device) -> int:
    """The device's SM count. Off CUDA (the interpreter) an H100/H200's 132, so tests there take the
    launch shapes the GPU takes."""
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:  # asked on every eager launch: the properties once a device
    return torch.cuda.get_device_properties(index).multi_processor_count
