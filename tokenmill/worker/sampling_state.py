"""Per-sequence sampling state kept on the device, so that penalties, logit controls and
logprob_token_ids need no host sync and no per-step rebuild from Python lists.

A sequence that needs state gets a slot (a row of each tensor below) the first time it samples;
the slot is filled then from its prompt and the output tokens the host knows (all of them: a
sequence is never admitted with a token in flight), and updated in place from the sampled ids on
the device after every step (``record``), whether or not the host has read them back yet. A token
sampled for a sequence that then stops is counted too, but that sequence never samples again and
its slot is released. Slots go only to the sequences that use a feature, in a capacity that
doubles as needed (1, 2, 4, ...: ``slot_capacity``), and are freed by ``release`` (finished,
aborted or preempted sequences; a preempted one is filled again when it samples next). Only running
sequences hold slots when a table grows, so it never passes ``slot_capacity(max_num_seqs)`` rows:
the size the GPU memory plan reserves for it (``sampling_profile.py``).

Bytes per slot, V = vocabulary size (Qwen's V = 151,936 in brackets):
- ``PenaltyState`` (repetition / frequency / presence penalties): output counts, V int16 (held at
  ``COUNT_MAX``; V rounded up to even), the prompt's tokens as a bitmap, ceil(V / 32) int32, and the
  three factors: 2.125 V + 12 bytes (323 KB; 256 slots 83 MB, 1,024 slots 331 MB).
- ``LogitBiasState`` (logit_bias, allowed_token_ids): one additive float32 row, 4 V bytes (608 KB).
- ``BadWordState`` (bad_words): the words as token ids, and the last L - 1 output ids for words
  of up to L tokens: a few hundred bytes.
- ``LogprobIdsState`` (logprob_token_ids): the ids, int64, as wide as the longest list (<= 128):
  at most 1 KB. Fixed for the sequence's life: nothing to record.
min_tokens needs no state: the host knows each sequence's output count, tokens in flight included.
The GPU kernels read the bias and penalty tables directly (``kernels/sampling_args.RowState``);
``apply_bias`` and ``apply_penalties`` are the same steps in torch, for the CPU.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from tokenmill.kernels.sampling_args import COUNT_MAX, RowState, counts_width
from tokenmill.sampling_params import SamplerNeeds

ToDevice = Callable[[torch.Tensor], torch.Tensor]  # a host tensor onto the device (pinned, asynchronous on a GPU)
_WILDCARD = -2  # a word position before the word's first token: matches any recent id
_seq_id = operator.attrgetter("seq_id")


def slot_capacity(num_slots: int) -> int:
    """The rows a SlotTable has once it has held ``num_slots`` slots at once: it starts with one and
    doubles when full, so the smallest power of two >= ``num_slots``. ``SlotTable.assign`` grows by
    this rule, and the memory plan (``sampling_profile.py``) reserves the tables at it."""
    return 1 << max(num_slots - 1, 0).bit_length()


class SlotTable:
    """Slots (rows of device tensors) for sequences, by seq_id; the capacity doubles when full.

    ``is_done(seq)``, if given, lets a full table take back the slots of sequences that are done
    before it grows (for an engine that does not call ``release``)."""

    def __init__(self, is_done: Callable[[object], bool] | None = None) -> None:
        self.capacity = 1  # the tensors start with a row, so a kernel always gets a real one
        self._slots: dict[int, int] = {}
        self._owners: dict[int, object] = {}
        self._free = [0]
        self._is_done = is_done

    def get(self, seq_id: int) -> int | None:
        return self._slots.get(seq_id)

    def assign(self, seq) -> int:
        """A free slot for ``seq``, doubling the capacity first if none is free (the owner grows its tensors)."""
        if not self._free and self._is_done is not None:
            self.release([seq_id for seq_id, owner in self._owners.items() if self._is_done(owner)])
        if not self._free:  # every slot held: one more than now (a power of two, so this doubles)
            grown = slot_capacity(self.capacity + 1)
            self._free = list(range(grown - 1, self.capacity - 1, -1))
            self.capacity = grown
        slot = self._free.pop()
        self._slots[seq.seq_id] = slot
        self._owners[seq.seq_id] = seq
        return slot

    def assign_rows(self, seqs: list, need: SamplerNeeds) -> tuple[list[int], list[tuple[int, object]]]:
        """Each row's slot (-1 where its request's ``sampler_needs`` lack ``need``: the flags the
        runner also reads to skip a state no row uses), and the (slot, seq) pairs assigned now,
        whose tensors the owner fills."""
        known = list(map(self._slots.get, map(_seq_id, seqs)))  # C-level loops: this runs every step
        if None not in known:  # every row needs the state and has its slot: the steady state of a batch
            return known, []
        slots = [-1] * len(seqs)
        new = []
        need = int(need)  # int & int: IntFlag's operators run in Python
        for row, seq in enumerate(seqs):
            if seq.request.sampler_needs & need:
                slot = self._slots.get(seq.seq_id)
                if slot is None:
                    slot = self.assign(seq)
                    new.append((slot, seq))
                slots[row] = slot
        return slots, new

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            slot = self._slots.pop(seq_id, None)
            if slot is not None:
                del self._owners[seq_id]
                self._free.append(slot)

    def __len__(self) -> int:
        return len(self._slots)


@dataclass
class StepRows:
    """One step's rows that use a piece of state, and their slots: [P] int64 on the device."""

    rows: torch.Tensor
    slots: torch.Tensor


