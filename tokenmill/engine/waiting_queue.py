"""The scheduler's queue of waiting sequences under vLLM's ``scheduling_policy="priority"``.

First come, first served needs nothing but a deque (sequences that must go first, preempted or
forked beams, go to its front). Under the priority policy sequences leave in the order of their
request's ``priority`` (lower first), then its arrival time, then the sequence id (a request's
samples and beams in order); a preempted sequence goes back to its place in that order, as in vLLM.
A heap keeps every operation O(log n), so a million queued prompts cost no more than a deque.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from tokenmill.engine.request import Sequence


def priority_key(seq: "Sequence") -> tuple[int, float, int]:
    """Lower leaves the queue first; the highest is preempted first."""
    return seq.request.priority, seq.request.arrival_time, seq.seq_id


class PriorityWaitingQueue:
    """The deque methods the scheduler uses; every way in sorts by (priority, arrival, seq_id)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, "Sequence"]] = []

    def append(self, seq: "Sequence") -> None:
        heapq.heappush(self._heap, (*priority_key(seq), seq))

    appendleft = append  # a preempted sequence returns to its place, not to the front

    def extend(self, seqs: Iterable["Sequence"]) -> None:
        for seq in seqs:
            self.append(seq)

    extendleft = extend

    def popleft(self) -> "Sequence":
        return heapq.heappop(self._heap)[-1]

    def remove(self, seq: "Sequence") -> None:
        """ValueError if absent (as deque.remove); O(n): aborts only."""
        for i, entry in enumerate(self._heap):
            if entry[-1] is seq:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("sequence not in the waiting queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator["Sequence"]:
        """In the order they would leave."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:-1]))
