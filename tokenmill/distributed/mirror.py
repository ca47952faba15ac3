"""Rank 0 drives, the other ranks mirror: every model call rank 0 makes is replayed on each rank.

The engine process is rank 0: it schedules, prepares each step's inputs, runs its shard and
samples. The other ranks hold no scheduler state. Rank 0's runner calls the model through a
MirroredModel, which first announces each call to the workers (a small header over their
control pipes) and broadcasts the call's tensors from rank 0 over the process group; then
every rank runs the same call on its own shard, so the all-reduces and all-gathers inside the
layers pair up. Workers discard what their calls return: rank 0 alone samples.

Three calls are mirrored:
- ``model(input_ids, positions, ctx)``: the inputs, every tensor of the attention metadata and
  the tokens' LoRA slots go as one packed byte payload (one broadcast); the metadata's host values
  go in the header.
  Each rank uses its own KV cache (its KV heads) and attention backend.
- ``model.compute_logits(hidden)``: the hidden rows go by broadcast. The vocabulary-parallel
  head all-gathers the logits, so every rank must compute them for the same rows, and only
  rank 0 knows which rows the runner picked (sampling rows, prompt-logprob chunks).
- ``graphs.run(...)``: a decode step replayed from CUDA graphs (worker/cuda_graphs.py). Every
  rank captured the same batch buckets at once (the all-reduces inside each graph pair up as
  NCCL collectives captured with it), so a replay on rank 0 needs the same bucket's replay on
  every other rank; the graph's inputs go as one packed broadcast, outside the graph.

Mirroring calls rather than steps keeps the runner unaware of tensor parallelism: however it
prepares a batch (even from sampled ids it keeps on the device), what reaches the model is
what the workers replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch
import torch.distributed as dist

from tokenmill.attention.metadata import AttentionMetadata, ForwardContext
from tokenmill.distributed.messages import DecodeGraphCall, ForwardCall, LogitsCall, TensorSpec

if TYPE_CHECKING:
    from tokenmill.worker.worker import Worker

_ALIGN = 16  # bytes; every tensor in a payload starts aligned to its element size
_SCRATCH_FIELDS = ("backend_cache",)  # AttentionMetadata fields a backend fills during the forward


class Announcer(Protocol):
    """The other ranks, as rank 0 sees them (tokenmill.distributed.worker_processes)."""

    group: Any

    def announce(self, message: ForwardCall | LogitsCall | DecodeGraphCall) -> None: ...

    def step_guard(self) -> ContextManager[None]: ...


# ---- packing tensors into one broadcast -----------------------------------------------------


def pack(tensors: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, tuple[TensorSpec, ...]]:
    """Concatenate the tensors' bytes (each aligned) into one uint8 tensor on ``device``."""
    parts: list[torch.Tensor] = []
    specs: list[TensorSpec] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, offset))
        parts.append(raw)
        padding = -raw.numel() % _ALIGN
        if padding:
            parts.append(torch.zeros(padding, dtype=torch.uint8, device=device))
        offset += raw.numel() + padding
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return payload, tuple(specs)