def step_rows(slots: list[int], to_device: ToDevice) -> StepRows | None:
    """The rows with a slot (>= 0) and their slots, or None if no row has one."""
    slot_of = np.array(slots, dtype=np.int64)
    rows = np.flatnonzero(slot_of >= 0)
    if not rows.size:
        return None
    index = to_device(torch.from_numpy(np.stack([rows, slot_of[rows]])))
    return StepRows(index[0], index[1])


def _grown(t: torch.Tensor, rows: int, fill: float | int = 0) -> torch.Tensor:
    """``t`` with ``rows`` rows: its own first, the new ones filled."""
    if t.shape[0] == rows:
        return t
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


class _SlottedState:
    """A piece of per-sequence state: a row (slot) for each sequence whose request needs ``NEED``,
    filled by the subclass's ``_fill`` when the sequence first samples, given back on release."""

    NEED: SamplerNeeds
    table: SlotTable

    def slots(self, seqs: list, to_device: ToDevice) -> list[int]:
        """Each row's slot (-1: not needed), filling those of sequences that sample for the first time."""
        slots, new = self.table.assign_rows(seqs, self.NEED)
        if new:
            self._fill(new, to_device)
        return slots

    def release(self, seq_ids: Iterable[int]) -> None:
        self.table.release(seq_ids)

    def _fill(self, new: list, to_device: ToDevice) -> None:
        """Write the rows of the (slot, seq) pairs in ``new``: built on the host, copied at once."""
        raise NotImplementedError


def _slot_index(new: list, to_device: ToDevice) -> torch.Tensor:
    """The slots of the (slot, seq) pairs in ``new``, on the device."""
    return to_device(torch.tensor([slot for slot, _ in new], dtype=torch.int64))


