"""Runs one step of a pooling model: whole prompts in one flat batch, one forward, then each
request's pooled result (an embedding, per-token embeddings, or class probabilities).

There is no KV cache and no sampler. Rows that want the same post-processing (the same task,
dimensions, normalize and activation) are handled together, so a step of a thousand embeddings
is a handful of tensor operations, and results leave the device once per group.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.attention.prefill import PrefillAttentionBackend, whole_prompt_metadata
from tokenmill.pooling.poolers import activate, finish_embeddings, pool
from tokenmill.pooling.request import PoolingRequest

if TYPE_CHECKING:
    from tokenmill.engine.request import Sequence
    from tokenmill.engine.step import SchedulerOutput
    from tokenmill.pooling.config import PoolingModelConfig


class PoolingRunner:
    def __init__(self, model: nn.Module, device: torch.device, pooling: "PoolingModelConfig"):
        self.model = model
        self.device = device
        self.pooling = pooling
        assert pooling.pooler.pooling_type is not None, "resolve_pooling decides the pooling type"
        self.pooling_type: str = pooling.pooler.pooling_type
        self.backend = PrefillAttentionBackend()
        # Decoder layers look up their cache by layer index; a pooling model has none.
        self.no_cache: list = [None] * getattr(model, "num_layers", 0)

    @torch.inference_mode()
    def execute(self, plan: "SchedulerOutput[Sequence]") -> list[torch.Tensor]:
        """The pooled output of every scheduled sequence (whole prompts), as CPU float32 tensors."""
        seqs = [item.seq for item in plan.scheduled]
        lens = [item.num_tokens for item in plan.scheduled]
        assert all(n == seq.num_prompt_tokens for n, seq in zip(lens, seqs)), "pooling runs whole prompts"
        return self._outputs(self._forward(seqs, lens), seqs, lens)

    def _forward(self, seqs: list["Sequence"], lens: list[int]) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch of whole prompts."""
        dev = self.device
        ids = torch.tensor([t for seq in seqs for t in seq.prompt_token_ids], dtype=torch.int64).to(dev)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(dev)
        ctx = ForwardContext(whole_prompt_metadata(lens, dev), self.no_cache, self.backend)
        types = [_pooling_request(seq).token_type_ids for seq in seqs]
        if not (self.pooling.takes_token_type_ids and any(t is not None for t in types)):
            return self.model(ids, positions, ctx)
        flat = [t for n, tt in zip(lens, types) for t in (tt if tt is not None else [0] * n)]
        return self.model(ids, positions, ctx, token_type_ids=torch.tensor(flat, dtype=torch.int64).to(dev))

    def _outputs(self, hidden: torch.Tensor, seqs: list["Sequence"], lens: list[int]) -> list[torch.Tensor]:
        """Each sequence's result: its rows pooled, then its task's head and post-processing."""
        dev = self.device
        first_token = [0, *itertools.accumulate(lens)]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for row, seq in enumerate(seqs):
            p = _pooling_request(seq).params
            groups[(p.task, p.dimensions, p.normalize, p.use_activation)].append(row)
        results: dict[int, torch.Tensor] = {}
        pooled = None
        for (task, dimensions, normalize, use_activation), rows in groups.items():
            if task == "token_embed":
                for row in rows:
                    tokens = hidden[first_token[row] : first_token[row] + lens[row]]
                    results[row] = finish_embeddings(tokens, dimensions, normalize).cpu()
                continue
            if pooled is None:
                starts = torch.tensor(first_token[:-1], dtype=torch.int64).to(dev)
                pooled = pool(hidden, starts, torch.tensor(lens, dtype=torch.int64).to(dev), self.pooling_type)
            index = torch.tensor(rows, dtype=torch.int64).to(dev)
            if task == "embed":
                out = finish_embeddings(pooled[index], dimensions, normalize)
            else:
                logits = self.model.classify(pooled[index]).float()
                activation = self.pooling.score_activation if task == "score" else self.pooling.classify_activation
                assert activation is not None, "the engine accepts score requests only for cross-encoders"
                out = activate(logits, activation) if use_activation else logits
            for row, value in zip(rows, out.cpu()):
                results[row] = value
        return [results[row] for row in range(len(seqs))]


def _pooling_request(seq: "Sequence") -> PoolingRequest:
    request = seq.request
    assert isinstance(request, PoolingRequest), "the pooling engine makes only PoolingRequests"
    return request
