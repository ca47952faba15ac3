"""The scheduler alone, with made-up runner results (no model): token budget, chunked prefill,
max_num_seqs, preemption order, prefix-cache hits, tokens in flight (asynchronous scheduling),
n > 1 prompt sharing, stop conditions and the finished ids handed to the runner.

Each test does what the engine does around the runner: `schedule`, `update_after_launch` once the
plan is launched, then `update_from_output` with the sampled ids the test makes up.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, Sequence, SequenceStatus, max_output_tokens
from tokenmill.engine.scheduler import Scheduler, check_stop
from tokenmill.engine.step import SamplerOutput, SchedulerOutput, StepResult
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
EOS = 2
MAX_MODEL_LEN = 64
TOKEN = 7  # what the made-up runner samples unless told otherwise


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32, prefix_caching: bool = True,
                   priority: bool = False, copy_partial_blocks: bool = False) -> Scheduler:
    seq_ids = itertools.count()

    def new_sequence(request: Request, index: int) -> Sequence:
        return Sequence(next(seq_ids), index, request, request.prompt_token_ids)

    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    return Scheduler(kv, max_num_seqs, budget, eos_token_ids=frozenset({EOS}), new_sequence=new_sequence,
                     priority=priority, copy_partial_blocks=copy_partial_blocks)


def add(scheduler: Scheduler, prompt: list[int], max_tokens: int | None = 8, n: int = 1, priority: int = 0,
        **params) -> Request:
    """A request as the engine's intake makes it: stop ids with eos, the length limit, n sequences."""
    sp = SamplingParams(n=n, max_tokens=max_tokens, **params)
    sp.all_stop_token_ids = set(sp.stop_token_ids) | {EOS}
    request = Request(f"r{len(scheduler.waiting) + len(scheduler.running)}", None, list(prompt), sp)
    request.priority = priority
    request.max_output_tokens = max_output_tokens(max_tokens, len(prompt), MAX_MODEL_LEN)
    request.sequences = [scheduler.new_sequence(request, i) for i in range(n)]
    scheduler.add(request)
    return request


def launch(scheduler: Scheduler, plan: SchedulerOutput, tokens: dict[int, int] | None = None) -> StepResult:
    """The runner's part: a result sampling ``tokens[seq_id]`` (default TOKEN) for each sampling row."""
    sampled = [item for item in plan.scheduled if item.samples]
    ids = [(tokens or {}).get(item.seq.seq_id, TOKEN) for item in sampled]
    result = StepResult(sampled, SamplerOutput(torch.tensor(ids, dtype=torch.int64)) if sampled else None)
    scheduler.update_after_launch(plan)
    return result


def step(scheduler: Scheduler, tokens: dict[int, int] | None = None) -> SchedulerOutput:
    """One synchronous step: schedule, launch, read back."""
    plan = scheduler.schedule()
    scheduler.update_from_output(launch(scheduler, plan, tokens))
    return plan


def planned(plan: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(item.seq.seq_id, item.num_tokens, item.samples) for item in plan.scheduled]


def prompt(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


def test_token_budget_serves_running_first_then_admits_waiting_in_order():
    scheduler = make_scheduler(budget=16)
    a, b, c = (add(scheduler, prompt(10, 100 * i)) for i in range(1, 4))
    plan = step(scheduler)
    # a's whole prompt, then b's first 6 tokens (a chunk), nothing left for c.
    assert planned(plan) == [(0, 10, True), (1, 6, False)]
    assert plan.num_batched_tokens == 16
    assert [s.request for s in scheduler.running] == [a, b] and list(scheduler.waiting) == c.sequences
    plan = step(scheduler)
    # Running first: a decodes one token, b finishes its prompt (4) and samples, c gets the rest (11 > 10).
    assert planned(plan) == [(0, 1, True), (1, 4, True), (2, 10, True)]
    assert plan.num_batched_tokens == 15


def test_chunked_prefill_samples_only_in_the_last_chunk():
    scheduler = make_scheduler(budget=8)
    request = add(scheduler, prompt(20), max_tokens=3)
    seq = request.sequences[0]
    chunks = [planned(step(scheduler)) for _ in range(3)]
    assert chunks == [[(0, 8, False)], [(0, 8, False)], [(0, 4, True)]]
    assert seq.num_computed_tokens == 20 and seq.output_token_ids == [TOKEN]
    assert planned(step(scheduler)) == [(0, 1, True)]  # decoding: one token a step
    assert len(seq.block_ids) == 6  # 21 computed tokens in blocks of 4


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    scheduler = make_scheduler(budget=16)
    scheduler.chunked_prefill = False
    add(scheduler, prompt(10))
    add(scheduler, prompt(10, 200))
    assert planned(scheduler.schedule()) == [(0, 10, True)]  # the second would need a chunk


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2, budget=64)
    requests = [add(scheduler, prompt(5, 100 * i), max_tokens=1) for i in range(1, 5)]
    plan = step(scheduler)
    assert [seq_id for seq_id, _, _ in planned(plan)] == [0, 1]
    assert all(r.is_finished for r in requests[:2])  # max_tokens=1: done after their first token
    assert sum(s.finish_reason == "length" for r in requests[:2] for s in r.sequences) == 2
    assert [seq_id for seq_id, _, _ in planned(step(scheduler))] == [2, 3]


