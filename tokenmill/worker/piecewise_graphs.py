"""CUDA graphs for steps with prompt tokens: the forward captured in pieces, attention left out.

A decode step replays one graph (cuda_graphs.py), but a step that also computes prompt tokens ran
its forward eagerly: on an H100 host that is ~0.7-0.9 ms of Python and driver time a layer (~25 ms
for a 28-layer model), more than the GPU needs for a few thousand tokens of a small model. In a job
with more requests than ``max_num_seqs`` such steps are most of the run, since every step admits
new prompts beside the running decodes (bench/refill_bench.py; docs/perf.md entry 71).

What stops one graph per step is attention: its launch shape follows the step's sequences and
their lengths. Everything else a layer runs (norms, GEMMs, the qkv prologue that also writes the
new keys and values into the cache by ``slot_mapping``, SiLU) depends only on the token count. So
for each bucket of token counts the forward is captured as ``num_layers + 1`` graphs cut at the
attention calls: piece i runs from layer i-1's attention output to layer i's queries, written into
one static query buffer; a replay runs piece i, then layer i's attention eagerly with the step's
real metadata into one static output buffer, which piece i+1 reads.

The cut is made while the unchanged model runs: the capture hands it a stand-in attention backend
(``_PieceCutter``) whose ``forward_qkv`` / ``forward`` store the keys and values, put the queries
in the static buffer, end the graph being captured, begin the next and return the static output
buffer. Tensors that cross a cut (the residual stream) stay alive across it as in an eager
forward, so the pieces, sharing one memory pool and replayed in capture order, never overwrite
them; the buffers of different buckets may overlap, as only one bucket runs at a time.

Padding tokens (a bucket is larger than the step) have slot -1, so they store nothing, and no
attention row: the output buffer's rows past the step keep finite values from earlier steps,
which only feed padding rows again. Token buckets are coarse enough (at most 1/8 of a step is
padding) to keep the graphs few, and stop where a step's GEMMs outlast the host's eager step anyway
(``max_graph_tokens``), so large compute-bound steps pay no padding.

With LoRA adapters (``lora``) each bucket is captured twice, as the decode graphs are: with the
adapters' updates, each token's slot read from a static buffer (padding tokens on the base model),
and without them, for steps where no token has an adapter.

Not used with tensor parallelism, cpu_offload_gb, deterministic mode or enforce_eager (worker.py
decides): those steps run eagerly as before.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata, ForwardContext, QKVPrologue

logger = logging.getLogger(__name__)

# The host time of an eager prompt step: ~0.8 ms a layer (Python, launches and cuBLAS set-up for ~10
# kernels) and ~12 ms of the rest of a step (scheduling, inputs, outputs at ~1,000 sequences),
# measured on an H100 machine's host (docs/perf.md 71); and the rate a prompt step's GEMMs run at.
EAGER_LAYER_S = 0.8e-3
STEP_HOST_S = 12e-3
GEMM_FLOPS = 600e12


def token_buckets(max_tokens: int) -> list[int]:
    """16 to 256 in steps of 16, then eight steps an octave (288, 320, ... 512, 576, ...), up to max_tokens."""
    sizes = list(range(16, 257, 16))
    low = 256
    while low < max_tokens:
        sizes += range(low + low // 8, 2 * low + 1, low // 8)
        low *= 2
    return sorted({min(size, max_tokens) for size in sizes})


def lora_variants(lora: bool) -> tuple[bool, ...]:
    """The variants each bucket is captured in: with the adapters' updates and without (LoRA), or plain."""
    return (True, False) if lora else (False,)


def kept_output_bytes(max_tokens: int, hidden_bytes_per_token: int, lora: bool) -> int:
    """What the captured graphs keep in their pool beyond a forward's passing activations: each
    bucket's (and variant's) final hidden states (``_Bucket.hidden``), for the memory plan."""
    return sum(token_buckets(max_tokens)) * hidden_bytes_per_token * len(lora_variants(lora))


