"""The per-sequence sampling state on the device (``worker/sampling_state.py``), on the CPU, each
piece against a direct computation from the token lists: output counts and prompt bitmaps after a
fill (also of a sequence that already has outputs, as after a preemption), after in-place records
and after slots are released, reused and grown; the torch penalties against
``reference.penalize_ref``; bias rows; bad-word bans against vLLM's rule applied to the outputs."""

from __future__ import annotations

import random

import pytest
import torch

from support.state_seq import StateSeq as Seq
from tokenmill import SamplingParams
from tokenmill.kernels.reference import penalize_ref, prompt_mask_ref
from tokenmill.kernels.sampling_args import COUNT_MAX, counts_width
from tokenmill.kernels.triton.sampling import RowState
from tokenmill.worker import sampling_state
from tokenmill.worker.sampling_state import (
    BadWordState, LogitBiasState, LogprobIdsState, PenaltyState, SlotTable, StepRows, apply_bias, apply_penalties,
    step_rows,
)

VOCAB = 301  # odd: the counts table's padding column (sampling_args.counts_width) is in play
CPU = torch.device("cpu")


def same(x):
    return x


def expected_counts(seq: Seq) -> torch.Tensor:
    return torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64), minlength=VOCAB).short()


def expected_prompt(seq: Seq) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[seq.prompt_token_ids] = True
    return mask


def random_seq(rng: random.Random, seq_id: int, params: SamplingParams, outputs: int = 0) -> Seq:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))] + [VOCAB - 1, 31, 32]  # word edges
    return Seq(seq_id, params, prompt, [rng.randrange(VOCAB) for _ in range(outputs)])


def test_penalty_state_fills_records_releases_and_grows():
    rng = random.Random(0)
    penalised = SamplingParams(repetition_penalty=1.3)
    state = PenaltyState(VOCAB, CPU)
    seqs = [random_seq(rng, i, penalised if i != 2 else SamplingParams(), outputs=rng.randrange(5)) for i in range(5)]
    slots = state.slots(seqs, same)
    assert slots[2] == -1 and sorted(s for s in slots if s >= 0) == [0, 1, 2, 3]
    assert state.table.capacity == 4 and state.counts.shape == (4, counts_width(VOCAB))
    for _ in range(6):  # steps: sampled ids counted on the "device", the host appends them later
        rows = step_rows(slots, same)
        sampled = torch.tensor([rng.randrange(VOCAB) for _ in seqs])
        state.record(rows, sampled)
        for seq, token in zip(seqs, sampled.tolist()):
            seq.output_token_ids.append(token)
        assert state.slots(seqs, same) == slots
    for seq, slot in zip(seqs, slots):
        if slot >= 0:
            assert torch.equal(state.counts[slot, :VOCAB], expected_counts(seq))
            assert torch.equal(prompt_mask_ref(state.prompt_bits[slot : slot + 1], VOCAB)[0], expected_prompt(seq))
    # Released slots are reused and refilled from what the host knows (as after a preemption);
    # a new sequence beyond the capacity grows the tables and keeps the other slots intact.
    state.release([seqs[0].seq_id, seqs[3].seq_id])
    newcomers = [random_seq(rng, 10 + i, penalised, outputs=7) for i in range(3)]
    again = state.slots([seqs[3], *newcomers, seqs[1]], same)
    assert state.table.capacity == 8 and again[-1] == slots[1]
    for seq, slot in zip([seqs[3], *newcomers, seqs[1]], again):
        assert torch.equal(state.counts[slot, :VOCAB], expected_counts(seq))
        assert torch.equal(prompt_mask_ref(state.prompt_bits[slot : slot + 1], VOCAB)[0], expected_prompt(seq))


def test_a_count_is_held_at_count_max_when_filled_and_when_recorded():
    """int16 counts: a sequence resumed with more repeats of a token than COUNT_MAX fills it at COUNT_MAX,
    and a record on top stays there (no wrap to a negative count); the others count on."""
    state = PenaltyState(VOCAB, CPU)
    seq = Seq(0, SamplingParams(frequency_penalty=0.1), [1, 2], [7] * (COUNT_MAX + 5) + [8, 8])
    slots = state.slots([seq], same)
    assert state.counts[slots[0], 7] == COUNT_MAX and state.counts[slots[0], 8] == 2
    for token in (7, 8):
        state.record(step_rows(slots, same), torch.tensor([token]))
    assert state.counts[slots[0], 7] == COUNT_MAX and state.counts[slots[0], 8] == 3
    assert state.counts.dtype == torch.int16


def test_slot_table_takes_back_done_sequences_before_growing():
    table = SlotTable(is_done=lambda seq: seq.is_finished)
    seqs = [Seq(i, SamplingParams(), [1]) for i in range(3)]
    assert [table.assign(s) for s in seqs[:2]] == [0, 1]
    seqs[0].is_finished = True
    assert table.assign(seqs[2]) == 0 and table.capacity == 2 and table.get(0) is None


