"""A step's grammar bitmask (structured outputs) on the device, through a pinned buffer kept
across steps: a fresh mask a step (10 MB at 512 rows of a 152K vocabulary) cost an allocation, its
page faults and a second copy to pin it."""

from __future__ import annotations

from typing import Any

import torch


class GrammarMaskStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self._staging: torch.Tensor | None = None  # pinned, [rows, ceil(V / 32)] int32, grown as needed
        self._copied: torch.cuda.Event | None = None  # the end of the last copy out of it

    def mask(self, grammars: Any, matchers: list) -> torch.Tensor:
        """The matchers' bitmask on the device (the engine's GrammarCache fills it). On a GPU the
        host writes the staging buffer once the previous step's copy out of it is done."""
        if self.device.type != "cuda":
            return grammars.bitmask(matchers)
        staging = self._staging
        if staging is None or staging.shape[0] < len(matchers):
            # A dropped buffer stays reserved until its copy is done (the pinned allocator's events).
            rows = max(len(matchers), 2 * staging.shape[0] if staging is not None else 0)
            self._staging = torch.empty((rows, -(-grammars.vocab_size // 32)), dtype=torch.int32, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()
        mask = grammars.bitmask(matchers, out=self._staging).to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return mask
