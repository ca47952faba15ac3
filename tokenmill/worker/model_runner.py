"""Runs one scheduled step on the device: builds the flat batch and its attention metadata,
runs the model, and samples the next token of every sequence that reached its last token.

The runner owns the device state (model, KV cache tensors, attention backend, sampler); the
scheduler and cache manager only hand it ids and counts, in a `SchedulerOutput` (engine/step.py,
the one engine module the runner knows).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import numpy as np

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext
from tokenmill.engine.step import (
    NULL_BLOCK, PromptLogprobs, SamplerOutput, ScheduledSequence, SchedulerOutput, StepResult, StepSequence,
)
from tokenmill.sampling_params import SamplingType
from tokenmill.worker.cuda_graphs import DecodeGraphs
from tokenmill.worker.sampler import Sampler, SamplingBatch

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        vocab_size: int,
        seed: int,
        kv_cache_dtype: torch.dtype,
    ):
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = dtype
        # Keys and values are cast to this dtype when stored and back to the model's when read.
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        # Draw keys for rows without a seed of their own: a fresh one per step, from the engine seed.
        self._step_keys = random.Random(seed)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.grammars = None  # the engine's GrammarCache once a structured request arrives
        self._pin = device.type == "cuda"
        # The previous step's sampled ids, left on the device: a sequence whose newest token is
        # still in flight reads its next input from here (row given by seq_id).
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[int, int] = {}

    # ---- KV cache -------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model
        element = self.kv_cache_dtype.itemsize
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [_lazy_zeros(shape, self.kv_cache_dtype, self.device) for _ in range(m.num_layers)]

    def free_kv_cache(self) -> None:
        """Drop the KV cache and what reads it (decode graphs, the last step's sampled ids): sleep."""
        self.graphs = None
        self.kv_caches = []
        self._last_sampled, self._last_rows = None, {}

    def precompile_kernels(self, max_model_len: int) -> None:
        """Compile every Triton kernel variant the steps can launch, on several threads, before the
        first step (GPU only): attention's variants and the draw kernel. The layers' other kernels
        have one variant per model and compile in the profiling forward."""
        precompile = getattr(self.backend, "precompile", None)
        if self.device.type != "cuda" or precompile is None:
            return
        from tokenmill.kernels.triton.precompile import parallel_compile

        m = self.model
        start = time.perf_counter()
        scratch = torch.empty((2, 1, self.block_size, m.num_kv_heads, m.head_dim), dtype=self.kv_cache_dtype, device=self.device)
        try:
            with parallel_compile():
                precompile(m.num_heads, scratch, self.dtype, max_model_len)
                self.sampler.precompile(self.vocab_size, self.dtype, self.device)
        except Exception as exc:  # noqa: BLE001  (an optimisation: the kernels still compile on first use)
            logger.warning("compiling kernels ahead failed (%r); they will compile when first launched", exc)
            return
        logger.info("compiled the attention and sampling kernels in %.1f s", time.perf_counter() - start)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.kv_caches, max_num_seqs, max_model_len, self.block_size, self.device
        )
        self.graphs.capture()

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """One forward at the largest step the scheduler can make, to measure peak activation memory.

        Every sequence reads and writes only the null block of a one-block scratch cache, so the
        run needs no real KV cache yet.
        """
        m = self.model
        num_seqs = max(1, min(num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        start_loc = [0]
        for n in lens:
            start_loc.append(start_loc[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(num_seqs, -(-max(lens) // self.block_size), dtype=torch.int32, device=dev),
            block_size=self.block_size,
            query_lens_host=lens,
            seq_lens_host=lens,
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        shape = (2, 1, self.block_size, m.num_kv_heads, m.head_dim)
        scratch = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(m.num_layers)]
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        hidden = self.model(ids, positions, ForwardContext(meta, scratch, self.backend))
        logits = self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
        logits.softmax(dim=-1)

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Launch one step. On a GPU this returns once the work is queued: the sampled ids come
        back through `StepResult.wait`, so the host can schedule the next step meanwhile."""
        scheduled = plan.scheduled
        input_ids, positions, meta, sample_rows = self._prepare(scheduled)
        sampled = [scheduled[i] for i in sample_rows]
        # Built before the forward is launched, so its host work and copies overlap with the GPU.
        batch = self._sampling_batch([s.seq for s in sampled]) if sampled else None
        if self.graphs is not None and meta.is_pure_decode and meta.num_seqs <= self.graphs.max_batch:
            hidden = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        else:
            ctx = ForwardContext(attn=meta, kv_caches=self.kv_caches, backend=self.backend)
            hidden = self.model(input_ids, positions, ctx)
        prompt_logprobs = self._prompt_logprobs(scheduled, meta, hidden)
        if batch is None:
            self._last_sampled, self._last_rows = None, {}
            return StepResult([], None, prompt_logprobs)
        if len(sample_rows) == len(scheduled) and meta.is_pure_decode:
            last_hidden = hidden  # one token per sequence, every one samples
        else:
            last_hidden = hidden[meta.query_start_loc[1:][self._tensor(sample_rows, torch.int64)] - 1]
        logits = self.model.compute_logits(last_hidden)
        output = self.sampler(logits, batch)
        self._last_sampled = output.token_ids
        self._last_rows = {item.seq.seq_id: row for row, item in enumerate(sampled)}
        return self._to_host(StepResult(sampled, output, prompt_logprobs))

    def _to_host(self, result: StepResult) -> StepResult:
        """Start copying the sampler's output to (pinned) host memory; an event marks the end."""
        if not self._pin or result.output is None:
            return result
        out = result.output
        result.output = SamplerOutput(*(
            t.to("cpu", non_blocking=True) if t is not None else None
            for t in (out.token_ids, out.sampled_logprobs, out.sampled_ranks, out.top_ids, out.top_logprobs)
        ))
        result.ready = torch.cuda.Event()
        result.ready.record()
        return result

    def _prompt_logprobs(self, scheduled: list[ScheduledSequence], meta: AttentionMetadata, hidden: torch.Tensor):
        """Score the prompt tokens that this step's prefill chunks predict (position p predicts p + 1)."""
        found = []
        offset = 0
        for item, query_len in zip(scheduled, meta.query_lens_host):
            seq, start = item.seq, item.seq.num_computed_tokens
            request = seq.request
            end = min(start + query_len, seq.num_prompt_tokens - 1)  # the last prompt token predicts output
            if seq.index == 0 and request.needs_prompt_logprobs and start < end:
                logprobs = torch.log_softmax(self.model.compute_logits(hidden[offset : offset + end - start]).float(), dim=-1)
                targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
                ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
                k = request.params.prompt_logprobs
                top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
                found.append(PromptLogprobs(
                    seq, start + 1, chosen.tolist(), ranks.tolist(),
                    top_ids.tolist() if top_ids is not None else None, top_lp.tolist() if top_lp is not None else None,
                ))
            offset += query_len
        return found or None

    def _prepare(self, scheduled: list[ScheduledSequence]):
        bs = self.block_size
        seqs = [item.seq for item in scheduled]
        query_lens = [item.num_tokens for item in scheduled]
        starts = [seq.num_computed_tokens for seq in seqs]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        sample_rows = [row for row, item in enumerate(scheduled) if item.samples]
        max_query_len = max(query_lens)
        start_loc = [0, *itertools.accumulate(query_lens)]
        # (flat index, previous row) of input tokens still in flight: filled in on the device.
        in_flight: list[tuple[int, int]] = []
        if max_query_len == 1:
            # Decode: one token per sequence, the last one it has (host time per step is precious).
            tokens = []
            for row, (seq, start) in enumerate(zip(seqs, starts)):
                if start < seq.num_known_tokens:
                    tokens.append(seq.token_at(start))
                else:
                    tokens.append(0)
                    in_flight.append((row, self._last_rows[seq.seq_id]))
            positions = starts
            slots = [seq.block_ids[p // bs] * bs + p % bs for seq, p in zip(seqs, starts)]
        else:
            tokens, positions, slots = [], [], []
            for seq, start, end, offset in zip(seqs, starts, seq_lens, start_loc):
                known = seq.num_known_tokens
                tokens.extend(seq.tokens(start, min(end, known)))
                if end > known:  # only the newest token can be in flight
                    tokens.append(0)
                    in_flight.append((offset + known - start, self._last_rows[seq.seq_id]))
                positions.extend(range(start, end))
                blocks = seq.block_ids
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._block_table(seqs, seq_lens),
            block_size=bs,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        input_ids = self._tensor(tokens, torch.int64)
        if in_flight:
            dst, src = zip(*in_flight)
            input_ids[self._tensor(dst, torch.int64)] = self._last_sampled[self._tensor(src, torch.int64)]
        return input_ids, self._tensor(positions, torch.int64), meta, sample_rows

    def _block_table(self, seqs: list[StepSequence], seq_lens: list[int]) -> torch.Tensor:
        """[B, max_blocks] int32 block ids, padded with the null block (built in numpy: this runs every step)."""
        bs = self.block_size
        counts = np.fromiter((-(-n // bs) for n in seq_lens), np.int64, len(seqs))
        width = int(counts.max())
        flat = np.fromiter(
            itertools.chain.from_iterable(seq.block_ids[:c] for seq, c in zip(seqs, counts.tolist())),
            np.int32,
            int(counts.sum()),
        )
        table = np.full((len(seqs), width), NULL_BLOCK, dtype=np.int32)
        table[np.arange(width)[None, :] < counts[:, None]] = flat
        return self._to_device(torch.from_numpy(table))

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device; through pinned memory on a GPU, so the copy is asynchronous."""
        if not self._pin:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _sampling_batch(self, seqs: list[StepSequence]) -> SamplingBatch:
        params = [s.params for s in seqs]
        temperature = self._tensor([p.temperature for p in params], torch.float32)
        all_greedy = all(p.sampling_type is SamplingType.GREEDY for p in params)
        top_k = top_p = min_p = None
        max_top_k = min(max(p.top_k for p in params), self.vocab_size)
        if max_top_k > 0:
            top_k = self._tensor([p.top_k for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in params):
            top_p = self._tensor([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            min_p = self._tensor([p.min_p for p in params], torch.float32)
        batch = SamplingBatch(
            temperature=temperature,
            all_greedy=all_greedy,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            # best_of ranks samples by their logprobs, so it needs them even when logprobs is None.
            max_num_logprobs=max((p.logprobs if p.logprobs is not None else 0 for p in params
                                  if p.logprobs is not None or p.best_of is not None), default=-1),
        )
        if not all_greedy:
            batch.draw_keys, batch.draw_counters = self._draw_keys(seqs)
        if any(p.uses_penalties for p in params):
            self._add_penalties(batch, seqs)
        banned = []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                banned.append((row, sorted(seq.params.all_stop_token_ids)))
        batch.banned = [b for b in banned if b[1]] or None
        if any(p.adjusts_logits for p in params):
            self._add_logit_controls(batch, seqs)
        if any(s.grammar is not None for s in seqs):
            batch.grammar_bitmask = self.grammars.bitmask([s.grammar for s in seqs])
            batch.apply_grammar = self.grammars.apply
        return batch

    def _draw_keys(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the (key, counter) of its random draw: a seeded sequence's own seed and the output
        position being sampled (its samples then depend on nothing else); otherwise this step's key and
        the row, with bit 32 of the counter set so the two kinds never share a counter."""
        step_key = self._step_keys.getrandbits(63)
        keys = [s.seed if s.seed is not None else step_key for s in seqs]
        counters = [s.num_output_tokens if s.seed is not None else (1 << 32) | row for row, s in enumerate(seqs)]
        # Two tensors, not two rows of one: a row starting 8 bytes off a 16-byte boundary (odd N)
        # would make Triton compile a second variant of the draw kernel in the middle of a run.
        return self._tensor(keys, torch.int64), self._tensor(counters, torch.int64)

    def _add_logit_controls(self, batch: SamplingBatch, seqs: list) -> None:
        """An additive [N, V] bias (allow list, logit_bias, bad words) and the per-row processors."""
        bias = torch.zeros(len(seqs), self.vocab_size, dtype=torch.float32)
        processors = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.allowed_token_ids:
                bias[row] = float("-inf")
                bias[row, p.allowed_token_ids] = 0.0
            if p.logit_bias:
                bias[row, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()))
            out = seq.output_token_ids
            for word in p.bad_words_token_ids:
                # The last token of a bad word is banned once the output ends with the rest of it.
                if len(word) == 1 or (len(out) >= len(word) - 1 and out[len(out) - len(word) + 1:] == word[:-1]):
                    bias[row, word[-1]] = float("-inf")
            if p.logits_processors:
                processors.append((row, p.logits_processors, seq.prompt_token_ids, out))
        batch.logit_bias = self._to_device(bias)
        batch.processors = processors or None

    def _add_penalties(self, batch: SamplingBatch, seqs: list) -> None:
        dev, vocab = self.device, self.vocab_size
        counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=dev)
        seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=dev)
        for row, seq in enumerate(seqs):
            if seq.output_token_ids:
                out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=dev)
                counts[row].index_add_(0, out, torch.ones(len(out), device=dev))
            seen[row, torch.tensor(seq.prompt_token_ids, dtype=torch.int64, device=dev)] = True
        batch.output_counts = counts
        batch.seen_mask = seen | (counts > 0)
        batch.presence = torch.tensor([s.params.presence_penalty for s in seqs], device=dev)
        batch.frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev)
        batch.repetition = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor, so a slot read before it is written (the masked tail of a
    block) holds a finite number: a NaN would survive an attention mask.

    On the CPU, numpy's zeros come from calloc: the OS maps zero pages lazily, so a 4 GiB pool is
    instant, where torch.zeros would write every byte (seconds here). A GPU zero-fills 100 GiB in
    tens of milliseconds, so torch.zeros is fine there.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize])
    return torch.from_numpy(raw).view(dtype)
