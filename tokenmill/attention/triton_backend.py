"""Attention on the GPU through our Triton kernels: same contract as ``TorchAttentionBackend``.

``forward`` stores the step's keys and values by ``slot_mapping`` (slot -1 = padding, skipped) and
runs the unified paged attention kernel over the flattened batch; a step's decodes, when there are
many, go to the item-queue decode kernel instead (``paged_attention_queue.py``: longest contexts
first, so a ragged step does not end on a few long programs). Nothing in it syncs with the
device or allocates a data-dependent amount of memory, so the runner can capture it in a CUDA
graph:
- the kernels read lengths, starts and block tables only from the metadata tensors;
- the grids come from tensor shapes (T, B, heads), never from lengths;
- the host ints ``meta.max_query_len`` and ``meta.max_seq_len`` only pick tile shapes and the
  number of key splits (any values give correct results). For graph capture the runner must pass
  the static upper bounds it captures for (``max_query_len`` 1 for decode, ``max_seq_len`` the
  largest context a replay may see, e.g. max_model_len), so the choice baked into the graph
  suits every replay; a replay with shorter contexts then just has split programs that exit early.

``forward_qkv`` (the ``FusedQKVBackend`` method the decoder layers use) takes the raw qkv
projection output instead of q, k, v: one kernel (``kernels/triton/qkv_prologue.py``) applies the
optional q/k norms and rotary, stores k and v in the cache and writes q, then attention runs as in
``forward``. That replaces up to five launches per layer (q_norm, k_norm, v copy, rotary,
store) with one, and is graph-safe for the same reasons.

Triton is imported on first use, so ``import tokenmill`` never pays for it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from tokenmill.attention.metadata import AttentionMetadata, QKVPrologue

if TYPE_CHECKING:
    import torch


class TritonAttentionBackend:
    """Paged attention for CUDA tensors (or any device under ``TRITON_INTERPRET=1``).

    ``deterministic``: every step launches the batch-invariant variant (one tile shape for decode
    and prefill, fixed key parts merged in order; ``choose_config(deterministic=True)``).
    ``decode_queue``: whether a step's decodes (a pure decode step, or a mixed step's leading ones)
    run on the item queue (``kernels/triton/paged_attention_queue.py``): ``None`` where
    ``queue_pays`` says it is faster (many decodes), ``True`` always, ``False`` never; not with
    ``deterministic``.
    ``side_decodes``: queue programs an SM for a mixed step's queued decodes, run on a side stream
    beside the prefill launch (0: one after the other, on the step's stream). Few programs an SM
    leave room on each SM for a prefill program, so the memory-bound decodes and the compute-bound
    chunks can share the SMs (``bench/prefill_step_bench.py --coresident``).
    """

    def __init__(self, deterministic: bool = False, decode_queue: bool | None = None, side_decodes: int = 0) -> None:
        # Deferred so that building the backend object is free and triton loads on the first step.
        from tokenmill.kernels.triton.kv_store import store_kv
        from tokenmill.kernels.triton.paged_attention import paged_attention
        from tokenmill.kernels.triton.paged_attention_config import choose_configs, launch_configs
        from tokenmill.kernels.triton.qkv_prologue import qkv_prologue

        self._store_kv = store_kv
        self._qkv_prologue = qkv_prologue
        self._paged_attention = paged_attention
        self._choose_configs = choose_configs
        self._launch_configs = launch_configs
        self.deterministic = deterministic
        if decode_queue and deterministic:
            raise ValueError("decode_queue is not for deterministic mode (its kernels are the batch-invariant ones)")
        self.decode_queue = False if deterministic else decode_queue
        if side_decodes < 0:
            raise ValueError(f"side_decodes is queue programs an SM (0: off), got {side_decodes}")
        self.side_decodes = side_decodes
        self._queues: dict[tuple, "torch.Tensor"] = {}  # the queue's counters per (device, stream)
        self._side_streams: dict["torch.device", "torch.cuda.Stream"] = {}

    def forward(
        self,
        q: "torch.Tensor",  # [T, num_heads, head_dim]
        k: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        v: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        kv_cache: "torch.Tensor",  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        _check_block_size(kv_cache, meta)
        self._store_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def forward_qkv(
        self,
        qkv: "torch.Tensor",  # [T, (num_heads + 2 * num_kv_heads) * head_dim], last dim contiguous
        positions: "torch.Tensor",  # [T]
        prologue: QKVPrologue,
        kv_cache: "torch.Tensor",  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        """Norm, rotary and store from the fused qkv output in one kernel, then attend."""
        return self.attend(self.write_qkv(qkv, positions, prologue, kv_cache, meta), kv_cache, meta, scale)

    def write_qkv(
        self,
        qkv: "torch.Tensor",
        positions: "torch.Tensor",
        prologue: QKVPrologue,
        kv_cache: "torch.Tensor",
        meta: AttentionMetadata,
        out: "torch.Tensor | None" = None,  # [T, num_heads, head_dim]: where q goes (a new tensor if None)
    ) -> "torch.Tensor":
        """``forward_qkv``'s first half: the norms, rotary and the cache store in one kernel; returns q.
        It reads only ``meta.slot_mapping``, so a prompt step's CUDA graph piece can hold it
        (worker/piecewise_graphs.py)."""
        _check_block_size(kv_cache, meta)
        return self._qkv_prologue(
            qkv,
            positions,
            prologue.cos_sin_cache,
            kv_cache,
            meta.slot_mapping,
            prologue.num_heads,
            prologue.q_norm_weight,
            prologue.k_norm_weight,
            prologue.norm_eps,
            out=out,
        )

    def store(self, k: "torch.Tensor", v: "torch.Tensor", kv_cache: "torch.Tensor", meta: AttentionMetadata) -> None:
        """``forward``'s first half: the step's keys and values into their cache slots."""
        _check_block_size(kv_cache, meta)
        self._store_kv(k, v, kv_cache, meta.slot_mapping)

    def attend(
        self,
        q: "torch.Tensor",  # [T, num_heads, head_dim]
        kv_cache: "torch.Tensor",
        meta: AttentionMetadata,
        scale: float,
        out: "torch.Tensor | None" = None,  # [T, num_heads, head_dim]: where the result goes (new if None)
    ) -> "torch.Tensor":
        """Attention of the step's queries over their cached contexts (the new keys already stored)."""
        import torch

        out = torch.empty_like(q) if out is None else out
        if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0] and self._queued(q.shape[0], kv_cache):
            return self._attend_queued(q, kv_cache, meta.seq_lens, meta.block_tables, meta, scale, out)
        # The launch shapes are the same for every layer of a step: choose them once per step.
        key = ("triton_attn_configs", q.shape[0], q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype, kv_cache.dtype)
        plan = meta.backend_cache.get(key)
        if plan is None:
            num_decode_seqs = meta.num_leading_decodes if meta.max_query_len > 1 else 0
            decode_config, config = self._choose_configs(
                num_tokens=q.shape[0],
                num_seqs=meta.seq_lens.shape[0],
                num_decode_seqs=num_decode_seqs,
                num_heads=q.shape[1],
                num_kv_heads=kv_cache.shape[3],
                head_dim=q.shape[2],
                dtype=q.dtype,
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len,
                device=q.device,
                deterministic=self.deterministic,
                cache_dtype=kv_cache.dtype,
            )
            # A mixed step's leading decodes go to the item queue when there are enough of them.
            queue_decodes = num_decode_seqs > 0 and self._queued(num_decode_seqs, kv_cache)
            plan = meta.backend_cache[key] = (num_decode_seqs, decode_config, config, queue_decodes)
        num_decode_seqs, decode_config, config, queue_decodes = plan
        beside = queue_decodes and self.side_decodes > 0 and q.is_cuda
        if queue_decodes:
            d = num_decode_seqs
            stream: "contextlib.AbstractContextManager" = contextlib.nullcontext()
            if beside:
                main, side = torch.cuda.current_stream(q.device), self._side_stream(q.device)
                side.wait_stream(main)
                stream = torch.cuda.stream(side)
            with stream:
                self._attend_queued(q[:d], kv_cache, meta.seq_lens[:d], meta.block_tables[:d], meta, scale, out[:d],
                                    programs_per_sm=self.side_decodes if beside else None)
        result = self._paged_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            num_decode_seqs=num_decode_seqs,
            out=out,
            config=config,
            decode_config=decode_config,
            decodes_done=queue_decodes,
        )
        if beside:
            main.wait_stream(side)
        return result

    def _side_stream(self, device: "torch.device") -> "torch.cuda.Stream":
        import torch

        stream = self._side_streams.get(device)
        if stream is None:
            # It outranks the step's stream: the queue's programs are placed before the prefill
            # launch's when both wait on the same keys, and take an SM's free room first.
            stream = self._side_streams[device] = torch.cuda.Stream(device, priority=-1)
        return stream

    def _queued(self, num_decodes: int, kv_cache: "torch.Tensor") -> bool:
        """Whether ``num_decodes`` decode rows of a step go to the item queue."""
        if self.decode_queue is not None:
            return self.decode_queue
        from tokenmill.kernels.triton.paged_attention_queue import queue_pays

        return queue_pays(num_decodes, kv_cache.shape[3], kv_cache.dtype, kv_cache.device)

    def _attend_queued(
        self, q: "torch.Tensor", kv_cache: "torch.Tensor", seq_lens: "torch.Tensor", block_tables: "torch.Tensor",
        meta: AttentionMetadata, scale: float, out: "torch.Tensor", programs_per_sm: int | None = None,
    ) -> "torch.Tensor":
        """Decode rows (row i is sequence i's one token: a pure decode step, or a mixed step's
        leading decodes) through the item queue, into ``out``. The order (longest context first) is
        ranked once per step on the device and reused by every layer, with the step's counters and
        launch shape; padding rows (seq_len 0) rank last and are not written."""
        import torch

        from tokenmill.kernels.triton import paged_attention_queue as queue

        step = meta.backend_cache.get("decode_queue")
        if step is None:
            # One set of counters a stream: two micro-batches in flight on two streams must not share one.
            stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0
            counters = self._queues.get((q.device, stream))
            if counters is None:
                counters = self._queues[(q.device, stream)] = queue.new_queue(q.device)
            shape = queue.launch_shape(q.dtype, kv_cache.dtype, q.shape[2])
            step = meta.backend_cache["decode_queue"] = (queue.decode_order(seq_lens), counters, shape)
        order, counters, (tile_n, num_warps, num_stages, per_sm) = step
        return queue.queued_decode_attention(
            q, kv_cache, seq_lens, block_tables, scale, order, counters, out=out,
            tile_n=tile_n, num_warps=num_warps, num_stages=num_stages, programs_per_sm=programs_per_sm or per_sm,
        )

    def precompile(self, num_heads: int, kv_cache: "torch.Tensor", dtype: "torch.dtype", max_seq_len: int) -> None:
        """Compile every attention variant a step can choose (``precompile.py`` runs this in
        ``parallel_compile``). ``kv_cache`` may be a one-block scratch tensor of the real layout:
        the variants depend on its dtype and strides, not on its number of blocks."""
        import torch

        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        dev = kv_cache.device
        q = torch.empty(1, num_heads, head_dim, dtype=dtype, device=dev)
        query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        seq_lens = torch.ones(1, dtype=torch.int32, device=dev)
        block_tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        configs = self._launch_configs(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, max_seq_len=max_seq_len,
            deterministic=self.deterministic, cache_dtype=kv_cache.dtype,
        )
        for config in configs:
            self._paged_attention(
                q, kv_cache, query_start_loc, seq_lens, block_tables, 1.0,
                max_query_len=1, max_seq_len=1, config=config, compile_only=True,
            )
        if self.decode_queue is not False:
            # The queue's variant (and its ranking), for the large decode steps that take it.
            from tokenmill.kernels.triton import paged_attention_queue as queue

            tile_n, num_warps, num_stages, per_sm = queue.launch_shape(dtype, kv_cache.dtype, head_dim)
            queue.queued_decode_attention(
                q, kv_cache, seq_lens, block_tables, 1.0, queue.decode_order(seq_lens, compile_only=True),
                queue.new_queue(dev), out=q, tile_n=tile_n, num_warps=num_warps, num_stages=num_stages,
                programs_per_sm=per_sm, compile_only=True,
            )


def _check_block_size(kv_cache: "torch.Tensor", meta: AttentionMetadata) -> None:
    if kv_cache.shape[2] != meta.block_size:
        raise ValueError(f"kv_cache block_size {kv_cache.shape[2]} differs from meta.block_size {meta.block_size}")