def max_graph_tokens(num_layers: int, linear_params: int, max_num_batched_tokens: int) -> int:
    """The largest prompt step worth a graph: where the step's GEMMs (2 FLOPs a weight a token)
    take as long as the host's eager step (with asynchronous scheduling the slower of the two sets
    the pace). Past 16K tokens for Qwen3-0.6B, ~1.6K for Llama-3-8B; at least 256, at most the step
    budget, rounded up to a bucket."""
    crossover = (num_layers * EAGER_LAYER_S + STEP_HOST_S) * GEMM_FLOPS / max(1, 2 * linear_params)
    limit = min(max_num_batched_tokens, max(256, int(crossover)))
    return next(size for size in token_buckets(max_num_batched_tokens) if size >= limit)


def linear_weight_count(model: nn.Module) -> int:
    """The weights a token's GEMMs multiply in the decoder layers: each linear layer's logical
    input x output features, however it stores them (bf16, fp8, 4-bit words), and of a layer's
    stacked experts the top_k a token meets. (Counting one expert put Qwen3-30B-A3B's limit at
    14,336 tokens instead of 5,632, and the graphs' pool, which the KV cache pays for, ~3x larger.)"""
    from tokenmill.models.layers.moe import SparseMoeBlock

    layers = getattr(getattr(model, "model", model), "layers", model)
    linear = sum(m.input_size * m.output_size for m in layers.modules() if hasattr(m, "input_size") and hasattr(m, "output_size"))
    experts = sum(m.gate.top_k * (m.experts.w13[0].numel() + m.experts.w2[0].numel())
                  for m in layers.modules() if isinstance(m, SparseMoeBlock))
    return linear + experts


