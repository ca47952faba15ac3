"""Batch-level logits processors, vLLM V1's interface: ``LLM(logits_processors=[MyProcessor])``.

A processor class is built once per engine (``cls(config, device, is_pin_memory)``). Before each
step's draw the runner tells every instance how the rows of the step's logits changed
(``update_state(BatchUpdate)``: rows added with their request's SamplingParams, prompt ids and a
reference to its live output-id list; rows removed; ``None`` when nothing changed), then calls
``apply(logits)`` on the float32 logits of the rows that sample, one row per sequence. A script
written for vLLM keeps its class and changes the import (``vllm.v1.sample.logits_processor`` ->
``tokenmill.logits_processor``); a class is given as itself or as ``"module:Class"``.

Rows are the step's sampling sequences in the runner's order; a sequence that lands on another
row than in the previous step is re-added there (vLLM allows an add to replace a row), so a
processor sees no moves. Steps run synchronously while processors are installed, so every output
list is complete when ``apply`` runs.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, Union

if TYPE_CHECKING:
    import torch

    from tokenmill.sampling_params import SamplingParams

T = TypeVar("T")


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the request at index a moves to index b
    SWAP = enum.auto()  # the requests at a and b trade places


# (row, its SamplingParams, prompt ids, the live list of output ids)
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]
# vLLM's name for what AdapterLogitsProcessor.new_req_logits_processor returns: a per-request
# processor fn(output_ids, row) or fn(prompt_ids, output_ids, row). Scripts annotate with it
# (``-> RequestLogitsProcessor | None``, evaluated when the class is defined), so it is a real alias.
RequestLogitsProcessor = Union[
    Callable[[list[int], "torch.Tensor"], "torch.Tensor"],
    Callable[[list[int], list[int], "torch.Tensor"], "torch.Tensor"],
]


@dataclass(frozen=True)
class BatchUpdate:
    """How the rows changed since the previous step: apply ``removed``, then ``added``, then ``moved``."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM's V1 logits-processor interface (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        """Raise ValueError for a request this processor cannot take (called when it is added)."""

    @abstractmethod
    def __init__(self, vllm_config: Any, device: "torch.device", is_pin_memory: bool) -> None: ...

    @abstractmethod
    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        """The step's [rows, vocab] float32 logits, processed (in place or a new tensor)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a greedy row's choice (vLLM then skips greedy rows;
        here every row is processed, which gives the same tokens)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """The rows' changes since the previous step (None: none)."""


def process_dict_updates(
    req_entries: dict[int, T], batch_update: BatchUpdate | None,
    new_state: Callable[["SamplingParams", "list[int] | None", "list[int]"], T | None],
) -> bool:
    """vLLM's helper for processors that keep a state per row in a dict: ``new_state`` gives an
    added row's state (None: the processor leaves that row alone). Returns whether anything changed."""
    if not batch_update:
        return False
    updated = False
    for index in batch_update.removed:
        updated |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        else:
            updated |= req_entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        a_entry, b_entry = req_entries.pop(a, None), req_entries.pop(b, None)
        if a_entry is not None:
            req_entries[b] = a_entry
        if b_entry is not None and direction is MoveDirectionality.SWAP:
            req_entries[a] = b_entry
        updated |= a_entry is not None or b_entry is not None
    return updated


class AdapterLogitsProcessor(LogitsProcessor):
    """vLLM's wrapper that runs a per-request processor (``fn(output_ids, row)`` or
    ``fn(prompt_ids, output_ids, row)``) on each row whose params ``new_req_logits_processor`` accepts."""

    def __init__(self, vllm_config: Any, device: "torch.device", is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[["torch.Tensor"], "torch.Tensor"]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: "SamplingParams") -> RequestLogitsProcessor | None:
        """The request's processor, or None to leave its rows alone."""

    def _new_state(self, params: "SamplingParams", prompt_ids: "list[int] | None", output_ids: "list[int]"):
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        for row, fn in self.req_info.items():
            logits[row] = fn(logits[row])
        return logits


def load_logits_processor_classes(specs: Sequence[Any]) -> list[type]:
    """The classes ``LLM(logits_processors=[...])`` names: classes, or ``"module:Class"`` strings."""
    classes = []
    for i, spec in enumerate(specs):
        where = f"logits_processors[{i}]"
        cls = _import_class(spec, where) if isinstance(spec, str) else spec
        missing = [m for m in ("apply", "update_state", "is_argmax_invariant") if not callable(getattr(cls, m, None))]
        if not isinstance(cls, type) or missing:
            raise ValueError(f"{where}={spec!r} is not a logits processor class: it needs "
                             f"{missing or ['to be a class']} (tokenmill.logits_processor.LogitsProcessor)")
        classes.append(cls)
    return classes


def _import_class(spec: str, where: str) -> Any:
    module_name, _, qualname = spec.partition(":")
    if not qualname:
        raise ValueError(f"{where}={spec!r} is invalid: give a class, or its name as 'module:Class'")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{where}={spec!r} cannot be loaded: {exc}") from exc
    return found


class BatchLogitsProcessors:
    """The engine's processor instances and the rows they saw last: what the runner calls each step."""

    def __init__(self, classes: Sequence[type], config: Any, device: "torch.device", is_pin_memory: bool):
        self.processors = [cls(config, device, is_pin_memory) for cls in classes]
        self._rows: list[int] = []  # the sequence id on each row of the previous step

    def update(self, seqs: Sequence[Any]) -> None:
        """Tell every processor how this step's rows (``seqs``, StepSequences) differ from the last step's."""
        rows = [s.seq_id for s in seqs]
        added = [(i, s.params, s.prompt_token_ids, s.output_token_ids) for i, s in enumerate(seqs)
                 if i >= len(self._rows) or self._rows[i] != s.seq_id]
        removed = list(range(len(rows), len(self._rows)))
        self._rows = rows
        update = BatchUpdate(len(rows), removed, added, []) if added or removed else None
        for processor in self.processors:
            processor.update_state(update)

    def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
        for processor in self.processors:
            logits = processor.apply(logits)
        return logits
