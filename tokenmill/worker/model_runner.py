"""Runs one scheduled step on the device: builds the flat batch and its attention metadata,
runs the model, and samples the next token of every sequence that reached its last token.

The runner owns the device state (model, KV cache tensors, attention backend, sampler); the
scheduler and cache manager only hand it ids and counts, in a `SchedulerOutput` (engine/step.py,
the one engine module the runner knows).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import random
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext
from tokenmill.engine.step import (
    NULL_BLOCK, SamplerOutput, ScheduledSequence, SchedulerOutput, StepResult, StepSequence,
)
from tokenmill.sampling_params import SamplerNeeds
from tokenmill.worker.cuda_graphs import DecodeGraphs
from tokenmill.worker.grammar_masks import GrammarMaskStaging
from tokenmill.kernels.sampling_args import RowState
from tokenmill.worker.micro_batches import Overlap, forward_micro_batches
from tokenmill.worker.piecewise_graphs import PiecewiseGraphs, capture_prompt_graphs
from tokenmill.worker.prompt_logprobs import MIN_PROMPT_LOGPROB_ROWS, PROMPT_LOGPROB_ROWS, ScoredPrompts, score_prompts
from tokenmill.worker.sampler import Sampler, SamplingBatch
from tokenmill.worker.sampling_profile import SamplingReserve, largest_state, profile_sampling
from tokenmill.worker.sampling_state import BadWordState, LogitBiasState, LogprobIdsState, PenaltyState, step_rows
from tokenmill.worker.sizing import lazy_zeros

if TYPE_CHECKING:
    from tokenmill.logits_processor import BatchLogitsProcessors

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
        overlap: Overlap = Overlap(),
        lora: bool = False,
        logprobs_mode: str = "raw_logprobs",
    ):
        self.model = model
        self.lora = lora  # the model has LoRA updates: each step tells them each token's adapter slot
        self.logprobs_mode = logprobs_mode  # LLM(logprobs_mode=...): what sample logprobs report
        self.backend = backend
        self.device = device
        self.dtype = dtype
        # Keys and values are cast to this dtype when stored and back to the model's when read.
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        # Prompt tokens scored a slice at a time (prompt_logprobs.py); on a GPU the memory plan makes it
        # the rows its sampler pass held (profile_run), so a slice never needs more than was set aside.
        self.prompt_logprob_rows = PROMPT_LOGPROB_ROWS
        # Draw keys for rows without a seed of their own: a fresh one per step, from the engine seed.
        self._step_keys = random.Random(seed)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PiecewiseGraphs | None = None  # steps with prompt tokens, up to a token count
        self.forward_activation_bytes = 0  # the profiling forward's own peak (profile_run), on a GPU
        self.hidden_bytes_per_token = 0  # a token's final hidden states (profile_run), on a GPU
        self.grammars = None  # the engine's GrammarCache once a structured request arrives
        self._grammar_masks = GrammarMaskStaging(device)  # the masks' pinned buffer, reused step after step
        self.logits_processors: BatchLogitsProcessors | None = None  # LLM(logits_processors=...), on rank 0
        self._pin = device.type == "cuda"
        # The previous step's sampled ids, left on the device: a sequence whose newest token is
        # still in flight reads its next input from here (row given by seq_id).
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[int, int] = {}
        self._new_sampling_state()
        # Two micro-batches on two streams (an experiment, off by default: micro_batches.py).
        self.overlap = overlap
        self._side_stream = torch.cuda.Stream(device) if overlap.mixed and device.type == "cuda" else None

    def _new_sampling_state(self) -> None:
        """Per-sequence sampling state on the device (penalties, logit bias, bad words, logprob ids), released
        for the sequences each plan reports finished or preempted. A plan with nothing scheduled
        is never launched; the engine hands its report to the next plan, and a full table also
        takes back the slots of finished sequences itself before it grows (for callers that do not
        release). Each table starts with one row."""
        def is_done(seq) -> bool:
            return getattr(seq, "is_finished", False)

        self.penalties = PenaltyState(self.vocab_size, self.device, is_done)
        self.logit_bias = LogitBiasState(self.vocab_size, self.device, is_done)
        self.bad_words = BadWordState(self.device, is_done)
        self.logprob_ids = LogprobIdsState(self.device, is_done)

    # ---- KV cache -------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model
        element = self.kv_cache_dtype.itemsize
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [lazy_zeros(shape, self.kv_cache_dtype, self.device) for _ in range(m.num_layers)]

    def free_kv_cache(self) -> None:
        """Drop the KV cache and what reads it (the graphs, the last step's sampled ids): sleep."""
        self.graphs = self.prompt_graphs = None
        self.kv_caches = []
        self._last_sampled, self._last_rows = None, {}
        # No sequence is left (sleep aborts them): the state tables, grown to [slots, vocab] by
        # the busiest batch (hundreds of MB with a large vocabulary), start over at one row.
        self._new_sampling_state()

    def precompile_kernels(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Compile every Triton kernel variant the steps can launch, on several threads, before the
        first step (GPU only): attention's variants, the draw kernel, and those of any layer with a
        ``precompile(max_tokens)`` hook (the MoE layers, whose variants follow the token count). The
        layers' other kernels have one variant per model and compile in the profiling forward."""
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
                for layer in m.modules():
                    if layer is not m and callable(getattr(layer, "precompile", None)):
                        layer.precompile(max_num_batched_tokens)
        except Exception as exc:  # noqa: BLE001  (an optimisation: the kernels still compile on first use)
            logger.warning("compiling kernels ahead failed (%r); they will compile when first launched", exc)
            return
        logger.info("compiled the attention and sampling kernels in %.1f s", time.perf_counter() - start)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.kv_caches, max_num_seqs, max_model_len, self.block_size, self.device,
            overlap=self.overlap.decode, lora=self.lora,
        )
        self.graphs.capture()

    def capture_prompt_graphs(self, max_tokens: int) -> None:
        """Graphs for steps with prompt tokens of up to ``max_tokens`` tokens (piecewise_graphs.py)."""
        self.prompt_graphs = capture_prompt_graphs(self.model, self.backend, self.kv_caches, max_tokens, self.block_size,
                                                   self.device, self.dtype, lora=self.lora)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_logprobs: int = 20) -> SamplingReserve:
        """One forward at the largest step the scheduler can make, then a sampler pass over its
        logits, to measure peak memory; the largest sampling-state tables ``num_seqs`` (max_num_seqs)
        running sequences can make are held throughout, as they would be (``sampling_profile.py``).

        Every sequence reads and writes only the null block of a one-block scratch cache, so the
        run needs no real KV cache yet.
        """
        m = self.model
        # Made first, as a step fills them before its forward; fresh tables, freed on return.
        penalties, bias = largest_state(self.vocab_size, self.device, max(1, num_seqs), self._to_device)
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
        # Every token with an adapter, so the LoRA updates' activations count too.
        lora_slots = torch.zeros(num_tokens, dtype=torch.int32, device=dev) if self.lora else None
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        hidden = self.model(ids, positions, ForwardContext(meta, scratch, self.backend, lora_slots))
        if dev.type == "cuda":  # what a graph pool holding this forward's activations needs (sizing.py)
            self.forward_activation_bytes = torch.cuda.max_memory_allocated(dev) - before
            self.hidden_bytes_per_token = hidden.shape[-1] * hidden.element_size()
        logits = self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
        reserve = profile_sampling(self.sampler, logits, penalties, bias, max_logprobs, self.logprobs_mode)
        # A prompt-logprobs slice ([rows, V] float32 log-probabilities, their rank comparison) needs
        # less than the sampler pass over as many rows; at least MIN_PROMPT_LOGPROB_ROWS, so long
        # prompts are not scored a few rows at a time (those rows' excess is within the plan's headroom).
        self.prompt_logprob_rows = max(MIN_PROMPT_LOGPROB_ROWS, reserve.sampler_rows)
        return reserve

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Launch one step. On a GPU this returns once the work is queued: the sampled ids come
        back through `StepResult.wait`, so the host can schedule the next step meanwhile."""
        scheduled = plan.scheduled
        self.release_sequences(plan.finished_seq_ids)
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        input_ids, positions, meta, sample_rows = self._prepare(scheduled)
        lora_slots = self._lora_slots(plan, meta.query_lens_host)
        sampled = [scheduled[i] for i in sample_rows]
        # Built before the forward is launched, so its host work and copies overlap with the GPU.
        batch = self._sampling_batch([s.seq for s in sampled]) if sampled else None
        if self.graphs is not None and meta.is_pure_decode and meta.num_seqs <= self.graphs.max_batch:
            hidden = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables, lora_slots)
        elif self.overlap.mixed and not meta.is_pure_decode and 0 < meta.num_leading_decodes < meta.num_seqs:
            # The decodes (memory-bound attention) beside the prompt chunks (compute-bound GEMMs).
            hidden = forward_micro_batches(
                self.model, input_ids, positions, meta, self.kv_caches, self.backend, meta.num_leading_decodes,
                self._side_stream,
            )
        elif self.prompt_graphs is not None and input_ids.shape[0] <= self.prompt_graphs.max_tokens:
            hidden = self.prompt_graphs.run(input_ids, positions, meta, lora_slots)
        else:
            ctx = ForwardContext(attn=meta, kv_caches=self.kv_caches, backend=self.backend, lora_slots=lora_slots)
            hidden = self.model(input_ids, positions, ctx)
        prompt_logprobs = score_prompts(self.model, scheduled, meta.query_lens_host, hidden, self.prompt_logprob_rows,
                                        self._to_device)
        if batch is None:
            self._last_sampled, self._last_rows = None, {}
            result = StepResult([], None, prompt_logprobs)
            self._to_host(result)
            return result
        if len(sample_rows) == len(scheduled) and meta.is_pure_decode:
            last_hidden = hidden  # one token per sequence, every one samples
        else:
            last_hidden = hidden[meta.query_start_loc[1:][self._tensor(sample_rows, torch.int64)] - 1]
        logits = self.model.compute_logits(last_hidden)
        result = StepResult(sampled, None, prompt_logprobs)
        if self.grammars is not None and any(s.seq.grammar is not None for s in sampled):
            # A grammar's mask needs the previous step's token in its matcher, which the engine
            # reads back after this launch (asynchronous scheduling): the draw waits for its call,
            # and the host fills the masks while the GPU runs this step's forward. That call comes
            # after execute() has returned, so it enters inference mode itself: the bans (bad words,
            # min_tokens) and Python processors change the logits, an inference tensor, in place.
            result.pending_draw = torch.inference_mode()(functools.partial(self._draw, result, batch, logits, True))
        else:
            self._draw(result, batch, logits, False)
        return result

    def _draw(self, result: StepResult, batch: SamplingBatch, logits: torch.Tensor, grammars: bool) -> None:
        """Sample the step's rows (grammar masks first if ``grammars``: some row has one), keep the
        ids on the device for the next step's inputs and start copying them to the host."""
        result.pending_draw = None
        if grammars:
            self._mask_grammars(batch, [s.seq for s in result.sampled])
        output = self.sampler(logits, batch)
        self._record(batch, output.token_ids)
        self._last_sampled = output.token_ids
        self._last_rows = {item.seq.seq_id: row for row, item in enumerate(result.sampled)}
        result.output = output
        self._to_host(result)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Each (source, destination) block's keys and values copied in every layer, ahead of the
        step that reads them (queued before its forward, after the steps that wrote the sources)."""
        index = self._tensor(list(zip(*copies)), torch.int64)
        for cache in self.kv_caches:
            raw = cache.view(torch.uint8)  # as bytes: indexing kernels exist for every cache dtype (fp8 too)
            raw[:, index[1]] = raw[:, index[0]]

    def _to_host(self, result: StepResult) -> None:
        """Start copying the sampler's output and the prompt logprobs to (pinned) host memory; an
        event marks the end."""
        if not self._pin or (result.output is None and result.prompt_logprobs is None):
            return
        if result.output is not None:
            result.output = SamplerOutput(*(t.to("cpu", non_blocking=True) if t is not None else None
                                            for t in result.output.tensors()))
        if isinstance(result.prompt_logprobs, ScoredPrompts):
            result.prompt_logprobs.replace([t.to("cpu", non_blocking=True) for t in result.prompt_logprobs.tensors()])
        result.ready = torch.cuda.Event()
        result.ready.record()

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
        table = self._block_table(seqs, seq_lens)
        if max_query_len == 1:
            # Decode: one token per sequence, the last one it has (host time per step is precious).
            tokens = []
            for row, (seq, start) in enumerate(zip(seqs, starts)):
                if start < seq.num_known_tokens:
                    tokens.append(seq.token_at(start))
                else:
                    tokens.append(0)
                    in_flight.append((row, self._last_rows[seq.seq_id]))
            positions = np.array(starts, dtype=np.int64)
            rows = np.arange(len(seqs))
        else:
            tokens = []
            for seq, start, end, offset in zip(seqs, starts, seq_lens, start_loc):
                known = seq.num_known_tokens
                tokens.extend(seq.tokens(start, min(end, known)))
                if end > known:  # only the newest token can be in flight
                    tokens.append(0)
                    in_flight.append((offset + known - start, self._last_rows[seq.seq_id]))
            # Each token's position and row, in numpy: a prompt step has thousands of tokens.
            counts = np.array(query_lens, dtype=np.int64)
            rows = np.repeat(np.arange(len(seqs)), counts)
            positions = np.arange(start_loc[-1], dtype=np.int64) + np.repeat(np.array(starts) - start_loc[:-1], counts)
        slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=self._to_device(torch.from_numpy(slots)),
            query_start_loc=self._tensor(start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._to_device(torch.from_numpy(table)),
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
        return input_ids, self._to_device(torch.from_numpy(positions)), meta, sample_rows

    def _lora_slots(self, plan: SchedulerOutput, query_lens: list[int]) -> torch.Tensor | None:
        """Each token's LoRA adapter slot (-1: the base model); None when no sequence of the step has an adapter."""
        if not plan.lora_slots:
            return None
        slot_of = plan.lora_slots
        per_seq = np.array([slot_of.get(item.seq.request.lora_id, -1) for item in plan.scheduled], dtype=np.int32)
        return self._to_device(torch.from_numpy(np.repeat(per_seq, query_lens)))

    def _block_table(self, seqs: list[StepSequence], seq_lens: list[int]) -> np.ndarray:
        """[B, max_blocks] int32 block ids on the host, padded with the null block (numpy: this runs every step)."""
        bs = self.block_size
        counts = -(-np.array(seq_lens, dtype=np.int64) // bs)
        width = int(counts.max())
        flat = np.fromiter(
            itertools.chain.from_iterable(seq.block_ids[:c] for seq, c in zip(seqs, counts.tolist())),
            np.int32,
            int(counts.sum()),
        )
        table = np.full((len(seqs), width), NULL_BLOCK, dtype=np.int32)
        table[np.arange(width)[None, :] < counts[:, None]] = flat
        return table

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Through numpy: 3-4x faster than torch.tensor on a list of Python numbers, several times a step.
        return self._to_device(torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype])))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device; through pinned memory on a GPU, so the copy is asynchronous."""
        if not self._pin:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _columns(self, columns: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
        """Per-row columns of one dtype in one host-to-device copy. Each column starts 16-byte
        aligned: Triton specialises kernels on pointer alignment, and a column starting 8 bytes off
        (an odd row count) would compile a second variant in the middle of a run."""
        rows = len(columns[0])
        per_16_bytes = 16 // dtype.itemsize
        host = torch.zeros((len(columns), -(-rows // per_16_bytes) * per_16_bytes), dtype=dtype)
        host[:, :rows] = torch.from_numpy(np.array(columns, dtype=_NUMPY_DTYPES[dtype]))
        packed = self._to_device(host)
        return [packed[i, :rows] for i in range(len(columns))]

    def _sampling_batch(self, seqs: list[StepSequence]) -> SamplingBatch:
        params = [s.params for s in seqs]
        # What the rows need beyond temperature: each per-row pass below runs only if some row does.
        needs = functools.reduce(operator.or_, (s.request.sampler_needs for s in seqs), 0)
        temperatures = [p.temperature for p in params]
        all_greedy = not any(temperatures)  # SamplingParams.sampling_type: greedy is temperature 0
        # The filters come all three or none; a top_k past the vocabulary keeps everything.
        filtered = bool(needs & SamplerNeeds.FILTERS)
        floats = [temperatures]
        if filtered:
            floats += [[p.top_p for p in params], [p.min_p for p in params]]
        none = [-1] * len(seqs)
        penalty_slots = self.penalties.slots(seqs, self._to_device) if needs & SamplerNeeds.PENALTIES else none
        bias_slots = self.logit_bias.slots(seqs, self._to_device) if needs & SamplerNeeds.LOGIT_BIAS else none
        has_state = bool(needs & (SamplerNeeds.PENALTIES | SamplerNeeds.LOGIT_BIAS))
        floats = self._columns(floats, torch.float32)
        max_top_k = min(max(p.top_k for p in params), self.vocab_size) if filtered else 0
        batch = SamplingBatch(
            temperature=floats[0],
            all_greedy=all_greedy,
            top_k=self._tensor([min(p.top_k, self.vocab_size) for p in params], torch.int64) if filtered else None,
            max_top_k=max_top_k,
            top_p_alone=filtered and any(p.top_p < 1.0 and not 0 < p.top_k < self.vocab_size for p in params),
            any_top_p=filtered and any(p.top_p < 1.0 for p in params),
            any_min_p=filtered and any(p.min_p > 0.0 for p in params),
            top_p=floats[1] if filtered else None,
            min_p=floats[2] if filtered else None,
            # best_of ranks samples by their logprobs, so it needs them even when logprobs is None;
            # a row with logprob_token_ids needs them too, but no top ones (its ids replace them).
            max_num_logprobs=max((0 if p.logprobs is None or p.logprob_token_ids else p.logprobs for p in params
                                  if p.logprobs is not None or p.best_of is not None or p.logprob_token_ids), default=-1),
            logprobs_mode=self.logprobs_mode,
        )
        if not all_greedy:
            batch.draw_keys, batch.draw_counters = self._draw_keys(seqs)
        if has_state:
            bias, penalty = self._columns([bias_slots, penalty_slots], torch.int32)
            penalties = self.penalties
            batch.state = RowState(bias, self.logit_bias.bias, penalty, penalties.counts, penalties.prompt_bits,
                                   penalties.repetition, penalties.frequency, penalties.presence)
            batch.bias_rows = step_rows(bias_slots, self._to_device)
            batch.penalty_rows = step_rows(penalty_slots, self._to_device)
        if needs & SamplerNeeds.BAD_WORDS:
            batch.bad_words = (self.bad_words, step_rows(self.bad_words.slots(seqs, self._to_device), self._to_device))
        if needs & SamplerNeeds.LOGPROB_IDS:
            batch.logprob_ids = (self.logprob_ids, step_rows(self.logprob_ids.slots(seqs, self._to_device), self._to_device))
        if needs & SamplerNeeds.MIN_TOKENS:
            # eos and stop ids may not be sampled below min_tokens (the output count includes tokens in flight).
            banned = [(row, token) for row, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens
                      for token in seq.params.all_stop_token_ids]
            batch.banned = self._tensor(list(zip(*banned)), torch.int64) if banned else None
        if needs & SamplerNeeds.PROCESSORS:
            batch.processors = [(row, s.seq_id, s.params.logits_processors, s.prompt_token_ids, s.output_token_ids)
                                for row, s in enumerate(seqs) if s.params.logits_processors]
        if self.logits_processors is not None:
            self.logits_processors.update(seqs)
            batch.batch_processors = self.logits_processors.apply
        return batch

    def _mask_grammars(self, batch: SamplingBatch, seqs: list[StepSequence]) -> None:
        """Structured outputs' allowed-token masks, made once the forward is launched and the
        previous step's tokens are in the matchers: the host fills them while the GPU runs the
        model, which needs no mask."""
        assert self.grammars is not None, "a row with a grammar means the engine handed its GrammarCache over"
        batch.grammar_bitmask = self._grammar_masks.mask(self.grammars, [s.grammar for s in seqs])
        batch.apply_grammar = self.grammars.apply
        within = [s.request.ranks_within_grammar for s in seqs]
        if any(within):
            batch.rank_within_grammar = self._tensor(within, torch.bool)

    def _draw_keys(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the (key, counter) of its random draw: a seeded sequence's own seed and the output
        position being sampled (its samples then depend on nothing else); otherwise this step's key and
        the row, with bit 32 of the counter set so the two kinds never share a counter."""
        step_key = self._step_keys.getrandbits(63)
        keys = [s.seed if s.seed is not None else step_key for s in seqs]
        counters = [s.num_output_tokens if s.seed is not None else (1 << 32) | row for row, s in enumerate(seqs)]
        keys, counters = self._columns([keys, counters], torch.int64)
        return keys, counters

    def _record(self, batch: SamplingBatch, token_ids: torch.Tensor) -> None:
        """Bring the per-sequence device state up to date with this step's sampled ids (no sync)."""
        if batch.penalty_rows is not None:
            self.penalties.record(batch.penalty_rows, token_ids)
        if batch.bad_words is not None:
            self.bad_words.record(batch.bad_words[1], token_ids)

    def release_sequences(self, seq_ids: Iterable[int]) -> None:
        """Drop the device sampling state of sequences that finished, were aborted or preempted."""
        seq_ids = list(seq_ids)
        for state in (self.penalties, self.logit_bias, self.bad_words, self.logprob_ids):
            state.release(seq_ids)


# The dtypes of the step tensors built from Python lists (``ModelRunner._tensor``, ``_columns``).
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}

