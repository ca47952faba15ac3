"""A CPU stand-in for the decode CUDA graphs, to test their tensor-parallel mirroring over gloo.

``EagerDecodeGraphs.run`` takes what ``DecodeGraphs.run`` takes and runs the rank's own model
(never rank 0's MirroredModel, which would announce a second call) eagerly on those tensors; it
records the batch size of every run, so a test can check that every rank replayed the same steps.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention.metadata import AttentionMetadata, ForwardContext


class EagerDecodeGraphs:
    def __init__(self, worker: Any, max_batch: int):
        self.model = worker.model  # the rank's own model: on rank 0, runner.model mirrors its calls
        self.runner = worker.runner
        self.max_batch = max_batch
        self.runs: list[int] = []

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        self.runs.append(n)
        lens = seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=input_ids.device),
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=self.runner.block_size,
            query_lens_host=[1] * n,
            seq_lens_host=lens,
            max_query_len=1,
            max_seq_len=max(lens),
        )
        with torch.inference_mode():
            return self.model(input_ids, positions, ForwardContext(meta, self.runner.kv_caches, self.runner.backend))


def install_eager_graphs(worker: Any, max_batch: int) -> None:
    """collective_rpc target: give this rank's runner the stand-in (then Executor.mirror_decode_graphs)."""
    worker.runner.graphs = EagerDecodeGraphs(worker, max_batch)


def graph_runs(worker: Any) -> list[int]:
    """collective_rpc target: the batch sizes this rank's stand-in ran."""
    return list(worker.runner.graphs.runs)
