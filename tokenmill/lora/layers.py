"""The low-rank update of one linear layer, for every token of a step at once.

Each adapted layer keeps every device slot's adapter side by side: A of slot s (sublayer j: q, k
or v of a stacked q/k/v, gate or up of gate/up) in rows [(j S + s) R, ... + R) of ``a``, and B,
times the adapter's scaling, in the same columns of ``b``, in its sublayer's output rows (zeros
elsewhere; ranks below R padded with zeros). A step then costs two small GEMMs whatever its mix of
adapters: ``t = x a^T`` ([T, J S R]), each token's columns of slots other than its own set to zero
by a mask, and ``y += t b^T``. The columns are cleared (``masked_fill_``) rather than multiplied by
a one-hot mask: an adapter whose finite weights overflow fp16 gives inf in its columns for every
token, and inf * 0 would make every token of the step NaN; cleared, the overflow stays with its own
requests. In place and with a Python zero, not ``torch.where(mask, t, 0)``, which copies its scalar
to the device on every call: one more node a layer in the decode graphs, 2% of a four-adapter P1
(docs/perf.md 118). With S R a few dozen against thousands of features that is a few percent of the
layer's own work; there are no per-adapter shapes, so CUDA graphs capture it as is.

Under tensor parallelism the layer's own split applies: a column-parallel layer keeps all of A and
its rows of B, a row-parallel one its columns of A and all of B, and its update joins the partial
sums before the all-reduce (the shrink is linear in the input, so the ranks' parts add up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LoRABatch:
    """This step's adapter slot per token, as the mask every layer reads: ``other_slots`` [T, S] bool,
    True where a slot is not the token's own (None when no token of the step has an adapter). One
    per model, set at the start of each forward from the forward context (``begin``)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self._slot_ids = torch.arange(num_slots, dtype=torch.int32, device=device)
        self.other_slots: torch.Tensor | None = None

    def begin(self, token_slots: torch.Tensor | None) -> None:
        """``token_slots``: [T] int32, each token's slot (-1: the base model), or None."""
        self.other_slots = None if token_slots is None else token_slots[:, None] != self._slot_ids[None, :]


class LoRAUpdate:
    """x A^T B^T of each token's adapter, added to one linear layer's output (see the module docstring)."""

    # Deterministic mode points this at the batch-invariant product, as for the layers' own.
    matmul = staticmethod(F.linear)

    def __init__(self, batch: LoRABatch, in_features: int, out_features: int, num_sublayers: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch = batch
        self.num_sublayers = num_sublayers
        self.max_rank = max_rank
        width = num_sublayers * batch.num_slots * max_rank
        self.a = torch.zeros(width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, width, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        other_slots = self.batch.other_slots
        if other_slots is None:
            return y
        tokens = x.shape[0]
        t = self.matmul(x, self.a).view(tokens, self.num_sublayers, self.batch.num_slots, self.max_rank)
        t = t.masked_fill_(other_slots[:, None, :, None], 0).view(tokens, -1)
        if self.matmul is F.linear:
            return torch.addmm(y, t, self.b.t())
        return y + self.matmul(t, self.b)

    def columns(self, slot: int, sublayer: int) -> slice:
        start = (sublayer * self.batch.num_slots + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, sublayer: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A [r, in] and B [out, r] (scaled, this rank's part) into ``slot``; r <= max_rank."""
        cols = self.columns(slot, sublayer)
        rank = a.shape[0]
        self.a[cols].zero_()
        self.a[cols][:rank].copy_(a)
        self.b[:, cols].zero_()
        self.b[:, cols][:, :rank].copy_(b)

    def clear_slot(self, slot: int) -> None:
        for sublayer in range(self.num_sublayers):
            cols = self.columns(slot, sublayer)
            self.a[cols].zero_()
            self.b[:, cols].zero_()
