"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Each step, every running sequence asks for the tokens it has not computed yet: one for a
decoding sequence, the rest of its prompt (or a chunk of it) for a prefilling one. Running
sequences are served first, oldest first; waiting sequences are admitted while the budget,
``max_num_seqs`` and the block pool allow. There are no separate prefill and decode phases.

When the pool runs dry, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (its full blocks usually survive in
the prefix cache, so recomputing is cheap).

With asynchronous scheduling a sequence's newest token may still be in flight (sampled on the
device, not yet read back). It is scheduled like any other token; only a sequence whose in-flight
token is certainly its last (max_tokens or max_model_len reached) is left out, since it finishes
as soon as that token is read back.

Sequences ``on_hold`` (beams waiting for the rest of their beam group, see
`tokenmill.engine.beam_search`) are skipped; they are freed first if nothing else can run.

The scheduler also keeps the books of each step: `update_after_launch` counts a launched plan's
tokens as computed, and `update_from_output` appends the sampled tokens once they are read back,
applies the stop conditions (`check_stop`, the one place they are written) and finishes
sequences, or hands a beam group's candidates to its `BeamSearch`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Protocol

from tokenmill.engine.request import Request, Sequence, SequenceStatus
from tokenmill.engine.step import ScheduledSequence, SchedulerOutput, StepResult
from tokenmill.engine.waiting_queue import PriorityWaitingQueue, priority_key
from tokenmill.repetition_detection import FINISH_REASON as REPETITION, STOP_REASON as REPETITION_DETECTED
from tokenmill.repetition_detection import ends_in_repetition


class BlockAllocator(Protocol):
    """What the scheduler asks of the KV cache's bookkeeping (`KVCacheManager`; tests use fakes)."""

    @property
    def block_size(self) -> int: ...

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of a waiting sequence's tokens."""
        ...

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Reserve blocks for ``num_new_tokens`` more tokens (after ``prefix_blocks``); False if they don't fit."""
        ...

    def commit_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to later prompts."""
        ...

    def free(self, seq: Sequence) -> None: ...


def check_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> None:
    """Set ``seq.finish_reason`` (and stop_reason) if ``token``, just appended, ends the sequence:
    a stop token or stop string once min_tokens are out, else the length rule (max_tokens or
    max_model_len, `Request.max_output_tokens`), else (min_tokens out) a repeated pattern when
    the request asked for repetition detection. Feeds the token to the detokenizer.

    The order is vLLM's outcome: its scheduler tests stop ids, then length, then repetition, and
    a stop string its front end finds in the same token overrides any of them. As in vLLM's
    detokenizer, a stop token's text (eos or a stop_token_ids id) stays out of the text unless
    include_stop_str_in_output (its id stays in token_ids), and a stop string counts only from the
    token after the first min_tokens (the sampler already bans stop ids until then)."""
    params = seq.params
    num_out = len(seq.output_token_ids)
    stop_id = num_out >= params.min_tokens and token in params.all_stop_token_ids
    stop_string = None
    if seq.detokenizer is not None and (params.include_stop_str_in_output or not stop_id):
        stop_string = seq.detokenizer.add_token(token, num_out > params.min_tokens)
    if stop_string is not None:
        seq.finish_reason, seq.stop_reason = "stop", stop_string
    elif stop_id:
        seq.finish_reason = "stop"
        # vLLM tests the tokenizer's eos before stop_token_ids: eos ends with no stop_reason even when
        # listed there too, unless ignore_eos leaves only the listing to end it.
        seq.stop_reason = None if token in eos_token_ids and not params.ignore_eos else token
    elif num_out >= seq.request.max_output_tokens:
        seq.finish_reason = "length"
    elif num_out >= params.min_tokens and params.repetition_detection is not None:  # one attribute read for everyone else
        if ends_in_repetition(seq.output_token_ids, params.repetition_detection):
            seq.finish_reason, seq.stop_reason = REPETITION, REPETITION_DETECTED


def _end_on_rejected_token(seq: Sequence, token: int) -> None:
    """A token the sequence's grammar rejects: the grammar's mask left nothing to draw from (every
    token it allows was banned, or the constraint needed a stop id, which it holds back until the
    constraint is complete), so the draw took a token outside it. As vLLM (FINISHED_ERROR),
    the sequence ends with finish_reason "error" rather than go on breaking its constraint; the
    request's error says why."""
    seq.finish_reason, seq.stop_reason = "error", None
    sample = f"sample {seq.index}: " if seq.request.params.num_samples > 1 else ""
    seq.request.error = (
        f"{sample}token {token} at output position {len(seq.output_token_ids) - 1} breaks the structured_outputs "
        "constraint: every token the grammar allowed there was excluded (min_tokens holding back eos, "
        "allowed_token_ids, bad_words or a logits processor), or the constraint needed one of stop_token_ids "
        "there (a stop id may only end it)"
    )


