"""``scheduling_policy="priority"`` (vLLM's rules): waiting requests leave by priority (lower first),
then arrival; running out of KV blocks preempts the lowest-priority running sequence, even one the
step had already scheduled (its tokens are taken back out of the plan). The scheduler alone with
test_scheduler's made-up runner, then the engine end to end against first come, first served."""

from __future__ import annotations

import pytest

from test_generate import as_inputs, random_prompts
from test_scheduler import add, make_scheduler, planned, prompt, step
from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import SequenceStatus


@pytest.mark.parametrize("priority", [True, False])
def test_waiting_requests_leave_by_priority_then_arrival(priority):
    """One sequence at a time: under the priority policy the order is b, d (priority 0, by arrival),
    c, a; first come, first served keeps a, b, c, d whatever the priorities say."""
    scheduler = make_scheduler(max_num_seqs=1, priority=priority)
    a, b, c, d = (add(scheduler, prompt(4, 10 * i), max_tokens=1, priority=p) for i, p in enumerate([2, 0, 1, 0]))
    expected = [b, d, c, a] if priority else [a, b, c, d]
    assert [seq.request for seq in scheduler.waiting] == expected
    order = []
    while scheduler.has_unfinished():
        plan = step(scheduler)
        order += [item.seq.request for item in plan.scheduled]
    assert order == expected


def test_out_of_blocks_preempts_the_lowest_priority_sequence_not_the_newest():
    """6 usable blocks of 4 tokens: `low` (priority 5) runs first, `high` (0) joins it; when both need
    their fourth block, `low` (first in the running list, and the oldest) goes, which first come,
    first served would never pick; `high` takes the freed blocks in the same step."""
    scheduler = make_scheduler(num_blocks=7, budget=64, prefix_caching=False, priority=True)
    low = add(scheduler, prompt(8), max_tokens=20, priority=5)
    step(scheduler)
    high = add(scheduler, prompt(8, 50), max_tokens=20, priority=0)
    step(scheduler)
    while scheduler.num_preemptions == 0:
        plan = step(scheduler)
    victim = low.sequences[0]
    assert victim.status is SequenceStatus.WAITING and not victim.block_ids and list(scheduler.waiting) == [victim]
    assert scheduler.running == high.sequences and planned(plan) == [(high.sequences[0].seq_id, 1, True)]


def test_a_victim_already_scheduled_this_step_gives_its_tokens_back():
    """`low` (priority 9) sits first in the running list and still has room in its block, so the step
    schedules its token; `high` then needs a block and none is free: `low` is preempted after all, and
    the plan holds only `high`'s token, the budget counting it alone."""
    scheduler = make_scheduler(num_blocks=5, budget=64, prefix_caching=False, priority=True)
    low = add(scheduler, prompt(5), max_tokens=20, priority=9)  # 5 tokens: 2 blocks, room for 3 more
    step(scheduler)
    high = add(scheduler, prompt(8, 50), max_tokens=20, priority=0)  # 8 tokens: 2 full blocks
    plan = step(scheduler)  # high's prompt; low's 7th token; the 4 usable blocks are all held now
    assert scheduler.kv.num_free_blocks == 0 and scheduler.num_preemptions == 0
    plan = step(scheduler)  # low's token fits its block; high's 10th needs a fifth block
    assert plan.num_preempted == 1 and low.sequences[0].status is SequenceStatus.WAITING
    assert planned(plan) == [(high.sequences[0].seq_id, 1, True)] and plan.num_batched_tokens == 1


def test_the_engine_runs_requests_by_priority_with_unchanged_outputs(tiny_llama_dir):
    """One sequence at a time: requests are first scheduled in priority order, and each request's greedy
    tokens are those first come, first served gives it."""
    options = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=16 * 2**20, max_num_seqs=1)
    prompts = as_inputs(random_prompts(289, [5, 9, 3, 12], seed=4))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    priorities = [3, 1, 2, 0]
    by_priority = LLM(str(tiny_llama_dir), scheduling_policy="priority", **options).generate(
        prompts, params, priority=priorities, use_tqdm=False)
    fcfs = LLM(str(tiny_llama_dir), **options).generate(prompts, params, priority=priorities, use_tqdm=False)
    started = sorted(range(len(prompts)), key=lambda i: by_priority[i].metrics.first_scheduled_time)
    assert started == sorted(range(len(prompts)), key=lambda i: priorities[i])
    fcfs_started = sorted(range(len(prompts)), key=lambda i: fcfs[i].metrics.first_scheduled_time)
    assert fcfs_started == list(range(len(prompts)))
    assert [o.outputs[0].token_ids for o in by_priority] == [o.outputs[0].token_ids for o in fcfs]


def test_an_unknown_scheduling_policy_is_refused():
    from tokenmill.config import EngineArgs

    with pytest.raises(ValueError, match=r"scheduling_policy='lifo'.*'fcfs', 'priority'"):
        EngineArgs.from_kwargs("some-model", scheduling_policy="lifo")
