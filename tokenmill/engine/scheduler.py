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
"""

from __future__ import annotations

import time
from collections import deque
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, Sequence, SequenceStatus
from tokenmill.engine.step import ScheduledSequence, SchedulerOutput


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        chunked_prefill: bool = True,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Off for models that compute a prompt in one step (pooling models, no KV cache): a waiting
        # sequence is admitted only when all of it fits this step's remaining budget.
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Finished, aborted or preempted since the last plan (SchedulerOutput.finished_seq_ids).
        self._finished_seq_ids: set[int] = set()

    def add(self, request: Request) -> None:
        self.waiting.extend(request.sequences)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput[Sequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence[Sequence]] = []
        preempted = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.on_hold or (seq.num_inflight and self._has_no_room(seq)):
                i += 1
                continue
            num = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, num):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append(self._schedule(seq, num))
                budget -= num
            i += 1

        if not preempted:  # admitting new work right after running out of blocks would thrash
            budget = self._admit_waiting(scheduled, budget)
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
            budget = self._admit_waiting(scheduled, budget)
        finished, self._finished_seq_ids = self._finished_seq_ids, set()
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted, finished)

    def add_forks(self, seqs: list[Sequence]) -> None:
        """New beams go to the front of the queue, like preempted sequences: their group waits for them."""
        self.waiting.extendleft(reversed(seqs))

    def _admit_waiting(self, scheduled: list[ScheduledSequence[Sequence]], budget: int) -> int:
        held_back: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            # On hold, preempted with a token in flight, or a sample waiting for sample 0's prompt.
            if seq.on_hold or seq.num_inflight or self._waits_for_lead(seq):
                held_back.append(seq)
                continue
            prefix = self._shareable_prefix(seq)
            needed = seq.num_tokens - len(prefix) * self.kv.block_size
            num = min(needed, budget)
            if (num < needed and not self.chunked_prefill) or not self.kv.allocate(seq, num, prefix):
                self.waiting.appendleft(seq)
                break
            request = seq.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = len(prefix) * self.kv.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._schedule(seq, num))
            budget -= num
        self.waiting.extendleft(reversed(held_back))
        return budget

    def _has_no_room(self, seq: Sequence) -> bool:
        """No token may follow the ones already sampled: the sequence ends at length."""
        max_tokens = seq.params.max_tokens
        return seq.num_tokens >= self.max_model_len or (max_tokens is not None and seq.num_output_tokens >= max_tokens)

    def _schedule(self, seq: Sequence, num: int) -> ScheduledSequence[Sequence]:
        return ScheduledSequence(seq, num, samples=seq.num_computed_tokens + num == seq.num_tokens)

    def _waits_for_lead(self, seq: Sequence) -> bool:
        """Samples 1..n-1 wait while sample 0 computes the prompt, then share its blocks."""
        if seq.index == 0 or seq.num_preemptions or seq.request.beam is not None:
            return False
        lead = seq.request.sequences[0]
        return lead.status is SequenceStatus.RUNNING and lead.num_computed_tokens < lead.num_prompt_tokens

    def _shareable_prefix(self, seq: Sequence) -> list[int]:
        # A forked beam shares its parent's blocks (all its tokens but the last are the parent's);
        # samples 1..n-1 share sample 0's prompt blocks.
        source = seq.fork_parent if seq.fork_parent is not None else seq.request.sequences[0]
        if seq is not source and source.status is SequenceStatus.RUNNING and not seq.num_preemptions:
            full = min(source.num_computed_tokens, seq.num_tokens - 1) // self.kv.block_size
            if full:
                return source.block_ids[:full]
        if seq.request.needs_prompt_logprobs:
            return []  # every prompt position must be computed to have logits (vLLM does the same)
        return self.kv.find_cached_prefix(seq)

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