class PenaltyState(_SlottedState):
    """Output-token counts, prompt-token bitmaps and the penalty factors of the sequences with penalties."""

    NEED = SamplerNeeds.PENALTIES

    def __init__(self, vocab_size: int, device: torch.device, is_done: Callable[[object], bool] | None = None):
        self.table = SlotTable(is_done)
        self.counts = torch.zeros((1, counts_width(vocab_size)), dtype=torch.int16, device=device)
        self.prompt_bits = torch.zeros((1, -(-vocab_size // 32)), dtype=torch.int32, device=device)
        # [S] float32 each: every slot's repetition, frequency and presence penalty (RowState's factors).
        self.repetition, self.frequency, self.presence = (torch.ones(1, device=device) for _ in range(3))

    def record(self, rows: StepRows, token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens (on the device; nothing is read back). Each row is its
        own sequence with its own slot, so a step's (slot, token) pairs are distinct and a plain
        read-add-write suffices: on CUDA an accumulating ``index_put_`` sorts its indices in a dozen
        launches every step (docs/perf.md 53)."""
        flat = self.counts.view(-1)
        at = torch.add(token_ids[rows.rows], rows.slots, alpha=self.counts.shape[1])
        flat[at] = flat[at].clamp_(max=COUNT_MAX - 1) + 1

    def _fill(self, new: list, to_device: ToDevice) -> None:
        self.counts = _grown(self.counts, self.table.capacity)
        self.prompt_bits = _grown(self.prompt_bits, self.table.capacity)
        slots = _slot_index(new, to_device)
        params = [seq.params for _, seq in new]
        factors = to_device(torch.tensor([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                          [p.presence_penalty for p in params]], dtype=torch.float32))
        self.repetition, self.frequency, self.presence = (
            _grown(table, self.table.capacity).index_copy_(0, slots, row)
            for table, row in zip((self.repetition, self.frequency, self.presence), factors))
        width = self.counts.shape[1]  # counts_width(V)
        # Output counts (a preempted sequence's outputs): reduced on the host to distinct (slot,
        # token) cells, written with a plain assignment.
        self.counts.index_fill_(0, slots, 0)
        cells = np.fromiter((slot * width + token for slot, seq in new for token in seq.output_token_ids), np.int64)
        if cells.size:
            cells, times = np.unique(cells, return_counts=True)
            index = to_device(torch.from_numpy(np.stack([cells, np.minimum(times, COUNT_MAX)])))
            self.counts.view(-1)[index[0]] = index[1].to(self.counts.dtype)
        # The prompts as bitmaps, built whole on the host (bitwise_or.at folds a prompt's repeated
        # tokens; bit 31 becomes the sign, as the kernels read it) and copied in one piece: ceil(V / 32)
        # int32 a sequence (19 KB at V = 151,936). No sort: 5-7x faster than reducing distinct
        # (row, token) pairs with np.unique, which a long job pays for every sequence it admits.
        lengths = np.array([len(seq.prompt_token_ids) for _, seq in new], dtype=np.int64)
        tokens = np.fromiter(itertools.chain.from_iterable(seq.prompt_token_ids for _, seq in new), np.int64,
                             int(lengths.sum()))
        words = np.zeros((len(new), self.prompt_bits.shape[1]), dtype=np.int64)
        np.bitwise_or.at(words, (np.repeat(np.arange(len(new)), lengths), tokens >> 5), np.left_shift(1, tokens & 31))
        self.prompt_bits.index_copy_(0, slots, to_device(torch.from_numpy(words.astype(np.uint32).view(np.int32))))


def apply_penalties(logits: torch.Tensor, state: RowState, rows: StepRows) -> torch.Tensor:
    """The penalties of ``rows`` in plain torch from the state the GPU kernels read (the CPU's
    sampler): vLLM's formulas, in the order and rounding of ``reference.penalize_ref``."""
    vocab = logits.shape[1]
    logits = logits.float().clone()
    counts = state.counts[rows.slots, :vocab]
    bits = (state.prompt_bits[rows.slots].long()[:, :, None] >> torch.arange(32, device=logits.device)) & 1
    seen = bits.flatten(1)[:, :vocab].bool() | (counts > 0)
    x = logits[rows.rows]
    rep = state.repetition[rows.slots][:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - state.frequency[rows.slots][:, None] * counts.float()
    logits[rows.rows] = x - state.presence[rows.slots][:, None] * (counts > 0).float()
    return logits


class LogitBiasState(_SlottedState):
    """One additive float32 row per sequence with logit_bias or allowed_token_ids (-inf bans a token)."""

    NEED = SamplerNeeds.LOGIT_BIAS

    def __init__(self, vocab_size: int, device: torch.device, is_done: Callable[[object], bool] | None = None):
        self.table = SlotTable(is_done)
        self.bias = torch.zeros((1, vocab_size), dtype=torch.float32, device=device)

    def _fill(self, new: list, to_device: ToDevice) -> None:
        """The new rows built on the host and copied in one go: a copy from pageable memory would
        wait for the device's queue to drain, stalling asynchronous scheduling once per sequence."""
        self.bias = _grown(self.bias, self.table.capacity)
        rows = torch.zeros((len(new), self.bias.shape[1]), dtype=torch.float32)
        for row, (_, seq) in zip(rows, new):
            params = seq.params
            if params.allowed_token_ids:
                row.fill_(float("-inf"))
                row[params.allowed_token_ids] = 0.0
            if params.logit_bias:
                row[list(params.logit_bias)] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        slots = _slot_index(new, to_device)
        self.bias.index_copy_(0, slots, to_device(rows))


def gather_ids(logprobs: torch.Tensor, ids: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """Rows of logprobs at their ``LogprobIdsState.by_row`` ids; zeros for rows without any."""
    return logprobs.gather(1, ids).masked_fill(~has[:, None], 0.0)


# Bias rows apply_bias gathers at a time: a [rows, V] float32 gather (~155 MB at V = 152K), which
# the memory plan sets aside at this many rows rather than at every row of a step.
BIAS_ROWS_AT_A_TIME = 256


def apply_bias(logits: torch.Tensor, bias: torch.Tensor, rows: StepRows) -> None:
    """Add the rows' bias to float32 ``logits`` in place, BIAS_ROWS_AT_A_TIME rows at a time."""
    for start in range(0, rows.rows.shape[0], BIAS_ROWS_AT_A_TIME):
        part = slice(start, start + BIAS_ROWS_AT_A_TIME)
        logits.index_add_(0, rows.rows[part], bias[rows.slots[part]])


class BadWordState(_SlottedState):
    """The bad words of each sequence that has some, and its last few sampled ids.

    A word's last token is banned when the output ends with the rest of the word (vLLM's rule);
    a one-token word is always banned. Words are stored right-aligned against the recent ids:
    ``prefixes[slot, w, j]`` is the id that must be at recent position j (the newest last),
    _WILDCARD before the word starts; ``last[slot, w]`` is the banned token (-1: no word)."""

    NEED = SamplerNeeds.BAD_WORDS

    def __init__(self, device: torch.device, is_done: Callable[[object], bool] | None = None):
        self.device = device
        self.table = SlotTable(is_done)
        self.prefixes = torch.full((1, 1, 1), _WILDCARD, dtype=torch.int64, device=device)
        self.last = torch.full((1, 1), -1, dtype=torch.int64, device=device)
        self.recent = torch.full((1, 1), -1, dtype=torch.int64, device=device)  # -1: no output there yet

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        """Ban the rows' banned tokens in ``logits``, in place (adding -inf or 0, so repeated ids are fine)."""
        prefixes, last = self.prefixes[rows.slots], self.last[rows.slots]
        recent = self.recent[rows.slots][:, None, :]
        match = ((prefixes == recent) | (prefixes == _WILDCARD)).all(dim=-1) & (last >= 0)
        penalty = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
        logits.index_put_((rows.rows[:, None].expand_as(last), last.clamp(min=0)), penalty, accumulate=True)

    def record(self, rows: StepRows, token_ids: torch.Tensor) -> None:
        """Shift this step's sampled ids into the rows' recent ids (on the device)."""
        recent = self.recent[rows.slots]
        self.recent[rows.slots] = torch.cat([recent[:, 1:], token_ids[rows.rows][:, None]], dim=1)

    def _fill(self, new: list, to_device: ToDevice) -> None:
        """The new rows built on the host and copied in one go (pinned: see LogitBiasState._fill)."""
        words_of = [seq.params.bad_words_token_ids for _, seq in new]
        count = max(max(len(words) for words in words_of), self.last.shape[1])
        # Recent ids a word can need: grow every dimension as needed. The older recent ids of the
        # slots already there are unknown (-1), but their own words never reach that far back.
        width = max(max(len(w) for words in words_of for w in words) - 1, self.recent.shape[1])
        rows, (n, c, w) = self.table.capacity, self.prefixes.shape
        prefixes = torch.full((rows, count, width), _WILDCARD, dtype=torch.int64, device=self.device)
        prefixes[:n, :c, width - w:] = self.prefixes
        last = torch.full((rows, count), -1, dtype=torch.int64, device=self.device)
        last[:n, :c] = self.last
        recent = torch.full((rows, width), -1, dtype=torch.int64, device=self.device)
        recent[:n, width - w:] = self.recent
        self.prefixes, self.last, self.recent = prefixes, last, recent
        own_prefixes = torch.full((len(new), count, width), _WILDCARD, dtype=torch.int64)
        own_last = torch.full((len(new), count), -1, dtype=torch.int64)
        history = torch.full((len(new), width), -1, dtype=torch.int64)
        for i, ((_, seq), words) in enumerate(zip(new, words_of)):
            for j, word in enumerate(words):
                if len(word) > 1:
                    own_prefixes[i, j, width - len(word) + 1:] = torch.tensor(word[:-1])
                own_last[i, j] = word[-1]
            out = seq.output_token_ids[-width:]
            if out:
                history[i, width - len(out):] = torch.tensor(out)
        slots = _slot_index(new, to_device)
        for table, rows_now in ((self.prefixes, own_prefixes), (self.last, own_last), (self.recent, history)):
            table.index_copy_(0, slots, to_device(rows_now))


class LogprobIdsState(_SlottedState):
    """The ids whose logprobs each sequence with logprob_token_ids gets at every output position:
    ``ids[slot, :len(list)]``, padded with id 0 to the table's width (the longest list seen).
    Padding columns are gathered too and dropped on the host, which knows each list's length."""

    NEED = SamplerNeeds.LOGPROB_IDS

    def __init__(self, device: torch.device, is_done: Callable[[object], bool] | None = None):
        self.table = SlotTable(is_done)
        self.ids = torch.zeros((1, 1), dtype=torch.int64, device=device)

    def gather(self, logprobs: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """[N, width] float32: each row's logprobs at its ids (rows without ids: zeros, never read)."""
        ids, has = self.by_row(logprobs.shape[0], rows)
        return gather_ids(logprobs, ids, has)

    def by_row(self, num_rows: int, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, width] ids of each of a step's N rows (rows without: token 0) and [N] whether it has
        any, for ``gather_ids`` over the whole table or a few of its rows at a time."""
        ids = torch.zeros((num_rows, self.ids.shape[1]), dtype=torch.int64, device=self.ids.device)
        ids[rows.rows] = self.ids[rows.slots]
        has = torch.zeros(num_rows, dtype=torch.bool, device=self.ids.device)
        # index_fill_ takes the value as a kernel argument; ``has[rows] = True`` would copy a CPU
        # scalar to the device, a host sync every step (test_logprob_ids_state_needs_no_host_sync).
        has.index_fill_(0, rows.rows, True)
        return ids, has

    def _fill(self, new: list, to_device: ToDevice) -> None:
        lists = [seq.params.logprob_token_ids for _, seq in new]
        width = max(self.ids.shape[1], *(len(ids) for ids in lists))
        if width > self.ids.shape[1]:  # a longer list than any before: widen every row (zeros)
            wider = torch.zeros((self.ids.shape[0], width), dtype=torch.int64, device=self.ids.device)
            wider[:, : self.ids.shape[1]] = self.ids
            self.ids = wider
        self.ids = _grown(self.ids, self.table.capacity)
        # The new rows in one pinned copy, not one synchronous copy per sequence.
        host = np.zeros((len(new), width + 1), dtype=np.int64)  # column 0: the slot
        for i, ((slot, _), ids) in enumerate(zip(new, lists)):
            host[i, 0] = slot
            host[i, 1 : 1 + len(ids)] = ids
        packed = to_device(torch.from_numpy(host))
        self.ids.index_copy_(0, packed[:, 0], packed[:, 1:])
