"""Where each string key of a long stream was first seen, in ~30 bytes a key whatever its length.

The OpenAI batch reader must remember every custom_id it has read, to refuse a line that reuses
one (`readers._unique_custom_ids`). A dict of the ids and their "line N" texts kept ~200 bytes a
line for the whole run, in the job and in every replica (each reads every line): 200 MB for a
million-line file, 2 GB for ten million (bench/results/host_memory_soak.md).

Here a key is its 128-bit BLAKE2b digest, the prefix cache's key (`engine/kv_cache.py`): two
different ids share one with odds of ~2^-128 a pair, so a "seen" answer is exact in practice. The
newest digests sit in a dict; when it holds an eighth as many as the rest (and at least
``merge_at``), they are merged into three sorted numpy arrays (digest halves and value, 24 bytes a
key) searched by bisection. Each key is merged ~8 times on its way down (sorting is amortised
O(log n) a key); a lookup is one dict probe and one bisection (Python's, over memoryviews of the
arrays: ~0.7 us where numpy's searchsorted takes ~3 us for one value).
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any

MERGE_AT = 1 << 16  # the fewest digests the dict holds before they move to the arrays
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
        import numpy as np

        halves = np.frombuffer(b"".join(self.recent), dtype="<u8").reshape(-1, 2)
        high, low = halves[:, 0], halves[:, 1]
        values = np.fromiter(self.recent.values(), dtype=np.int64, count=len(self.recent))
        if self.high is not None:
            high, low, values = (np.concatenate(pair) for pair in ((self.high, high), (self.low, low), (self.values, values)))
        order = np.argsort(high, kind="stable")
        self.high, self.low, self.values = high[order], low[order], values[order]
        # Where each bucket of first halves (their top bits) starts: a lookup bisects its bucket only.
        edges = np.arange(_BUCKETS + 1, dtype=np.uint64) << np.uint64(_BUCKET_SHIFT)
        starts = np.searchsorted(self.high, edges[:-1]).tolist() + [len(self.high)]
        self._views = (memoryview(self.high), memoryview(self.low), memoryview(self.values), memoryview(np.array(starts)))
        self._merged = len(self.high)
        self._merge_when = max(self.merge_at, self._merged // 8)
        self.recent = {}
