"""Programmatic dependent launch (PDL): a decode step's next kernel gets onto the SMs while the one
before it is still finishing.

Inside a CUDA graph each kernel is launched only once the kernel before it has completed and its
writes have drained: ~1.2-1.5 µs of idle GPU at every kernel boundary on the H200 (a P3 decode
step on fp8 weights runs ~390 kernels: ~0.6 ms of its ~11 ms; docs/perf.md 39). On sm90 and
later a kernel launched with Triton's ``launch_pdl`` (CUDA's programmatic stream serialization)
may start as soon as every program of the kernel before it has called ``gdc_launch_dependents``;
its programs then block in ``gdc_wait`` until that kernel has completed and its writes are
visible. A kernel reads nothing before ``wait_for_inputs``, its first statement, so the order of
every read and write is what it was; what overlaps is only the launch, the programs' placement on
the SMs and the kernel's setup. A kernel before one of ours that never signals (cuBLAS, torch's
own kernels) lets it launch when it completes, as before; a memory copy orders as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Off: every launch as before (bench A/B runs patch this; it is read at each launch, and a CUDA
# graph keeps the launches it captured).
ENABLED = True


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch on ``device`` of a kernel that starts with
    ``wait_for_inputs(PDL)``: dependent launch on sm90+ GPUs, never in the interpreter."""
    if ENABLED and device.type == "cuda" and not triton.knobs.runtime.interpret and _sm90_or_later(_index(device)):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait for the kernel before (its writes visible), then let the one after launch early: it
    waits here in turn, so letting it in before this kernel's own work is done is safe."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