class Scheduler:
    def __init__(
        self, kv: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool = True,
        eos_token_ids: frozenset[int] = frozenset(),
        new_sequence: Callable[[Request, int], Sequence] | None = None,
        max_loras: int | None = None,
        priority: bool = False,
        copy_partial_blocks: bool = False,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids  # the eos ids whose stop has no stop_reason (vLLM: the tokenizer's)
        # Makes the sequences that beam searches fork (the engine's intake: ids, detokenizers).
        self._new_sequence = new_sequence
        # Off: a waiting sequence is admitted only when all of it fits this step's remaining budget.
        # (Pooling models, which compute each prompt in one step, have a queue of their own.)
        self.chunked_prefill = chunked_prefill
        # With LoRA: the most adapters the running sequences may use (every step runs them all).
        self.max_loras = max_loras
        # scheduling_policy="priority": waiting sequences leave by their request's priority (lower
        # first), then arrival, and a step that runs out of blocks preempts the lowest-priority
        # running sequence; otherwise first come, first served, preempting the newest.
        self.priority = priority
        # A sequence admitted on its source's blocks (a beam fork, sample k of a request) takes a copy
        # of the source's partial last block (SchedulerOutput.block_copies) instead of computing its
        # tokens again, when the runner can copy on every rank (one rank: the engine says).
        self.copy_partial_blocks = copy_partial_blocks
        self.waiting: deque[Sequence] | PriorityWaitingQueue = PriorityWaitingQueue() if priority else deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # vLLM's prefix-cache books (prompt tokens looked up, and found) since take_prefix_cache_stats.
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        # Finished, aborted or preempted since the last plan (SchedulerOutput.finished_seq_ids).
        self._finished_seq_ids: set[int] = set()
        # The last plan's finished_seq_ids until it is launched: a step failing before the runner
        # released them reports them again (recover).
        self._unlaunched_finished: set[int] = set()

    def add(self, request: Request) -> None:
        self.waiting.extend(request.sequences)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput[Sequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence[Sequence]] = []
        copies: list[tuple[int, int]] = []  # the admitted sequences' partial blocks to copy (_admit_waiting)
        preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.on_hold or (seq.num_inflight and self._has_no_room(seq)):
                i += 1
                continue
            num = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, num):
                at = self._victim_index()
                victim = self.running.pop(at)
                if at < i:  # already passed this step (priority policy): give back what it was given
                    i -= 1
                    taken = next((k for k, item in enumerate(scheduled) if item.seq is victim), None)
                    if taken is not None:
                        budget += scheduled.pop(taken).num_tokens
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break  # the next running sequence now sits at index i
            else:
                scheduled.append(self._schedule(seq, num))
                budget -= num
                i += 1

        if not preempted:  # admitting new work right after running out of blocks would thrash
            budget = self._admit_waiting(scheduled, budget, copies)
        while not scheduled and self.waiting:
            # Every running sequence is on hold and the next waiting one does not fit: beams holding
            # blocks while they wait for a sibling that cannot be admitted. Free the newest of them
            # (it keeps its place in its group and is recomputed once the group moves on).
            held = next((s for s in reversed(self.running) if s.on_hold), None)
            if held is None:
                break
            self.running.remove(held)
            self._preempt(held)
            preempted += 1
            budget = self._admit_waiting(scheduled, budget, copies)
        finished, self._finished_seq_ids = self._finished_seq_ids, set()
        self._unlaunched_finished = finished
        # A copy stays marked on its sequence until the plan is launched (update_after_launch); a plan
        # the engine drops gives its copies up (undo_copies).
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted, finished, block_copies=copies)

    def undo_copies(self, plan: SchedulerOutput[Sequence]) -> None:
        """A plan the engine drops: its sequences compute the tokens their copies would have brought
        (a copy run later could read a source block freed and handed to another sequence meanwhile)."""
        for item in plan.scheduled:
            seq = item.seq
            if seq.copy_pending is not None:
                seq.num_computed_tokens -= seq.num_computed_tokens % self.kv.block_size  # the copied tokens
                seq.copy_pending = None

    def report_later(self, seq_ids: set[int]) -> None:
        """The finished and preempted ids of a plan that was not launched (nothing scheduled): the next plan reports them."""
        self._finished_seq_ids |= seq_ids

    # ---- a step's books ---------------------------------------------------------------------
    def update_after_launch(self, plan: SchedulerOutput[Sequence]) -> None:
        """The plan is on the device (the runner has read where each sequence starts): its tokens
        count as computed, newly full blocks join the prefix cache, and each sampled token is in
        flight until `update_from_output` reads it."""
        block_size = self.kv.block_size
        self._unlaunched_finished = set()
        if plan.block_copies:  # carried out before this plan's forward
            for item in plan.scheduled:
                item.seq.copy_pending = None
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            # Only a step that completes a block has one to commit (a decode: one step in block_size).
            # Tested here, before commit_computed's own finer test, to skip the call itself: ~0.5 µs
            # a sequence-step at a thousand sequences (the same test inside it saved half of that).
            if seq.num_computed_tokens // block_size > seq.num_committed_blocks:
                self.kv.commit_computed(seq)
            if item.samples:
                seq.num_inflight += 1

    def update_from_output(self, result: StepResult[Sequence]) -> list[int]:
        """Take in a launched step's sampled tokens (waiting for them if need be): append each to
        its sequence and apply the stop conditions, finishing sequences that stop; a beam reports
        its candidates instead, and a beam group whose beams have all reported advances.

        Returns the rows whose token was taken. A sequence that stopped or was aborted while the
        step was in flight drops its token.
        """
        samples = result.read()
        if samples is None:
            return []
        kept = []
        beam_requests: dict[Request, None] = {}
        now = time.monotonic()
        for row, item in enumerate(result.sampled):
            seq = item.seq
            seq.num_inflight -= 1
            if seq.is_finished:
                continue
            kept.append(row)
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            if request.beam is not None:
                assert samples.top_ids is not None and samples.top_logprobs is not None, "beams ask for logprobs"
                request.beam.report(seq, samples.top_ids[row], samples.top_logprobs[row])
                beam_requests[request] = None
                continue
            token = samples.token_ids[row]
            seq.output_token_ids.append(token)
            rejected = seq.grammar is not None and not seq.grammar.is_terminated() and not seq.grammar.accept_token(token)
            check_stop(seq, token, self.eos_token_ids)
            if rejected:
                _end_on_rejected_token(seq, token)
            elif seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated():
                seq.finish_reason = "stop"  # the constraint is complete: nothing more may follow
            if seq.finish_reason is not None:
                self.finish(seq)
        for request in beam_requests:
            assert request.beam is not None
            if request.beam.ready(request.sequences):
                request.sequences = request.beam.advance(request.sequences, self)
        return kept

    def preempt_all(self) -> None:
        """Preempt every running sequence (they free their blocks and are recomputed later, in order)."""
        while self.running:
            self._preempt(self.running.pop())

    def recover(self) -> None:
        """After a step that failed midway (`LLMEngine.step`): whatever the step did to a sequence's
        books (tokens counted as computed or in flight, a block copy planned, a beam's report), each
        is computed again from the tokens the host holds. Every running sequence is preempted, none
        has a token in flight any more, and beam groups forget their reports (their beams report
        again). The device sampling state of every waiting sequence, and that of the last plan's
        finished sequences if it never ran, is released; a sequence's is built again when it next samples."""
        self.preempt_all()
        self._finished_seq_ids |= self._unlaunched_finished
        searches: dict[Request, None] = {}
        for seq in self.waiting:
            seq.num_inflight = 0
            seq.copy_pending = None
            self._finished_seq_ids.add(seq.seq_id)
            if seq.request.beam is not None:
                searches[seq.request] = None
        for request in searches:
            assert request.beam is not None
            request.beam.forget_reports(request.sequences)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Finish every unfinished sequence of the request with ``reason`` ("abort", or "error": the
        engine could not run it)."""
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.finish(seq)

    # ---- beam searches (BeamHost) ------------------------------------------------------------
    def new_sequence(self, request: Request, index: int) -> Sequence:
        if self._new_sequence is None:
            raise RuntimeError("this scheduler was built without new_sequence, so beams cannot fork")
        return self._new_sequence(request, index)

    def add_forks(self, seqs: list[Sequence]) -> None:
        """New beams go to the front of the queue, like preempted sequences: their group waits for them."""
        self.waiting.extendleft(reversed(seqs))

    def _admit_waiting(self, scheduled: list[ScheduledSequence[Sequence]], budget: int, copies: list[tuple[int, int]]) -> int:
        held_back: list[Sequence] = []
        adapters = {s.request.lora_id for s in self.running} - {0} if self.max_loras is not None else set()
        other_adapters = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            # On hold, preempted with a token in flight, or a sample waiting for sample 0's prompt.
            if seq.on_hold or seq.num_inflight or self._waits_for_lead(seq):
                held_back.append(seq)
                continue
            lora_id = seq.request.lora_id
            if lora_id and self.max_loras is not None and lora_id not in adapters and len(adapters) >= self.max_loras:
                # Its adapter would be one more than the running sequences may use: it waits. Only so
                # many of these are stepped over a step, so a long queue of other adapters' requests
                # costs no scan of the whole queue every step.
                held_back.append(seq)
                other_adapters += 1
                if other_adapters >= self.max_num_seqs:
                    break
                continue
            prefix, partial = self._shareable_prefix(seq)
            # Tokens a copy of the source's partial block brings: all but the last, which samples.
            copied = seq.num_tokens - 1 - len(prefix) * self.kv.block_size if partial is not None else 0
            needed = seq.num_tokens - len(prefix) * self.kv.block_size - copied
            num = min(needed, budget)
            if (num < needed and not self.chunked_prefill) or not self.kv.allocate(seq, num + copied, prefix):
                self.waiting.appendleft(seq)
                break
            if copied:
                seq.num_computed_tokens += copied
                seq.copy_pending = (partial, seq.block_ids[len(prefix)])
                copies.append(seq.copy_pending)
            if not seq.num_preemptions and seq.fork_parent is None:  # its first admission (not a beam's fork)
                self._count_lookup(seq, len(prefix) * self.kv.block_size)
            request = seq.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = len(prefix) * self.kv.block_size
                if self.kv.enable_prefix_caching:  # the prompt's full blocks it computes are committed for others
                    full = len(request.prompt_token_ids) // self.kv.block_size * self.kv.block_size
                    request.num_cache_creation_tokens = max(0, full - request.num_cached_tokens)
            seq.status = SequenceStatus.RUNNING
            if lora_id:
                adapters.add(lora_id)
            self.running.append(seq)
            scheduled.append(self._schedule(seq, num))
            budget -= num
        self.waiting.extendleft(reversed(held_back))
        return budget

    def _count_lookup(self, seq: Sequence, num_cached: int) -> None:
        """Count a sample's prompt lookup as vLLM does: each sample is a child request looking its
        prompt up when first scheduled, so sample k finds sample 0's full prompt blocks (shared here,
        `_shareable_prefix`: the same tokens). vLLM looks nothing up with the prefix cache off, with
        prompt logprobs or with skip_reading_prefix_cache."""
        params = seq.params
        if not self.kv.enable_prefix_caching or params.prompt_logprobs is not None or params.skip_reading_prefix_cache:
            return
        seq.num_cached_tokens = num_cached
        self._prefix_cache_queries += seq.num_prompt_tokens
        self._prefix_cache_hits += num_cached

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found) since the last call (vLLM's
        KVCacheManager.make_prefix_cache_stats)."""
        stats = (self._prefix_cache_queries, self._prefix_cache_hits)
        self._prefix_cache_queries = self._prefix_cache_hits = 0
        return stats

    def _has_no_room(self, seq: Sequence) -> bool:
        """No token may follow the ones already sampled (in flight included): it ends at length."""
        return seq.num_output_tokens >= seq.request.max_output_tokens

    def _schedule(self, seq: Sequence, num: int) -> ScheduledSequence[Sequence]:
        return ScheduledSequence(seq, num, samples=seq.num_computed_tokens + num == seq.num_tokens)

    def _waits_for_lead(self, seq: Sequence) -> bool:
        """Samples 1..n-1 wait while sample 0 computes the prompt, then share its blocks."""
        if seq.index == 0 or seq.num_preemptions or seq.request.beam is not None:
            return False
        lead = seq.request.sequences[0]
        return lead.status is SequenceStatus.RUNNING and lead.num_computed_tokens < lead.num_prompt_tokens

    def _shareable_prefix(self, seq: Sequence) -> tuple[list[int], int | None]:
        """The blocks a waiting sequence can start from, and the source block whose partial contents
        it can copy (None: it computes them).

        A forked beam shares its parent's blocks (all its tokens but the last are the parent's);
        samples 1..n-1 share sample 0's prompt blocks. These are the request's own blocks, not
        prefix-cache reads, so skip_reading_prefix_cache leaves them shared. With
        ``copy_partial_blocks`` the source's block holding the rest of the shared tokens is copied
        too, when the source has computed them all: only the last token is computed (a beam fork
        computed up to a block's worth of its parent's tokens again, every fork of every step). The
        copy may hold the source's later tokens past them; the sequence writes its own over those
        before it reads them."""
        source = seq.fork_parent if seq.fork_parent is not None else seq.request.sequences[0]
        if seq is not source and source.status is SequenceStatus.RUNNING and not seq.num_preemptions:
            shared = min(source.num_computed_tokens, seq.num_tokens - 1)
            full = shared // self.kv.block_size
            partial = None
            if (self.copy_partial_blocks and shared == seq.num_tokens - 1 and shared % self.kv.block_size
                    and full < len(source.block_ids)):
                partial = source.block_ids[full]
            if full or partial is not None:
                return source.block_ids[:full], partial
        if seq.request.needs_prompt_logprobs:
            return [], None  # every prompt position must be computed to have logits (vLLM does the same)
        if seq.params.skip_reading_prefix_cache:
            return [], None  # asked for (it still commits its own blocks for later requests)
        return self.kv.find_cached_prefix(seq), None

    def _victim_index(self) -> int:
        """The running sequence to preempt: the newest, or under the priority policy the one of the
        lowest priority (the latest arrival among equals), as vLLM."""
        if not self.priority:
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda k: priority_key(self.running[k]))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_seq_ids.add(seq.seq_id)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Called once the sequence has its finish_reason: frees its blocks and forgets it."""
        seq.status = SequenceStatus.FINISHED
        self._finished_seq_ids.add(seq.seq_id)
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