def unpack(payload: torch.Tensor, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
    """The tensors of ``pack``, as views into ``payload``."""
    out = {}
    for spec in specs:
        numel = 1
        for size in spec.shape:
            numel *= size
        raw = payload[spec.offset : spec.offset + numel * spec.dtype.itemsize]
        out[spec.name] = raw.view(spec.dtype).view(spec.shape)
    return out


def encode_forward(
    input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata | None,
    lora_slots: torch.Tensor | None = None,
) -> tuple[ForwardCall, torch.Tensor]:
    tensors = {"input_ids": input_ids, "positions": positions}
    if lora_slots is not None:
        tensors["lora_slots"] = lora_slots
    host: dict[str, Any] | None = None
    if attn is not None:
        host = {}
        for f in dataclasses.fields(attn):
            if f.name in _SCRATCH_FIELDS:
                continue
            value = getattr(attn, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f.name] = value
            else:
                host[f.name] = value
    payload, specs = pack(tensors, input_ids.device)
    return ForwardCall(specs, payload.numel(), host), payload


# ---- rank 0 ---------------------------------------------------------------------------------


class MirroredModel:
    """Rank 0's model under tensor parallelism: each forward and compute_logits call is announced
    to the other ranks before it runs here. Every other attribute is the model's own.

    ``mirroring`` is switched off while collective_rpc runs a function on every rank at once:
    each rank then makes its own calls, and announcing them would make the workers run them twice.
    """

    def __init__(self, model: torch.nn.Module, followers: Announcer):
        self.model = model
        self.followers = followers
        self.mirroring = True

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not yet set (e.g. during unpickling): avoid endless recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if not self.mirroring:
            return self.model(input_ids, positions, ctx)
        with self.followers.step_guard():
            call, payload = encode_forward(input_ids, positions, ctx.attn, ctx.lora_slots)
            self.followers.announce(call)
            dist.broadcast(payload, group=self.followers.group, group_src=0)
            return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.mirroring:
            return self.model.compute_logits(hidden)
        with self.followers.step_guard():
            hidden = hidden.contiguous()
            self.followers.announce(LogitsCall(tuple(hidden.shape), hidden.dtype))
            dist.broadcast(hidden, group=self.followers.group, group_src=0)
            return self.model.compute_logits(hidden)


class MirroredGraphs:
    """Rank 0's decode graphs under tensor parallelism: each replay is announced to the other
    ranks, which replay the same bucket's graph with the inputs broadcast here. Every other
    attribute (max_batch, buckets...) is the graphs' own."""

    def __init__(self, graphs: Any, followers: Announcer):
        self.graphs = graphs
        self.followers = followers
        self.mirroring = True

    def __getattr__(self, name: str) -> Any:
        if name == "graphs":
            raise AttributeError(name)
        return getattr(self.graphs, name)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                      seq_lens=seq_lens, block_tables=block_tables)
        if lora_slots is not None:
            inputs["lora_slots"] = lora_slots
        if not self.mirroring:
            return self.graphs.run(**inputs)
        with self.followers.step_guard():
            payload, specs = pack(inputs, input_ids.device)
            self.followers.announce(DecodeGraphCall(specs, payload.numel()))
            dist.broadcast(payload, group=self.followers.group, group_src=0)
            return self.graphs.run(**inputs)


@contextlib.contextmanager
def mirroring_paused(*mirrored: Any) -> Any:
    """Within: rank 0's calls run locally only (objects other than a MirroredModel or
    MirroredGraphs, such as None or a one-rank model, are left alone)."""
    paused = [m for m in mirrored if isinstance(m, (MirroredModel, MirroredGraphs))]
    for m in paused:
        m.mirroring = False
    try:
        yield
    finally:
        for m in paused:
            m.mirroring = True


# ---- ranks 1..N-1 ---------------------------------------------------------------------------


@torch.inference_mode()
def replay(call: ForwardCall | LogitsCall | DecodeGraphCall, worker: "Worker", group: Any) -> None:
    """Run on this rank the call rank 0 announced, with the tensors it broadcasts."""
    runner = worker.runner
    if isinstance(call, LogitsCall):
        hidden = torch.empty(call.shape, dtype=call.dtype, device=runner.device)
        dist.broadcast(hidden, group=group, group_src=0)
        worker.model.compute_logits(hidden)
        return
    payload = torch.empty(call.payload_bytes, dtype=torch.uint8, device=runner.device)
    dist.broadcast(payload, group=group, group_src=0)
    tensors = unpack(payload, call.specs)
    if isinstance(call, DecodeGraphCall):
        if runner.graphs is None:
            raise RuntimeError(f"rank 0 replayed a decode graph, but rank {worker.rank} captured none")
        runner.graphs.run(**tensors)
        return
    input_ids, positions, lora_slots = tensors.pop("input_ids"), tensors.pop("positions"), tensors.pop("lora_slots", None)
    attn = AttentionMetadata(**tensors, **call.attn_values) if call.attn_values is not None else None
    worker.model(input_ids, positions, ForwardContext(attn, runner.kv_caches, runner.backend, lora_slots))
