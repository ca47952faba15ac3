"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables and prefix caching.

Only ids and counts live here; the tensors themselves belong to the model runner. A block is
``block_size`` token slots in every layer's cache. A sequence's block table lists its blocks in
order, so token ``p`` lives in slot ``block_ids[p // block_size] * block_size + p % block_size``.

Prefix caching: once a block is full and computed, it is keyed by a hash chained over its parent's
key and its own token ids, so equal prefixes map to equal keys. A later sequence whose prompt starts
with the same tokens takes those blocks (reference counted) instead of recomputing them. Freed
blocks keep their contents and key in an LRU free list; they are reused as hits until a new
allocation needs the memory, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.engine.request import Sequence
from tokenmill.engine.step import NULL_BLOCK  # noqa: F401  (block 0; BlockPool never hands it out)

_ROOT_HASH = 0x9E3779B97F4A7C15  # parent key of a sequence's first block


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    # Python's tuple hash of ints is deterministic across runs (no hash randomisation for ints);
    # a 64-bit collision between two different prefixes is astronomically unlikely.
    return hash((parent, tokens))


class BlockPool:
    """All blocks, their reference counts, the LRU list of free blocks and the prefix-hash index.

    Block 0 is the null block: no sequence owns it, so padding in block tables and slot mappings
    can point at it without touching anyone's keys and values.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order (front = evict first). Cached blocks sit here too.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # prefix hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"asked for {count} KV blocks with only {len(self.free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            self._forget(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def take(self, block_id: int) -> None:
        """Add a reference to a block that is cached or shared (a prefix hit)."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        # Release the tail first: a sequence's last blocks are the least likely to be shared again,
        # so they should be evicted before its first blocks.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None

    def lookup(self, key: int) -> int | None:
        return self.cached.get(key)

    def register(self, block_id: int, key: int) -> None:
        if self.block_hash[block_id] is None and key not in self.cached:
            self.block_hash[block_id] = key
            self.cached[key] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible while no block is in use."""
        if any(self.ref_counts):
            return False
        for block_id in range(1, self.num_blocks):
            self._forget(block_id)
        return True

    def _forget(self, block_id: int) -> None:
        key = self.block_hash[block_id]
        if key is not None:
            self.block_hash[block_id] = None
            if self.cached.get(key) == block_id:
                del self.cached[key]


class KVCacheManager:
    """Gives sequences the blocks they need for the tokens scheduled this step."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding a prefix of this waiting sequence's tokens (not yet taken).

        At least one token is always left to compute, since its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits = []
        for key in seq.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Reserve the blocks for ``num_new_tokens`` more tokens; False (and no change) if they don't fit.

        ``prefix_blocks`` (only for a sequence holding no blocks) are cached or shared blocks that
        already hold its first tokens; they count as computed.
        """
        prefix_blocks = prefix_blocks or []
        prefix_tokens = len(prefix_blocks) * self.block_size
        needed = max(0, -(-(seq.num_computed_tokens + prefix_tokens + num_new_tokens) // self.block_size)
                     - len(seq.block_ids) - len(prefix_blocks))
        # Prefix blocks sitting in the free list stop being allocatable once we take them.
        reclaimed = sum(1 for b in prefix_blocks if self.pool.ref_counts[b] == 0)
        if needed > self.pool.num_free - reclaimed:
            return False
        for block_id in prefix_blocks:
            self.pool.take(block_id)
        seq.block_ids.extend(prefix_blocks)
        seq.num_computed_tokens += prefix_tokens
        seq.block_ids.extend(self.pool.allocate(needed))
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Index the sequence's newly completed full blocks so later prompts can hit them."""
        if not self.enable_prefix_caching:
            return
        # A block is indexed by its token ids, so one holding a token still in flight waits.
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if full <= seq.num_committed_blocks:
            return
        self._extend_hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            self.pool.register(seq.block_ids[i], seq.block_hashes[i])
        seq.num_committed_blocks = full

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_committed_blocks = 0

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
            seq.block_hashes.append(chain_hash(parent, tuple(seq.tokens(i * bs, (i + 1) * bs))))
