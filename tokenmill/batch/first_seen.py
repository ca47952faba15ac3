"""Where each string key of a long stream was first seen, in ~30 bytes a key whatever its length.

The OpenAI batch reader must remember every custom_id it has read, to refuse a line that reuses
one (`readers._unique_custom_ids`). A dict of the ids and their "line N" texts kept ~200 bytes a
line for the whole run, in the job and in every replica (each reads every line): 200 MB for a
million-line file, 2 GB for ten million (bench/results/host_memory_soak.md).

Here a key is its 128-bit BLAKE2b digest, the prefix cache's key (`engine/kv_cache.py`): two
different ids share one with odds of ~2^-128 a pair, so a "seen" answer is exact in practice. The
newest digests sit in a dict (~120 bytes an entry); when it holds a sixteenth as many as the rest
(and at least ``merge_at``), they are merged into three sorted numpy arrays (digest halves and
value, 24 bytes a key), searched by bucket and bisection. So ~24-32 bytes a key; the arrays are
rewritten at every merge (the new keys inserted in place), ~17 writes a key over a run. A lookup
is one dict probe and one bisection (Python's, over memoryviews of the arrays: ~0.7 us where
numpy's searchsorted takes ~3 us for one value).
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any

MERGE_AT = 1 << 13  # the fewest digests the dict holds before they move to the arrays (~1 MB of dict)
_BUCKET_SHIFT = 48  # the arrays are indexed by their keys' top 16 bits (512 KB of offsets)
_BUCKETS = 1 << (64 - _BUCKET_SHIFT)


class FirstSeen:
    """``setdefault(key, value)``: the value stored with ``key`` when it was first given, else
    ``value`` (now stored with it). Values are integers (line numbers)."""

    def __init__(self, merge_at: int = MERGE_AT):
        self.merge_at = merge_at
        self.recent: dict[bytes, int] = {}  # digest -> value, not merged yet
        # Sorted by the digest's first half: its halves as uint64 and the values as int64 (numpy arrays),
        # and memoryviews of them, which Python's bisect and indexing read without numpy's per-call cost.
        self.high: Any = None
        self.low: Any = None
        self.values: Any = None
        self._views: tuple[memoryview, memoryview, memoryview, memoryview] | None = None
        self._merged = 0  # keys in the arrays
        self._merge_when = merge_at  # the dict's size that starts the next merge

    def __len__(self) -> int:
        return len(self.recent) + self._merged

    def setdefault(self, key: str, value: int) -> int:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        found = self.recent.get(digest)
        if found is None and self._views is not None:
            found = self._search(digest)
        if found is not None:
            return found
        self.recent[digest] = value
        if len(self.recent) >= self._merge_when:
            self._merge()
        return value

    def _search(self, digest: bytes) -> int | None:
        assert self._views is not None
        highs, lows, values, starts = self._views
        high, low = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")
        bucket = high >> _BUCKET_SHIFT
        at, end = starts[bucket], starts[bucket + 1]
        at = bisect.bisect_left(highs, high, at, end)
        while at < end and highs[at] == high:  # equal first halves: next to each other
            if lows[at] == low:
                return values[at]
            at += 1
        return None

    def _merge(self) -> None:
        """The dict's digests into the arrays: sorted alone, then inserted where they belong, one array
        at a time, so that a merge holds the arrays once and one array's new copy (32 bytes a key)
        where concatenating and sorting all of them held three times as much."""
        import numpy as np

        halves = np.frombuffer(b"".join(self.recent), dtype="<u8").reshape(-1, 2)
        values = np.fromiter(self.recent.values(), dtype=np.int64, count=len(self.recent))
        order = np.argsort(halves[:, 0])
        high, low, values = halves[order, 0], halves[order, 1], values[order]
        self.recent = {}
        self._views = None  # the old arrays' views: each old array is freed as its new copy replaces it
        if self.high is None:
            self.high, self.low, self.values = high, low, values
        else:
            at = np.searchsorted(self.high, high)
            self.high = np.insert(self.high, at, high)
            self.low = np.insert(self.low, at, low)
            self.values = np.insert(self.values, at, values)
        # Where each bucket of first halves (their top bits) starts: a lookup bisects its bucket only.
        firsts = np.arange(_BUCKETS, dtype=np.uint64) << np.uint64(_BUCKET_SHIFT)
        starts = np.append(np.searchsorted(self.high, firsts), len(self.high))
        self._views = (memoryview(self.high), memoryview(self.low), memoryview(self.values), memoryview(starts))
        self._merged = len(self.high)
        self._merge_when = max(self.merge_at, self._merged // 16)