def test_out_of_blocks_preempts_the_newest_running_sequence():
    # 6 usable blocks of 4 tokens; two sequences of 8-token prompts hold 2 blocks each and grow.
    scheduler = make_scheduler(num_blocks=7, budget=64, prefix_caching=False)
    old, new = add(scheduler, prompt(8), max_tokens=20), add(scheduler, prompt(8, 50), max_tokens=20)
    step(scheduler)
    assert scheduler.kv.num_free_blocks == 2
    step(scheduler)  # each takes a third block for its 9th token
    for _ in range(3):
        step(scheduler)
    assert scheduler.kv.num_free_blocks == 0 and scheduler.num_preemptions == 0  # 12 tokens each: full
    plan = step(scheduler)
    # old asks for a fourth block first, none is free: the newest running sequence (new) goes.
    victim = new.sequences[0]
    assert plan.num_preempted == 1 and planned(plan) == [(0, 1, True)]
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0 and not victim.block_ids
    assert list(scheduler.waiting) == [victim] and scheduler.running == old.sequences
    assert victim.seq_id in plan.finished_seq_ids
    # Its output so far is kept: it is recomputed (prompt and outputs) once blocks free up.
    assert victim.output_token_ids == [TOKEN] * 5


def test_a_preempted_sequence_returns_ahead_of_newer_requests():
    scheduler = make_scheduler(num_blocks=7, budget=64, prefix_caching=False)
    add(scheduler, prompt(8), max_tokens=20)
    second = add(scheduler, prompt(8, 50), max_tokens=20)
    for _ in range(6):
        step(scheduler)  # the sixth step preempts `second`
    late = add(scheduler, prompt(4, 90), max_tokens=1)
    assert list(scheduler.waiting) == [second.sequences[0], late.sequences[0]]


def test_prefix_cache_hit_skips_full_blocks_but_recomputes_the_last_token():
    scheduler = make_scheduler()
    shared = prompt(9)
    first = add(scheduler, shared, max_tokens=1)
    step(scheduler)
    assert first.is_finished  # its blocks are free, and still cached
    second = add(scheduler, shared[:8] + [99, 98, 97])
    plan = scheduler.schedule()
    assert planned(plan) == [(1, 3, True)]  # 8 of 11 tokens were cached (two full blocks)
    assert second.num_cached_tokens == 8 and second.sequences[0].num_computed_tokens == 8
    scheduler.update_from_output(launch(scheduler, plan))
    exact = add(scheduler, shared[:8])  # the same 8 tokens: the last one is computed again for its logits
    plan = scheduler.schedule()
    assert planned(plan)[-1] == (2, 4, True) and exact.num_cached_tokens == 4


def test_prefix_cache_off_computes_every_prompt():
    scheduler = make_scheduler(prefix_caching=False)
    add(scheduler, prompt(9), max_tokens=1)
    step(scheduler)
    add(scheduler, prompt(9))
    assert planned(scheduler.schedule()) == [(1, 9, True)]


