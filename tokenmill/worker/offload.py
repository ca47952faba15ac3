"""``cpu_offload_gb``: part of the weights live in pinned CPU memory and stream to the GPU per layer.

Whole decoder layers are offloaded, as many as the budget asks for, spread evenly over the stack
and ending with the last layer, so every offloaded layer has computing layers before it. The
model is built on the CPU (its tensors allocated, not touched) and `place` moves each tensor
where it will live: offloaded layers' parameters into pinned CPU memory, everything else onto
the GPU; a model whose weights exceed the GPU's budget never sits there whole.

Two GPU staging buffers, each the size of one offloaded layer, take turns. At the start of a
forward the first offloaded layer is copied into buffer 0 on a side stream; when offloaded layer
j starts, the compute stream waits for its copy, its parameters are pointed into its buffer, and
layer j+1's copy is queued into the other buffer, after the compute that last read that buffer
(an event recorded when layer j-1 finished). So each copy overlaps the layers before its own.
When layer j has been launched its parameters point back at their pinned CPU copies, so loading,
`update_weights` and `sleep` always see the weights where they live. The cost is one host-to-
device copy of the offloaded bytes per forward (bench/gpu_suite.sh part ``offload``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)
_ALIGN = 256  # bytes: every parameter's view starts on a boundary the kernels like


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    stack = getattr(model, "model", model)
    layers = getattr(stack, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"cpu_offload_gb needs a model with decoder layers; {type(model).__name__} has none")
    return layers


def choose_layers(layer_bytes: list[int], budget: int) -> list[int]:
    """Indices of the layers to offload: enough to cover ``budget`` bytes, evenly spread, the last included."""
    count = len(layer_bytes)
    needed, total = 0, 0
    for size in sorted(layer_bytes, reverse=True):
        if total >= budget:
            break
        total += size
        needed += 1
    return sorted({count - 1 - (i * count) // needed for i in range(needed)}) if needed else []


class LayerOffloader:
    """Streams the offloaded layers of one model (see the module docstring)."""

    def __init__(self, budget_bytes: int, device: torch.device):
        self.budget_bytes = budget_bytes
        self.device = device
        self.layers: list[nn.Module] = []  # the offloaded ones, in forward order
        self._params: list[list[nn.Parameter]] = []
        self._offsets: list[list[int]] = []
        self._buffer_bytes = 0
        self._buffers: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._on_gpu = device.type == "cuda"
        self._stream: Any = None
        self._copied: list[Any] = []  # per offloaded layer: its copy is done
        self._released: list[Any] = []  # per buffer: the compute that last read it is done
        self._homes: dict[int, list[torch.Tensor]] = {}  # layers in their buffer: their CPU tensors

    @property
    def offloaded_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for params in self._params for p in params)

    # ---- set-up ---------------------------------------------------------------------------------
    def place(self, model: nn.Module) -> None:
        """Move the CPU-built model's tensors where they live and hook the offloaded layers
        (the loader calls this before reading the weights)."""
        layers = decoder_layers(model)
        sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
        chosen = set(choose_layers(sizes, self.budget_bytes))
        offloaded_params = {id(p) for i in chosen for p in layers[i].parameters()}
        for param in model.parameters():  # each once (a tied weight is one parameter); the loader fills them
            if id(param) in offloaded_params:
                param.data = _pinned_like(param) if self._on_gpu else torch.empty_like(param, device="cpu")
            else:
                param.data = torch.empty_like(param, device=self.device)
        for module in model.modules():
            build = getattr(module, "build_buffers", None)
            if build is not None:
                with torch.device(self.device):
                    build()  # derived tables computed on the device, as when built there
        for buffer in model.buffers():
            buffer.data = buffer.data.to(self.device)  # any other buffer: moved as built
        self.layers = [layers[i] for i in sorted(chosen)]
        self._params = [list(layer.parameters()) for layer in self.layers]
        self._offsets = []
        for params in self._params:
            offsets, end = [], 0
            for p in params:
                offsets.append(end)
                end += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
            self._offsets.append(offsets)
            self._buffer_bytes = max(self._buffer_bytes, end)
        self.allocate_buffers()
        if self._on_gpu:
            self._stream = torch.cuda.Stream(self.device)
            self._copied = [torch.cuda.Event() for _ in self.layers]
            self._released = [torch.cuda.Event() for _ in self._buffers]
        getattr(model, "model", model).register_forward_pre_hook(lambda module, args: self._start_forward())
        for j, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda module, args, j=j: self._before(j))
            layer.register_forward_hook(lambda module, args, output, j=j: self._after(j))
        logger.info("cpu_offload_gb: %d of %d decoder layers (%.2f GiB) stream from pinned CPU memory",
                    len(self.layers), len(layers), self.offloaded_bytes / 2**30)
        if self.offloaded_bytes < self.budget_bytes:
            logger.warning("cpu_offload_gb asks for %.2f GiB but the decoder layers hold %.2f GiB; the embeddings "
                           "and the LM head stay on the GPU", self.budget_bytes / 2**30, self.offloaded_bytes / 2**30)

    def allocate_buffers(self) -> None:
        """The staging buffers (again after `free_buffers`, when the engine wakes up)."""
        count = min(2, len(self.layers))
        self._buffers = [torch.empty(self._buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self._views = [
            [_view(self._buffers[j % count], offset, p) for p, offset in zip(params, offsets)]
            for j, (params, offsets) in enumerate(zip(self._params, self._offsets))
        ]

    def free_buffers(self) -> None:
        """Give the staging buffers' memory back (sleep), once no copy into them is pending."""
        if self._on_gpu:
            torch.cuda.synchronize(self.device)
        self._buffers, self._views = [], []

    # ---- one forward --------------------------------------------------------------------------
    def _start_forward(self) -> None:
        self.point_home()  # a forward that failed midway may have left a layer in its buffer
        self._prefetch(0)

    def _prefetch(self, j: int) -> None:
        """Queue offloaded layer j's copy into its buffer."""
        if j >= len(self.layers):
            return
        params, views = self._params[j], self._views[j]
        if not self._on_gpu:
            for view, param in zip(views, params):
                view.copy_(param.data)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._released[j % len(self._buffers)])
            for view, param in zip(views, params):
                view.copy_(param.data, non_blocking=True)
            self._copied[j].record(self._stream)

    def _before(self, j: int) -> None:
        if self._on_gpu:
            torch.cuda.current_stream(self.device).wait_event(self._copied[j])
        self._homes[j] = [param.data for param in self._params[j]]
        for view, param in zip(self._views[j], self._params[j]):
            param.data = view
        self._prefetch(j + 1)

    def _after(self, j: int) -> None:
        if self._on_gpu:
            self._released[j % len(self._buffers)].record(torch.cuda.current_stream(self.device))
        # The launched kernels hold their pointers, and the buffer is not rewritten before the event.
        self._point_home(j)

    def point_home(self) -> None:
        """Every offloaded parameter at its pinned CPU copy (as it is between forwards)."""
        for j in list(self._homes):
            self._point_home(j)

    def _point_home(self, j: int) -> None:
        for param, home in zip(self._params[j], self._homes.pop(j, [])):
            param.data = home


def _pinned_like(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(param.shape, dtype=param.dtype, pin_memory=True)


def _view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    nbytes = param.numel() * param.element_size()
    return buffer[offset : offset + nbytes].view(param.dtype).view(param.shape)
