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
An update is checked whole (names, dtypes, shapes) before any tensor is replaced; over the group, a
refused one is still received to its end and dropped, so the trainer's send returns and the next
update starts in step (`apply_update`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from tokenmill.param_checks import is_int

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

    def receive(self, dtypes: list[torch.dtype], shapes: list[torch.Size]) -> Iterator[torch.Tensor]:
        """Each tensor as the trainer broadcasts it from rank 0, in the announced order."""
        for dtype, shape in zip(dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(tensor, 0).wait()
            yield tensor


def _int_field(init_info: dict[str, Any], name: str) -> int:
    """An integer field of init_info (an int, or a string of one); True or 2.5 is refused, not cut."""
    value = init_info[name]
    if not isinstance(value, (bool, float)):
        try:
            return int(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"init_weight_transfer_engine: init_info[{name!r}]={value!r} is invalid: must be an int")


def apply_update(model: "nn.Module", update_info: dict[str, Any], receiver: WeightReceiver | None,
                 refusal: Exception | None = None) -> None:
    """Check the whole update, then copy each tensor into the model's parameters in place (this
    rank's slice of it). ``refusal``: the error to give for any update now (the caller's state).

    Nothing is replaced unless every name, dtype and shape is one the model takes. Over the
    trainer's group, a refused update (or one that fails part-way) still receives every announced
    tensor, one at a time, and drops it: the trainer's send returns and the next update starts in
    step. Every tensor-parallel rank runs the same checks against the full (unsliced) shapes, so
    the ranks refuse alike."""
    if update_info.get("tensors") is not None:
        pairs = _tensors_in_hand(update_info)
        _check(model, [(name, tensor.dtype, tensor.shape) for name, tensor in pairs], refusal)
        _load(model, pairs, len(pairs))
        return
    if receiver is None:
        raise ValueError("update_weights without tensors receives them over the trainer's group: "
                         "call init_weight_transfer_engine first")
    dtypes, shapes = _announced(update_info)
    arriving = receiver.receive(dtypes, shapes)  # lazily: each tensor is received when it is asked for
    try:
        names = _names(update_info, len(shapes), "'dtype_names' and 'shapes'")
        _check(model, list(zip(names, dtypes, shapes)), refusal)
    except Exception as exc:
        _drop(arriving)
        if not isinstance(exc, (ValueError, RuntimeError)):
            raise
        raise type(exc)(f"{exc} (the {len(shapes)} tensors the trainer sent were received and dropped, so its send "
                        "completes)") from None
    _load(model, zip(names, arriving), len(names))


def _names(update_info: dict[str, Any], count: int, given: str) -> list[str]:
    names = update_info.get("names")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"update_weights: update_info['names']={names!r:.100} is invalid: must be a list of tensor "
                         "names; nothing was replaced")
    if len(names) != count:
        raise ValueError(f"update_weights: update_info has {len(names)} names and {count} tensors in {given}: must be "
                         "one per name; nothing was replaced")
    return list(names)


def _tensors_in_hand(update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    tensors = update_info["tensors"]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"update_weights: update_info['tensors'] must be a list of tensors, one per name; got "
                         f"{tensors!r:.100}; nothing was replaced")
    return list(zip(_names(update_info, len(tensors), "'tensors'"), tensors))


def _announced(update_info: dict[str, Any]) -> tuple[list[torch.dtype], list[torch.Size]]:
    """The dtypes and shapes of the tensors the trainer broadcasts. Without valid ones nothing can be
    received, so the trainer's send of this update is left unmatched: the error says so."""
    unmatched = "; nothing was received or replaced (the trainer's broadcast of this update is left unmatched)"
    if update_info.get("packed"):
        raise ValueError("update_weights: packed=True is not supported; tensors are broadcast one by one" + unmatched)
    dtype_names, shapes = update_info.get("dtype_names"), update_info.get("shapes")
    if not isinstance(dtype_names, (list, tuple)) or not isinstance(shapes, (list, tuple)) or len(dtype_names) != len(shapes):
        raise ValueError("update_weights: update_info needs 'tensors', or 'dtype_names' and 'shapes' (two lists, an "
                         f"entry per tensor); got dtype_names={dtype_names!r:.100}, shapes={shapes!r:.100}" + unmatched)
    for i, shape in enumerate(shapes):
        if not isinstance(shape, (list, tuple)) or not all(is_int(size) and size >= 0 for size in shape):
            raise ValueError(f"update_weights: update_info['shapes'][{i}]={shape!r:.100} is invalid: must be a list of "
                             "sizes >= 0" + unmatched)
    try:
        dtypes = [dtype_from_name(name) for name in dtype_names]
    except ValueError as exc:
        raise ValueError(f"{exc}{unmatched}") from None
    return dtypes, [torch.Size(shape) for shape in shapes]


def _check(model: "nn.Module", announced: list[tuple[str, torch.dtype, torch.Size]], refusal: Exception | None) -> None:
    """Refuse an update the model would not take whole: ``refusal``, a model without partial loads
    (ValueError), or a name, dtype or shape it does not take (ValueError from ``weights.check_update``,
    run on meta tensors: their dtype and shape, no data)."""
    import inspect

    if refusal is None and "check_only" not in inspect.signature(model.load_weights).parameters:
        refusal = ValueError(f"update_weights is not supported for {type(model).__name__}")
    if refusal is not None:
        raise type(refusal)(f"{refusal}; nothing was replaced")
    meta = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, dtype, shape in announced]
    try:
        model.load_weights(meta, partial=True, check_only=True)
    except ValueError as exc:
        raise ValueError(f"update_weights: {exc}; nothing was replaced") from None


def _load(model: "nn.Module", pairs: Iterable[tuple[str, torch.Tensor]], count: int) -> None:
    """Copy the checked tensors in. Should one still fail (out of memory, a lost trainer), the error
    says how far it got; the group's tensors left are received and dropped."""
    taken: list[str] = []
    stream = iter(pairs)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            taken.append(name)
            yield name, tensor

    try:
        with torch.no_grad():
            model.load_weights(counted(), partial=True)
    except Exception as exc:
        _drop(stream)
        last = f" (the last {taken[-1]!r})" if taken else ""
        raise RuntimeError(f"update_weights failed after {len(taken)} of {count} tensors were taken in{last}: those "
                           f"before the failing one were replaced, the rest were not: {exc}") from exc


def _drop(pairs: Iterable[Any]) -> None:
    """Take in what is left of ``pairs`` (for the group's tensors: receive them) and keep none."""
    for _ in pairs:
        pass


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