def test_tokens_in_flight_are_scheduled_before_they_are_known():
    scheduler = make_scheduler()
    request = add(scheduler, prompt(6), max_tokens=3)
    seq = request.sequences[0]
    first = launch(scheduler, scheduler.schedule())
    assert seq.num_inflight == 1 and seq.num_tokens == 7 and not seq.output_token_ids
    plan = scheduler.schedule()  # step 1 not read back yet: its token is the next input
    assert planned(plan) == [(0, 1, True)]
    second = launch(scheduler, plan)
    assert seq.num_inflight == 2
    assert scheduler.update_from_output(first) == [0]
    assert seq.output_token_ids == [TOKEN] and seq.num_inflight == 1
    third = launch(scheduler, scheduler.schedule())
    # max_tokens=3 with three sampled (one known, two in flight): nothing more is scheduled.
    assert scheduler.schedule().is_empty
    scheduler.update_from_output(second)
    scheduler.update_from_output(third)
    assert seq.output_token_ids == [TOKEN] * 3 and seq.finish_reason == "length" and request.is_finished


def test_a_token_in_flight_after_a_stop_is_dropped():
    scheduler = make_scheduler()
    request = add(scheduler, prompt(6), max_tokens=10)
    seq = request.sequences[0]
    first = launch(scheduler, scheduler.schedule(), {seq.seq_id: EOS})
    second = launch(scheduler, scheduler.schedule())
    assert scheduler.update_from_output(first) == [0]
    assert seq.finish_reason == "stop" and seq.stop_reason is None and request.is_finished
    assert scheduler.update_from_output(second) == []  # computed once more, then dropped
    assert seq.output_token_ids == [EOS] and seq.num_inflight == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_samples_of_one_prompt_share_its_blocks_without_the_prefix_cache():
    scheduler = make_scheduler(prefix_caching=False)
    request = add(scheduler, prompt(10), n=3)
    lead, second, third = request.sequences
    # Samples 1 and 2 wait while sample 0 computes the prompt...
    assert planned(step(scheduler)) == [(0, 10, True)]
    # ...then take its two full blocks and recompute only the partial third block.
    plan = step(scheduler)
    assert planned(plan) == [(0, 1, True), (1, 2, True), (2, 2, True)]
    assert second.block_ids[:2] == third.block_ids[:2] == lead.block_ids[:2]
    assert all(scheduler.kv.pool.ref_counts[b] == 3 for b in lead.block_ids[:2])
    assert len({second.block_ids[2], third.block_ids[2], lead.block_ids[2]}) == 3


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_samples_take_a_copy_of_the_partial_block_and_compute_only_their_last_token(prefix_caching):
    """With copy_partial_blocks, samples 1 and 2 share sample 0's full blocks, copy its partial one
    into a block of their own (in the plan that admits them, carried out once it is launched) and
    compute only the last prompt token; a plan the engine drops gives its copies up, and the
    samples then compute the partial block's tokens themselves."""
    scheduler = make_scheduler(prefix_caching=prefix_caching, copy_partial_blocks=True)
    request = add(scheduler, prompt(10), n=3)
    lead, second, third = request.sequences
    assert planned(step(scheduler)) == [(0, 10, True)]
    plan = step(scheduler)
    assert planned(plan) == [(0, 1, True), (1, 1, True), (2, 1, True)]
    assert plan.block_copies == [(lead.block_ids[2], second.block_ids[2]), (lead.block_ids[2], third.block_ids[2])]
    assert len({second.block_ids[2], third.block_ids[2], lead.block_ids[2]}) == 3
    assert second.copy_pending is None and third.copy_pending is None
    assert second.num_computed_tokens == third.num_computed_tokens == 10
    assert not step(scheduler).block_copies  # once only

    dropped = make_scheduler(prefix_caching=prefix_caching, copy_partial_blocks=True)
    request = add(dropped, prompt(10), n=2)
    lead, second = request.sequences
    step(dropped)
    plan = dropped.schedule()
    assert planned(plan) == [(0, 1, True), (1, 1, True)] and plan.block_copies
    dropped.undo_copies(plan)  # the engine could not launch it (an adapter failed to load)
    assert second.copy_pending is None and second.num_computed_tokens == 8
    again = dropped.schedule()
    assert planned(again) == [(0, 1, True), (1, 2, True)] and not again.block_copies


def test_finished_and_preempted_ids_reach_the_next_plan_once():
    scheduler = make_scheduler()
    short, long = add(scheduler, prompt(4), max_tokens=1), add(scheduler, prompt(4, 40))
    plan = step(scheduler)
    assert plan.finished_seq_ids == set() and short.is_finished
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == {short.sequences[0].seq_id}
    scheduler.update_from_output(launch(scheduler, plan))
    scheduler.abort(long)
    assert long.sequences[0].finish_reason == "abort"
    assert scheduler.schedule().finished_seq_ids == {long.sequences[0].seq_id}
    assert scheduler.schedule().finished_seq_ids == set()


