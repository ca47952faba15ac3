"""The engine's books on adapters: the checked ones by id, which sits in which device slot, pins.

Adapters are checked when a request (or ``add_lora``) first names them (`inspect_adapter`); a
step's adapters get device slots just before it launches (`place`), loading those not already in
one into a free slot or the one used longest ago by no adapter of this step. The scheduler never
puts more than ``max_loras`` adapters in one step, so every step's adapters fit. A pinned adapter
keeps its slot while any other slot can take the newcomer. Loading goes through ``load``
(``collective_rpc("load_lora", ...)``: every rank loads its part), queued on the device after the
step in flight, so that step still reads the slot's old weights. An adapter read again from its
folder (not cached in CPU memory, ``max_cpu_loras``) may fail to load long after it was checked, its
folder deleted or rewritten meanwhile: `place` raises `AdapterLoadError` naming it, and the engine
fails only that adapter's requests (`forget` drops it, so a later request naming it is checked anew).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from tokenmill.fatal_errors import is_device_failure, is_engine_stopped
from tokenmill.lora.adapter import AdapterSpec, inspect_adapter

if TYPE_CHECKING:
    from tokenmill.lora.config import LoRAConfig
    from tokenmill.lora.request import LoRARequest


class AdapterLoadError(RuntimeError):
    """An adapter checked earlier could not be loaded into a device slot (``spec``: which one)."""

    def __init__(self, spec: AdapterSpec, error: BaseException):
        super().__init__(f"LoRA adapter {spec.name!r} (lora_int_id={spec.lora_int_id}, {spec.path}) could not be loaded: "
                         f"{type(error).__name__}: {error}")
        self.spec = spec


class AdapterBook:
    def __init__(self, config: "LoRAConfig", targets: dict[str, tuple[int, int]],
                 load: Callable[[int, AdapterSpec], None], excluded: set[str] | None = None):
        self.config = config
        self.targets = targets  # module name -> (in, out) features: what adapters may adapt
        self.excluded = frozenset(excluded or ())  # adaptable modules lora_target_modules leaves out
        self._load = load
        self.specs: dict[int, AdapterSpec] = {}  # by lora_int_id: the adapters known now
        self.pinned: set[int] = set()  # lora_int_ids
        self._slot_of: dict[int, int] = {}  # AdapterSpec.uid -> device slot
        self._last_used = [-1] * config.max_loras  # per slot: the step that last used it (-1: free)
        self._steps = itertools.count()
        self._uids = itertools.count(1)

    def register(self, request: "LoRARequest") -> AdapterSpec:
        """The checked adapter of ``request`` (read again with ``load_inplace``); a ValueError names
        what is wrong with it. An id already known under another name or folder is refused."""
        from tokenmill.lora.request import LoRARequest

        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a tokenmill.lora.request.LoRARequest, got {type(request).__name__}")
        known = self.specs.get(request.lora_int_id)
        if known is not None and (known.name != request.lora_name or known.path != str(Path(request.lora_path).expanduser())):
            raise ValueError(f"lora_int_id={request.lora_int_id} is already the adapter {known.name!r} ({known.path}); "
                             f"give {request.lora_name!r} ({request.lora_path}) an id of its own")
        if known is not None and not request.load_inplace:
            return known
        spec = inspect_adapter(request, self.targets, self.config.max_rank, next(self._uids), self.excluded)
        self.specs[spec.lora_int_id] = spec
        return spec

    def remove(self, lora_id: int) -> bool:
        """Forget the adapter (requests already holding it still finish with it)."""
        self.pinned.discard(lora_id)
        spec = self.specs.pop(lora_id, None)
        if spec is None:
            return False
        slot = self._slot_of.pop(spec.uid, None)
        if slot is not None:
            self._last_used[slot] = -1
        return True

    def forget(self, spec: AdapterSpec) -> None:
        """Drop an adapter that failed to load, unless its id names a newer one (``load_inplace``)."""
        if self.specs.get(spec.lora_int_id) is spec:
            self.remove(spec.lora_int_id)

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.specs:
            return False
        self.pinned.add(lora_id)
        return True

    def place(self, adapters: Iterable[AdapterSpec]) -> dict[int, int]:
        """Device slots for one step's adapters (at most max_loras of them), loading those not in one."""
        step = next(self._steps)
        wanted = {spec.uid: spec for spec in adapters}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, above max_loras={self.config.max_loras}")
        slots = {}
        for uid, spec in wanted.items():
            slot = self._slot_of.get(uid)
            if slot is None:
                slot = self._free_slot(set(wanted))
                try:
                    self._load(slot, spec)
                except Exception as error:
                    if is_device_failure(error) or is_engine_stopped(error):
                        raise
                    raise AdapterLoadError(spec, error) from error
                self._slot_of[uid] = slot
            self._last_used[slot] = step
            slots[uid] = slot
        return slots

    def _free_slot(self, needed: set[int]) -> int:
        """A free slot, else the one used longest ago by no adapter of this step, sparing pinned ones."""
        holder = {slot: uid for uid, slot in self._slot_of.items()}
        candidates = [s for s in range(self.config.max_loras) if holder.get(s) not in needed]
        free = [s for s in candidates if s not in holder]
        if free:
            return free[0]
        pinned = {spec.uid for lora_id, spec in self.specs.items() if lora_id in self.pinned}
        unpinned = [s for s in candidates if holder[s] not in pinned]
        slot = min(unpinned or candidates, key=lambda s: self._last_used[s])
        del self._slot_of[holder[slot]]
        return slot