def test_torch_penalties_match_the_reference():
    rng = random.Random(1)
    seqs = [random_seq(rng, i, SamplingParams(repetition_penalty=0.7 + 0.3 * i, frequency_penalty=0.2 * i - 0.3,
                                              presence_penalty=0.5 - 0.25 * i), outputs=20) for i in range(4)]
    seqs.insert(2, random_seq(rng, 9, SamplingParams(), outputs=3))  # a row without penalties
    state = PenaltyState(VOCAB, CPU)
    slots = state.slots(seqs, same)
    factors = torch.tensor([[s.params.repetition_penalty for s in seqs], [s.params.frequency_penalty for s in seqs],
                            [s.params.presence_penalty for s in seqs]])
    none = torch.full((len(seqs),), -1, dtype=torch.int32)
    # The factors the state filled per slot are the requests' own.
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert [float(t[slot]) for t in (state.repetition, state.frequency, state.presence)] == factors[:, row].tolist()
    row_state = RowState(none, torch.zeros(1, VOCAB), torch.tensor(slots, dtype=torch.int32), state.counts,
                         state.prompt_bits, state.repetition, state.frequency, state.presence)
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    got = apply_penalties(logits, row_state, step_rows(slots, same))
    counts = torch.stack([expected_counts(s) for s in seqs])
    prompt = torch.stack([expected_prompt(s) for s in seqs])
    want = penalize_ref(logits, counts, prompt, *factors)
    want[2] = logits[2]
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows_at_a_time", [256, 1])
def test_logit_bias_rows(monkeypatch, rows_at_a_time):
    """Each row's own bias, whether the rows are gathered together or one at a time (apply_bias)."""
    monkeypatch.setattr(sampling_state, "BIAS_ROWS_AT_A_TIME", rows_at_a_time)
    params = [SamplingParams(logit_bias={3: 2.5, 7: -100.0}), SamplingParams(), SamplingParams(allowed_token_ids=[4, 9], logit_bias={9: 1.0})]
    seqs = [Seq(i, p, [1]) for i, p in enumerate(params)]
    state = LogitBiasState(VOCAB, CPU)
    slots = state.slots(seqs, same)
    assert slots[1] == -1
    logits = torch.zeros(3, VOCAB)
    apply_bias(logits, state.bias, step_rows(slots, same))
    assert logits[0, 3] == 2.5 and logits[0, 7] == -100.0 and (logits[0].abs() > 0).sum() == 2
    assert torch.equal(logits[1], torch.zeros(VOCAB))
    assert logits[2, 4] == 0.0 and logits[2, 9] == 1.0 and torch.isinf(logits[2]).sum() == VOCAB - 2


def test_logprob_ids_gather_each_rows_list_as_lists_come_grow_and_go():
    rng = random.Random(5)
    state = LogprobIdsState(CPU)
    seqs = [Seq(0, SamplingParams(logprob_token_ids=[3, 7]), [1]), Seq(1, SamplingParams(), [1]),
            Seq(2, SamplingParams(logprob_token_ids=[VOCAB - 1]), [1])]
    for step in range(8):
        if step == 3:  # a longer list widens the table; a finished sequence's slot is reused
            state.release([seqs[0].seq_id])
            seqs[0] = Seq(3, SamplingParams(logprob_token_ids=[rng.randrange(VOCAB) for _ in range(9)]), [1])
        if step == 5:  # more sequences than slots: the table grows
            seqs += [Seq(4 + i, SamplingParams(logprob_token_ids=[i, i + 1, i]), [1]) for i in range(3)]
        rows = step_rows(state.slots(seqs, same), same)
        logprobs = torch.log_softmax(torch.randn(len(seqs), VOCAB), dim=-1)
        gathered = state.gather(logprobs, rows)
        for row, seq in enumerate(seqs):
            listed = seq.params.logprob_token_ids
            if listed:
                assert torch.equal(gathered[row, : len(listed)], logprobs[row, listed]), (step, row)
            else:
                assert torch.equal(gathered[row], torch.zeros(gathered.shape[1]))
    assert state.ids.shape[1] == 9 and len(state.table) == 5


def vllm_bans(words: list[list[int]], out: list[int]) -> set[int]:
    """vLLM's rule: a word's last token is banned once the output ends with the rest of the word."""
    return {w[-1] for w in words if len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1]}


def test_bad_word_bans_follow_the_outputs():
    rng = random.Random(3)
    vocab = 6  # few ids, so prefixes match often
    short = [[2], [1, 3]]
    long = [[4, 4, 5], [0, 1, 2, 3], [5]]
    seqs = [Seq(0, SamplingParams(), [1]), Seq(1, SamplingParams(), [1], [1, 4])]
    seqs[0].params.bad_words_token_ids = short
    seqs[1].params.bad_words_token_ids = long
    state = BadWordState(CPU)
    for step in range(40):
        if step == 12:  # a sequence with longer words arrives: the tables widen
            seqs.append(Seq(2, SamplingParams(), [1], [0, 1, 2]))
            seqs[2].params.bad_words_token_ids = long + [[3, 3, 3, 3, 3]]
        rows = step_rows(state.slots(seqs, same), same)
        logits = torch.zeros(len(seqs), vocab)
        state.apply(logits, rows)
        for row, seq in enumerate(seqs):
            banned = set(torch.nonzero(torch.isinf(logits[row])).flatten().tolist())
            assert banned == vllm_bans(seq.params.bad_words_token_ids, seq.output_token_ids), (step, row)
        sampled = torch.tensor([rng.randrange(vocab) for _ in seqs])
        state.record(rows, sampled)
        for seq, token in zip(seqs, sampled.tolist()):
            seq.output_token_ids.append(token)


def test_step_rows_lists_only_rows_with_a_slot():
    rows = step_rows([-1, 4, -1, 0], same)
    assert isinstance(rows, StepRows) and rows.rows.tolist() == [1, 3] and rows.slots.tolist() == [4, 0]
    assert step_rows([-1, -1], same) is None
