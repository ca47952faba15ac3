"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables and prefix caching.

Only ids and counts live here; the tensors themselves belong to the model runner. A block is
``block_size`` token slots in every layer's cache. A sequence's block table lists its blocks in
order, so token ``p`` lives in slot ``block_ids[p // block_size] * block_size + p % block_size``.

Prefix caching: once a block is full and computed, it is keyed by a digest chained over its parent's
key and its own token ids, so equal prefixes map to equal keys. A later sequence whose prompt starts
with the same tokens takes those blocks (reference counted) instead of recomputing them; a hit is
also checked against the block's stored token ids. Freed
blocks keep their contents and key in an LRU free list; they are reused as hits until a new
allocation needs the memory, oldest first.

A pool that grows on demand (the CPU's default pool, whose pages become resident only when first
written) hands out a never-used block only while fewer than an eighth of the pool sit freed in the
LRU list; past that, the oldest freed block is reused. Resident memory then follows the work (what
runs at once, plus that much prefix cache) instead of creeping up to the whole pool.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from tokenmill.engine.request import Sequence
from tokenmill.engine.step import NULL_BLOCK  # noqa: F401  (block 0; BlockPool never hands it out)

_ROOT_HASH = bytes(16)  # parent key of an unsalted sequence's first block


def root_hash(cache_salt: str | None, adapter_key: str | None = None) -> bytes:
    """The parent key of a sequence's first block: a salted prompt's chain starts from its salt's
    digest, so its blocks match only prompts with the same salt (vLLM's cache_salt); a prompt run
    with a LoRA adapter, whose keys and values are the adapter's, from the adapter's too."""
    if cache_salt is None and adapter_key is None:
        return _ROOT_HASH
    digest = hashlib.blake2b(digest_size=16)
    if cache_salt is not None:
        digest.update(b"cache_salt\0" + cache_salt.encode())
    if adapter_key is not None:
        digest.update(b"\0adapter\0" + adapter_key.encode())
    return digest.digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: a 128-bit BLAKE2b digest of its parent's key and its token ids, so
    it stands for the whole prefix up to the block's end.

    Why not Python's ``hash((parent, tokens))``, used before: it is 61 bits and not collision
    resistant, colliding prompts can be built on purpose (vLLM's CVE-2025-25183 was exactly that),
    and a collision hands one prompt another prompt's keys and values. A hit also compares the
    block's own token ids (``BlockPool.lookup``), but only a strong key covers its parents.
    Host cost (bench/prefix_hash_bench.py, 16-token blocks, a busy 2-core CPU): this digest 2-3 us
    a block, sha256 the same, Python's hash 0.15-0.4 us; paid once per full block, so ~0.15 us a
    token, 0.3% of one host core at 20k tokens/s.
    """
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


class BlockPool:
    """All blocks, their reference counts, the LRU list of free blocks and the prefix-hash index.

    Block 0 is the null block: no sequence owns it, so padding in block tables and slot mappings
    can point at it without touching anyone's keys and values.
    """

    def __init__(self, num_blocks: int, grow_on_demand: bool = False):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # of cached blocks
        # Never-used blocks, handed out lowest id first (pop from the end); all of them go straight
        # to the free list when the pool does not grow on demand.
        self.untouched = list(range(num_blocks - 1, 0, -1)) if grow_on_demand else []
        self.keep_freed = (num_blocks - 1) // 8  # freed blocks kept before an untouched one is reused
        # Free blocks in eviction order (front = evict first). Cached blocks sit here too.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks) if not grow_on_demand)
        self.cached: dict[bytes, int] = {}  # prefix key -> block id

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.untouched)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks with only {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self.untouched and (len(self.free) < self.keep_freed or not self.free):
                block_id = self.untouched.pop()
            else:
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

    def lookup(self, key: bytes, tokens: list[int]) -> int | None:
        """The cached block under ``key`` if it holds exactly ``tokens`` (a key collision is a miss)."""
        block_id = self.cached.get(key)
        if block_id is None or self.block_tokens[block_id] != tuple(tokens):
            return None
        return block_id

    def register(self, block_id: int, key: bytes, tokens: list[int]) -> None:
        if self.block_hash[block_id] is None and key not in self.cached:
            self.block_hash[block_id] = key
            self.block_tokens[block_id] = tuple(tokens)
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
            self.block_tokens[block_id] = None
            if self.cached.get(key) == block_id:
                del self.cached[key]


class KVCacheManager:
    """Gives sequences the blocks they need for the tokens scheduled this step."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, grow_on_demand: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, grow_on_demand)

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
        for i, key in enumerate(seq.block_hashes[:max_blocks]):
            block_id = self.pool.lookup(key, self._block_tokens(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Reserve the blocks for ``num_new_tokens`` more tokens; False (and no change) if they don't fit.

        ``prefix_blocks`` (only for a sequence holding no blocks) are cached or shared blocks that
        already hold its first tokens; they count as computed.
        """
        if not prefix_blocks and seq.num_computed_tokens + num_new_tokens <= len(seq.block_ids) * self.block_size:
            return True  # the blocks it holds have room (a decode needs a new one every block_size steps)
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
        if prefix_blocks and self.enable_prefix_caching:
            self._adopt_committed(seq, prefix_blocks)
        return True

    def _adopt_committed(self, seq: Sequence, prefix_blocks: list[int]) -> None:
        """The leading prefix blocks already in the prefix cache count as committed, with their keys:
        a beam forked from its parent, or sample k of a request, would otherwise hash and offer
        again every block it shares (a beam search re-hashed its whole history at every fork). Their
        keys are the sequence's own, its tokens and cache salt being its source's up to there."""
        keys = self.pool.block_hash
        adopted = 0
        while adopted < len(prefix_blocks) and keys[prefix_blocks[adopted]] is not None:
            adopted += 1
        if adopted > len(seq.block_hashes):
            seq.block_hashes.extend(keys[b] for b in prefix_blocks[len(seq.block_hashes) : adopted])  # type: ignore[misc]
        seq.num_committed_blocks = max(seq.num_committed_blocks, adopted)

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
            self.pool.register(seq.block_ids[i], seq.block_hashes[i], self._block_tokens(seq, i))
        seq.num_committed_blocks = full

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_committed_blocks = 0

    def _block_tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.tokens(index * self.block_size, (index + 1) * self.block_size)

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        while len(seq.block_hashes) < num_blocks:
            adapter = seq.request.adapter
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(
                seq.request.cache_salt, adapter.cache_key if adapter is not None else None)
            seq.block_hashes.append(chain_hash(parent, self._block_tokens(seq, len(seq.block_hashes))))
