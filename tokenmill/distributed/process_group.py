"""The tensor-parallel process group: gloo between CPU processes, NCCL between GPUs of one host.

The group is a backend object built directly on a TCPStore, never torch.distributed's global
default group: the engine's process is rank 0, and a user's process may hold several engines
(one after another, or side by side) or run its own torch.distributed job. The layers pass the
object as ``group=`` to ``torch.distributed.all_reduce`` / ``all_gather``, which accept it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import os

import torch
import torch.distributed as dist

# How long a rank waits in one collective for its peers. A dead peer is noticed much sooner
# (gloo sees the closed connection; the executor's watchdog aborts NCCL); this bounds a peer
# that is alive but stuck. Between steps the workers wait on their control pipe, not in a
# collective, so an idle engine never runs into it.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
STORE_HOST = "127.0.0.1"  # one host: the ranks meet on the loopback interface
# NVLink multicast (NVLS) stays off unless the user's environment turns it on: tokenmill's
# collectives are small (decode activations), where it gains little, and on shared hosts a program
# that used it has put every GPU of the host out of service. NCCL reads these when it first starts.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def create_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (read it back from ``store.port``)."""
    return dist.TCPStore(
        STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )


def connect_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def create_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> Any:
    """Join the group; returns when every rank has joined (or raises after COLLECTIVE_TIMEOUT)."""
    if device.type == "cuda":
        keep_nvlink_multicast_off()
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)


def keep_nvlink_multicast_off() -> None:
    """Set NVLINK_MULTICAST_OFF in this process's environment, leaving any value already there."""
    for name, value in NVLINK_MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU counted from the engine's device (cuda:0 unless told otherwise)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, world_size: int) -> None:
    if device.type != "cuda":
        return
    first = device.index or 0
    available = torch.cuda.device_count()
    if first + world_size > available:
        raise ValueError(
            f"tensor_parallel_size={world_size} needs GPUs cuda:{first}..cuda:{first + world_size - 1}, "
            f"but torch sees {available}; lower tensor_parallel_size or set CUDA_VISIBLE_DEVICES"
        )


def abort_group(group: Any) -> None:
    """Make collectives in flight on this rank fail now (NCCL would otherwise wait on a dead peer
    inside a GPU kernel until the timeout). Gloo needs no help: it sees the peer's socket close."""
    if isinstance(group, getattr(dist, "ProcessGroupNCCL", ())):
        group.abort()
