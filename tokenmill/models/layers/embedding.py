"""Token embedding and LM head split along the vocabulary across tensor-parallel ranks.

The vocabulary is padded up to a multiple of ``tp_size`` so every rank owns the same number of
rows; the padding rows are zero and their logits are dropped before the sampler sees them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear import LoadedWeight, check_shape


class VocabParallelEmbedding(nn.Module):
    """Rank r owns vocabulary rows [r * rows, (r + 1) * rows); others' ids embed to 0, then all-reduce."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.rows_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_partition
        self.vocab_end = min(self.vocab_start + self.rows_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None) -> None:
        check_shape(param, loaded_weight, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding(torch.where(local, input_ids - self.vocab_start, 0), self.weight)
        out = out * local.unsqueeze(-1).to(out.dtype)
        torch.distributed.all_reduce(out, group=self.tp_group)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    matmul = staticmethod(F.linear)  # as in UnquantizedLinearMethod (linear.py)
    cpu_packed: Any = None  # on the CPU, a PackedWeight of the weight (cpu_packed.pack_linear_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits: call compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model's dtype (the sampler upcasts where it computes)."""
        packed = self.cpu_packed
        logits = self.matmul(hidden, self.weight) if packed is None else packed.linear(hidden, self.weight, None)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.num_embeddings]