class _PieceCutter:
    """The attention backend a capture runs the model with: stores the keys and values and writes
    the queries inside the piece being captured, then cuts it there (see the module docstring)."""

    def __init__(self, backend, queries: torch.Tensor, outputs: torch.Tensor, pool, capturing: bool):
        self.backend = backend
        self.queries, self.outputs = queries, outputs
        self.pool = pool
        self.capturing = capturing
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.layers: list[tuple[torch.Tensor, float]] = []  # each cut's (kv cache, scale)
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        if self.capturing:
            self.graph = torch.cuda.CUDAGraph()
            # thread_local, as DecodeGraphs: only this thread's calls are checked during capture.
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        if self.graph is not None:
            self.graph.capture_end()
            self.pool = self.graph.pool() if self.pool is None else self.pool  # every piece in one pool
            self.pieces.append(self.graph)
            self.graph = None

    def abandon(self) -> None:
        """End a capture that failed (the stream must leave capture mode whatever happened)."""
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except RuntimeError:
                pass
            self.graph = None

    def _cut(self, kv_cache: torch.Tensor, scale: float, tokens: int) -> torch.Tensor:
        self.end()
        self.layers.append((kv_cache, scale))
        self.begin()
        return self.outputs[:tokens]

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, prologue: QKVPrologue, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
        tokens = qkv.shape[0]
        self.backend.write_qkv(qkv, positions, prologue, kv_cache, meta, out=self.queries[:tokens])
        return self._cut(kv_cache, scale, tokens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        tokens = q.shape[0]
        self.backend.store(k, v, kv_cache, meta)
        self.queries[:tokens].copy_(q)
        return self._cut(kv_cache, scale, tokens)


class _Bucket:
    """One token bucket's pieces (of one LoRA variant), each cut's layer (kv cache, scale) and the final hidden states."""

    def __init__(self, pieces: list[torch.cuda.CUDAGraph], layers: list[tuple[torch.Tensor, float]], hidden: torch.Tensor):
        self.pieces, self.layers, self.hidden = pieces, layers, hidden


class PiecewiseGraphs:
    def __init__(self, model: nn.Module, backend, kv_caches: list[torch.Tensor], max_tokens: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, lora: bool = False):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        shape = (n, model.num_heads, model.head_dim)
        self.queries = torch.zeros(shape, dtype=dtype, device=device)
        self.outputs = torch.zeros(shape, dtype=dtype, device=device)
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=device) if lora else None
        self.graphs: dict[tuple[int, bool], _Bucket] = {}  # (bucket, with the LoRA updates) -> its pieces

    def _metadata(self, tokens: int) -> AttentionMetadata:
        # What the pieces read is slot_mapping alone; the rest only has to be well formed.
        device = self.input_ids.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            block_size=self.block_size,
            query_lens_host=[tokens],
            seq_lens_host=[tokens],
            max_query_len=tokens,
            max_seq_len=tokens,
        )

    def _forward(self, tokens: int, meta: AttentionMetadata, cutter: _PieceCutter, adapters: bool) -> torch.Tensor:
        lora_slots = self.lora_slots[:tokens] if adapters and self.lora_slots is not None else None
        ctx = ForwardContext(meta, self.kv_caches, cutter, lora_slots)
        return self.model(self.input_ids[:tokens], self.positions[:tokens], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones then fit in the pool it reserved).
        Raises if a piece cannot be captured; the caller then runs these steps eagerly."""
        start = time.perf_counter()
        torch._C._cuda_clearCublasWorkspaces()  # as DecodeGraphs.capture: the captures make their own, in our pool
        pool = None
        stream = torch.cuda.Stream(self.input_ids.device)  # a capture cannot run on the default stream
        variants = lora_variants(self.lora_slots is not None)
        for tokens in reversed(self.buckets):
            meta = self._metadata(tokens)  # made outside the capture: its tensors are copies from the host
            for adapters in variants:
                # Warm-up: compiles the kernels for this shape and lets cuBLAS choose, outside capture.
                self._forward(tokens, meta, _PieceCutter(self.backend, self.queries, self.outputs, None, capturing=False),
                              adapters)
                torch.cuda.synchronize()
                cutter = _PieceCutter(self.backend, self.queries, self.outputs, pool, capturing=True)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    try:
                        cutter.begin()
                        hidden = self._forward(tokens, meta, cutter, adapters)
                        cutter.end()
                    except BaseException:
                        cutter.abandon()
                        raise
                torch.cuda.current_stream().wait_stream(stream)
                pool = cutter.pool
                self.graphs[tokens, adapters] = _Bucket(cutter.pieces, cutter.layers, hidden)
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        logger.info("captured prompt-step CUDA graphs for %d token buckets up to %d tokens in %.1f s",
                    len(self.buckets), self.max_tokens, time.perf_counter() - start)

    def bucket_for(self, tokens: int) -> int | None:
        for size in self.buckets:
            if size >= tokens:
                return size
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The step's forward: each piece replayed, each layer's attention run eagerly with the
        step's metadata in between. ``lora_slots``: each token's adapter slot (None: no token has
        an adapter). Returns hidden [T, H]."""
        tokens = input_ids.shape[0]
        size = self.bucket_for(tokens)
        assert size is not None, f"a step of {tokens} tokens is larger than the captured {self.max_tokens}"
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[tokens:size].fill_(-1)
        adapters = lora_slots is not None
        if adapters:
            assert self.lora_slots is not None, "a step with adapters on graphs captured without LoRA"
            self.lora_slots[:tokens].copy_(lora_slots, non_blocking=True)
            self.lora_slots[tokens:size].fill_(-1)
        bucket = self.graphs[size, adapters]
        queries, outputs = self.queries[:tokens], self.outputs[:tokens]
        for piece, (kv_cache, scale) in zip(bucket.pieces, bucket.layers):
            piece.replay()
            self.backend.attend(queries, kv_cache, meta, scale, out=outputs)
        bucket.pieces[-1].replay()
        return bucket.hidden[:tokens]


def capture_prompt_graphs(model: nn.Module, backend, kv_caches: list[torch.Tensor], max_tokens: int, block_size: int,
                          device: torch.device, dtype: torch.dtype, lora: bool = False) -> PiecewiseGraphs | None:
    """The captured graphs, or None (with a warning) if a piece cannot be captured: those steps
    then run eagerly, as they always could."""
    graphs = PiecewiseGraphs(model, backend, kv_caches, max_tokens, block_size, device, dtype, lora)
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001  (an optimisation: the eager path serves every step)
        logger.warning("steps with prompt tokens run eagerly: capturing their CUDA graphs failed (%r)", exc)
        torch.cuda.synchronize()
        return None
    return graphs
