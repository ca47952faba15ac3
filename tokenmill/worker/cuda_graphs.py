"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step of a small model launches hundreds of short kernels; on an H200 the launches,
not the arithmetic, would set the pace. Capturing the forward once per bucket and replaying it
costs one launch. Everything a replay reads lives in static buffers filled before each replay:
token ids, positions, slots (-1 for padding rows, so they store nothing), query starts and
context lengths (padding rows get no query tokens and no context, so attention skips them) and
block tables. Under tensor parallelism each graph also holds the NCCL all-reduces of its
forward (the communicator exists by then: the profiling forward used it); every rank captures
and replays the same buckets (distributed/mirror.py). The attention backend is told the
largest context a replay may see (max_model_len), so the launch shape baked into a graph suits
every replay. With LoRA adapters (``lora``) each bucket has two graphs: one with the adapters'
updates, whose tokens' adapter slots are one more static buffer (-1, the base model, for padding
rows and rows without an adapter), and one without them for steps where no row has an adapter
(as vLLM's ``cudagraph_specialize_lora``: the updates cost ~20% of a small model's decode step
even when every row is on the base model). With ``overlap`` (an
experiment, see micro_batches.py) a graph of at least ``Overlap.MIN_DECODE_BATCH`` rows holds two
half-batch forwards on two streams instead of one.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext
from tokenmill.worker.micro_batches import Overlap, forward_micro_batches

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16 to 64, 32 to 256, 64 to 512 and 128 beyond.

    Coarse steps at large batches cost little: a padding row has no context, so attention skips
    it, and the extra GEMM rows are cheap next to the weight reads. Fewer graphs start faster.
    """
    sizes = [1, 2, 4, 8, *range(16, 65, 16), *range(96, 257, 32), *range(320, 513, 64), *range(640, max_num_seqs + 128, 128)]
    return sorted({min(b, max_num_seqs) for b in sizes})


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        overlap: bool = False,
        lora: bool = False,
    ):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self._arange = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.query_start_loc = self._arange.clone()
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=device) if lora else None
        # (bucket, with the LoRA updates) -> the graph and its output
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.side_stream = torch.cuda.Stream(device) if overlap else None

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            block_size=self.block_size,
            query_lens_host=[1] * batch,
            seq_lens_host=[self.max_model_len] * batch,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, batch: int, adapters: bool) -> torch.Tensor:
        meta = self._metadata(batch)
        if self.side_stream is not None and batch >= Overlap.MIN_DECODE_BATCH:
            return forward_micro_batches(
                self.model, self.input_ids[:batch], self.positions[:batch], meta, self.kv_caches, self.backend,
                batch // 2, self.side_stream,
            )
        lora_slots = self.lora_slots[:batch] if adapters else None
        ctx = ForwardContext(meta, self.kv_caches, self.backend, lora_slots)
        return self.model(self.input_ids[:batch], self.positions[:batch], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        # cuBLAS keeps one workspace per (handle, stream) for the life of the process (32 MiB on
        # Hopper). One first made during a capture lands in the graph's private pool and would
        # outlive our graphs (and sleep); one made before would be baked into them without being
        # ours. Dropping the cached workspaces on both sides makes the captures allocate their own
        # inside our pool (shared by every bucket) and leaves nothing of it behind in the cache;
        # the eager steps simply make theirs again. torch's Inductor does the same around its captures.
        torch._C._cuda_clearCublasWorkspaces()
        variants = (True, False) if self.lora_slots is not None else (False,)
        # Largest first, so smaller graphs fit inside the memory pool the largest one reserved.
        for batch in reversed(self.buckets):
            for adapters in variants:
                self._forward(batch, adapters)  # warm-up: compiles the Triton kernels for this shape outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: only this thread's calls are checked during capture. Under tensor
                # parallelism NCCL's watchdog thread polls the events of collectives finished before
                # the capture; in the default (global) mode that poll would invalidate it.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    hidden = self._forward(batch, adapters)
                pool = graph.pool()
                self.graphs[batch, adapters] = (graph, hidden)
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        logger.info("captured %d decode CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - start)

    def bucket_for(self, num_seqs: int) -> int | None:
        for batch in self.buckets:
            if batch >= num_seqs:
                return batch
        return None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph of the smallest bucket holding this batch; returns hidden [num_seqs, H].
        ``lora_slots``: each row's adapter slot (None: no row has an adapter)."""
        n = input_ids.shape[0]
        batch = self.bucket_for(n)
        assert batch is not None, f"decode batch {n} is larger than the captured {self.max_batch}"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:batch].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:batch].fill_(0)
        # Padding rows get no query tokens: attention leaves them alone.
        self.query_start_loc[: n + 1].copy_(self._arange[: n + 1])
        self.query_start_loc[n + 1 : batch + 1].fill_(n)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        adapters = self.lora_slots is not None and lora_slots is not None
        if adapters:
            self.lora_slots[:n].copy_(lora_slots, non_blocking=True)
            self.lora_slots[n:batch].fill_(-1)
        graph, hidden = self.graphs[batch, adapters]
        graph.replay()
        return hidden[:n]
