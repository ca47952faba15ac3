"""The GPU's SMs split into two disjoint groups, a CUDA stream on each (green contexts), for
bench/sm_partition_probe.py (docs/perf.md 113; the engine wiring it was measured with, a mixed step's
decodes and prompt chunks each on their own partition, is at commit 50616bf and was not kept).

Two plain streams share every SM: a cuBLAS GEMM's CTAs hold whole SMs and an attention launch fills
every SM it can, so two concurrent forwards mostly take turns (docs/perf.md 17). A green context owns
a fixed set of SMs; work on its streams runs there and nowhere else.

torch's ``GreenContext.create(num_sms=...)`` splits the device afresh each time and keeps the first
group, so two of them cover the same SMs. Here one split makes the group and the remainder, and each
becomes a green context, through the CUDA driver's API (ctypes; the driver has it from CUDA 12.4).
The contexts live as long as the process.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 1
_CU_STREAM_NON_BLOCKING = 1  # the only flag a green context's streams take
_RESOURCE_BYTES = 4096  # a CUdevResource is 144-160 bytes across CUDA 12.4-13.x; room to spare
_SM_COUNT_OFFSET = 96  # CUdevResource: its type (4 bytes) and 92 bytes of padding, then sm.smCount


@dataclass(frozen=True)
class SmPartition:
    """Two streams on disjoint SM groups and each group's SM count (the driver rounds a group up to
    its granularity, so ``sms[0]`` may exceed what was asked)."""

    streams: tuple[torch.cuda.ExternalStream, torch.cuda.ExternalStream]
    sms: tuple[int, int]


def split_device(first_sms: int, device: torch.device) -> SmPartition:
    """``first_sms`` SMs of ``device`` for the first stream, the rest for the second."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < first_sms < total:
        raise ValueError(f"an SM split of the device's {total} SMs needs 0 < first_sms < {total}, got {first_sms}")
    torch.cuda.init()  # the primary context must exist before green contexts are carved from it
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGreenCtxCreate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.cuGreenCtxStreamCreate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]

    def check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed with CUresult {result} (green contexts need a CUDA 12.4+ driver)")

    handle = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(handle), device.index if device.index is not None else torch.cuda.current_device()),
          "cuDeviceGet")
    whole, group, rest = (ctypes.create_string_buffer(_RESOURCE_BYTES) for _ in range(3))
    check(lib.cuDeviceGetDevResource(handle, whole, _CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
    num_groups = ctypes.c_uint(1)
    check(lib.cuDevSmResourceSplitByCount(group, ctypes.byref(num_groups), whole, rest, 0, first_sms),
          "cuDevSmResourceSplitByCount")
    streams, counts = [], []
    for resource in (group, rest):
        desc, context, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
        check(lib.cuGreenCtxCreate(ctypes.byref(context), desc, handle, _CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate")
        check(lib.cuGreenCtxStreamCreate(ctypes.byref(stream), context, _CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate")
        streams.append(torch.cuda.ExternalStream(stream.value, device=device))
        counts.append(ctypes.c_uint.from_buffer(resource, _SM_COUNT_OFFSET).value)
    return SmPartition(streams=(streams[0], streams[1]), sms=(counts[0], counts[1]))