@pytest.mark.parametrize(
    ("token", "params", "num_prompt", "expected"),
    [
        (EOS, {}, 4, ("stop", None)),  # the model's eos: no stop_reason (vLLM)
        (5, {"stop_token_ids": [5]}, 4, ("stop", 5)),
        # vLLM's check_stop tests the tokenizer's eos first: listed in stop_token_ids too, no stop_reason;
        # with ignore_eos only the listing ends it, with the id as stop_reason.
        (EOS, {"stop_token_ids": [EOS, 5]}, 4, ("stop", None)),
        (EOS, {"stop_token_ids": [EOS], "ignore_eos": True}, 4, ("stop", EOS)),
        (EOS, {"min_tokens": 3}, 4, (None, None)),  # too early to stop
        (EOS, {"ignore_eos": True}, 4, (None, None)),
        (9, {"max_tokens": 2}, 4, ("length", None)),
        (9, {"max_tokens": None}, MAX_MODEL_LEN - 2, ("length", None)),  # fills max_model_len
        (9, {"max_tokens": 3}, 4, (None, None)),
    ],
)
def test_check_stop(token, params, num_prompt, expected):
    sp = SamplingParams(**params)
    sp.all_stop_token_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
    request = Request("r", None, prompt(num_prompt), sp)
    request.max_output_tokens = max_output_tokens(sp.max_tokens, num_prompt, MAX_MODEL_LEN)
    seq = Sequence(0, 0, request, request.prompt_token_ids, output_token_ids=[8, token])
    check_stop(seq, token, frozenset({EOS}))
    assert (seq.finish_reason, seq.stop_reason) == expected


@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "preempting"])
def test_a_mixed_step_lists_its_decodes_before_its_prompt_chunks(num_blocks):
    """Long prompts arriving while others decode (P5's shape, scaled down): in every step the
    decoding sequences come first, so the attention backend can give them their own launch
    (AttentionMetadata.num_leading_decodes); also when the pool runs dry and sequences are
    preempted and recomputed."""
    import random

    rng = random.Random(3)
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_seqs=8, budget=24)
    for i in range(14):
        add(scheduler, prompt(rng.randint(5, 20), 100 * i), max_tokens=rng.randint(2, 9))
    mixed = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        decoding = [item.seq.num_computed_tokens >= item.seq.num_prompt_tokens for item in plan.scheduled]
        assert decoding == sorted(decoding, reverse=True), planned(plan)
        mixed += any(decoding) and not all(decoding)
        scheduler.update_from_output(launch(scheduler, plan))
    assert mixed >= 5
    assert (scheduler.num_preemptions > 0) == (num_blocks == 14)


class _CountingDeque(deque):
    pops = 0

    def popleft(self):
        self.pops += 1
        return super().popleft()


def test_at_most_max_loras_adapters_run_and_a_long_queue_of_others_is_not_rescanned():
    """max_loras=1: sequences of a second adapter wait while the first one's run (a step never mixes
    them), every request finishes, and a step steps over at most max_num_seqs of the waiting ones
    (not all 60 of them, every step)."""
    from types import SimpleNamespace

    scheduler = make_scheduler(num_blocks=256, max_num_seqs=2, budget=64)
    scheduler.max_loras = 1
    scheduler.waiting = _CountingDeque()
    first = add(scheduler, prompt(4), max_tokens=3)
    others = [add(scheduler, prompt(4, 20 + i), max_tokens=3) for i in range(60)]
    last = add(scheduler, prompt(4, 90), max_tokens=3)
    for request, uid in [(first, 1), *((r, 2) for r in others), (last, 1)]:
        request.adapter = SimpleNamespace(uid=uid, cache_key=f"adapter {uid}")
    plan = step(scheduler)
    assert {item.seq.request.lora_id for item in plan.scheduled} == {1}
    assert scheduler.waiting.pops <= 1 + scheduler.max_num_seqs  # first, then two of the other adapter's
    while scheduler.has_unfinished():
        before = scheduler.waiting.pops
        plan = step(scheduler)
        assert len({item.seq.request.lora_id for item in plan.scheduled}) <= 1
        assert scheduler.waiting.pops - before <= 2 * scheduler.max_num_seqs + 1
    assert all(r.is_finished for r in [first, last, *others])
