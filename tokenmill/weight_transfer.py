"""Weight transfer for RL loops: a trainer's new weights into a running engine (vLLM's six methods).

``LLM.update_weights({"update_info": {...}})`` replaces named tensors of the model in place, on
every tensor-parallel rank (each keeps its slice), bumps the engine's weight version and forgets
the prefix cache (its blocks were computed with the old weights). Names are the checkpoint's
(Hugging Face) names, as a trainer's ``model.named_parameters()`` gives them; a subset is fine.
The tensors come either from the same process:

    llm.update_weights({"update_info": {"names": names, "tensors": tensors}})

or over a torch.distributed group that the trainer opens as rank 0 (NCCL between GPUs, gloo on
CPUs; vLLM's "nccl" backend, whose request fields these are):

    sender = WeightSender("127.0.0.1", 0, world_size=1 + llm.get_world_size())
    # at the same time (e.g. in a thread): llm.init_weight_transfer_engine({"init_info": sender.init_info()})
    sender.connect()
    # at the same time: llm.update_weights({"update_info": WeightSender.update_info(named_tensors)})
    sender.send(named_tensors)

`init_weight_transfer_engine` and `update_weights` block until the trainer's side joins, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

if TYPE_CHECKING:
    from torch import nn

_INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")


@dataclass
class WeightTransferInitRequest:
    """vLLM's request shape: ``init_info`` holds master_address, master_port, rank_offset, world_size."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """vLLM's request shape: ``update_info`` holds names, dtype_names and shapes (received over the
    group) or names and tensors (same process)."""

    update_info: dict[str, Any] = field(default_factory=dict)


def request_info(request: Any, key: str, method: str) -> dict[str, Any]:
    """``request[key]`` of a dict request, or ``request.<key>`` of a request object."""
    info = request.get(key) if isinstance(request, dict) else getattr(request, key, None)
    if not isinstance(info, dict):
        raise ValueError(f"LLM.{method}(request) needs a {key!r} dict, e.g. {{{key!r}: {{...}}}}; got {request!r:.200}")
    return info


# ---- the engine's side (one per rank) ---------------------------------------------------------
class WeightReceiver:
    """This rank's membership of the trainer's group (``init_info``: vLLM's NCCL init fields; the
    rank in the group is ``rank_offset`` + the tensor-parallel rank)."""

    def __init__(self, init_info: dict[str, Any], tp_rank: int, device: torch.device):
        import torch.distributed as dist

        from tokenmill.distributed.process_group import COLLECTIVE_TIMEOUT, create_group

        missing = [name for name in _INIT_FIELDS if name not in init_info]
        if missing:
            raise ValueError(f"init_weight_transfer_engine: init_info lacks {missing} (needs {list(_INIT_FIELDS)})")
        port, rank_offset, world_size = (_int_field(init_info, name) for name in ("master_port", "rank_offset", "world_size"))
        rank = rank_offset + tp_rank
        store = dist.TCPStore(str(init_info["master_address"]), port, world_size,
                              is_master=False, timeout=COLLECTIVE_TIMEOUT)
        self.group = create_group(store, rank, world_size, device)
        self.device = device

    def receive(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as the trainer broadcasts it from rank 0, in the order named."""
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(tensor, 0).wait()
            yield name, tensor


def _int_field(init_info: dict[str, Any], name: str) -> int:
    """An integer field of init_info (an int, or a string of one); True or 2.5 is refused, not cut."""
    value = init_info[name]
    if not isinstance(value, (bool, float)):
        try:
            return int(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"init_weight_transfer_engine: init_info[{name!r}]={value!r} is invalid: must be an int")


def named_tensors(update_info: dict[str, Any], receiver: WeightReceiver | None) -> Iterable[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs an ``update_info`` describes: its own tensors, or received over the group."""
    names = update_info.get("names")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError("update_weights: update_info['names'] must be a list of tensor names")
    tensors = update_info.get("tensors")
    if tensors is not None:
        if len(tensors) != len(names) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError(f"update_weights: update_info['tensors'] must be {len(names)} tensors, one per name")
        return list(zip(names, tensors))  # a list: the model checks every name before replacing any
    dtype_names, shapes = update_info.get("dtype_names"), update_info.get("shapes")
    if not isinstance(dtype_names, (list, tuple)) or not isinstance(shapes, (list, tuple)) \
            or not len(dtype_names) == len(shapes) == len(names):
        raise ValueError("update_weights: update_info needs 'tensors', or 'dtype_names' and 'shapes' as long as 'names'")
    if update_info.get("packed"):
        raise ValueError("update_weights: packed=True is not supported; tensors are broadcast one by one")
    if receiver is None:
        raise ValueError("update_weights without tensors receives them over the trainer's group: "
                         "call init_weight_transfer_engine first")
    return receiver.receive(list(names), [dtype_from_name(d) for d in dtype_names], [list(s) for s in shapes])


def load_named_tensors(model: "nn.Module", tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into the model's parameters in place (this rank's slice of it)."""
    import inspect

    if "partial" not in inspect.signature(model.load_weights).parameters:
        raise ValueError(f"update_weights is not supported for {type(model).__name__}")
    with torch.no_grad():
        model.load_weights(tensors, partial=True)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update_weights: dtype name {name!r} is not a torch dtype (e.g. 'bfloat16')")
    return dtype


# ---- the trainer's side -----------------------------------------------------------------------
class WeightSender:
    """The trainer's end: opens the group as rank 0 on ``master_port`` (0: a free port, see `port`)."""

    def __init__(self, master_address: str = "127.0.0.1", master_port: int = 0, world_size: int = 2,
                 device: str | torch.device = "cpu"):
        import torch.distributed as dist

        from tokenmill.distributed.process_group import COLLECTIVE_TIMEOUT

        self.master_address = master_address
        self.world_size = world_size
        self.device = torch.device(device)
        self.store = dist.TCPStore(master_address, master_port, world_size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        self.port = self.store.port
        self.group: Any = None

    def init_info(self, rank_offset: int = 1) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": self.port, "rank_offset": rank_offset,
                "world_size": self.world_size}

    def connect(self) -> None:
        """Join the group (returns once the engine's ranks have joined too)."""
        from tokenmill.distributed.process_group import create_group

        self.group = create_group(self.store, 0, self.world_size, self.device)

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast each tensor, in the order `update_info` named them."""
        if self.group is None:
            raise RuntimeError("WeightSender.send before connect()")
        for _, tensor in tensors:
            self.group.broadcast(tensor.detach().to(self.device).contiguous(), 0).wait()

    @staticmethod
    def update_info(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """vLLM's update_info for these tensors: names, dtype_names and shapes."""
        pairs = list(tensors)
        return {"names": [n for n, _ in pairs], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
                "shapes": [list(t.shape) for _, t in pairs]}
