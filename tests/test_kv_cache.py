"""Block pool and prefix-cache bookkeeping, checked on hand-made sequences."""

from __future__ import annotations

import pytest

from tokenmill.engine.kv_cache import NULL_BLOCK, KVCacheManager
from tokenmill.engine.request import Request, Sequence
from tokenmill.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    request = Request(str(seq_id), None, tokens, SamplingParams())
    seq = Sequence(seq_id, 0, request, tokens)
    request.sequences.append(seq)
    return seq


def compute(kv: KVCacheManager, seq: Sequence, num: int) -> None:
    assert kv.allocate(seq, num)
    seq.num_computed_tokens += num
    kv.commit_computed(seq)


def test_allocation_counts_blocks_and_never_hands_out_the_null_block():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(10)))
    assert kv.allocate(seq, 10)
    assert len(seq.block_ids) == 3 and NULL_BLOCK not in seq.block_ids
    assert kv.num_free_blocks == 1
    other = make_seq(list(range(100, 110)), seq_id=1)
    assert not kv.allocate(other, 10)  # needs 3, only 1 free: refused without side effects
    assert other.block_ids == [] and kv.num_free_blocks == 1
    kv.free(seq)
    assert kv.num_free_blocks == 4


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)))
    compute(kv, first, 12)
    first_blocks = list(first.block_ids)
    kv.free(first)  # blocks stay cached in the free list
    second = make_seq(list(range(12)), seq_id=1)
    hits = kv.find_cached_prefix(second)
    # 12 tokens = 3 full blocks, but the last token must be computed for its logits.
    assert hits == first_blocks[:2]
    assert kv.allocate(second, 12 - 8, hits)
    assert second.num_computed_tokens == 8 and second.block_ids[:2] == hits

    diverging = make_seq([0, 1, 2, 3, 99, 5, 6, 7, 8], seq_id=2)
    assert kv.find_cached_prefix(diverging) == first_blocks[:1]


def test_a_key_collision_is_a_miss_unless_the_block_holds_the_same_tokens(monkeypatch):
    from tokenmill.engine import kv_cache

    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: b"one key for every block")
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)))
    compute(kv, first, 12)
    first_blocks = list(first.block_ids)
    kv.free(first)
    assert kv.find_cached_prefix(make_seq([0, 1, 2, 99, 4, 5, 6, 7, 8], seq_id=1)) == []
    # The same first block is a real hit; the second block's key then finds the first block
    # again (the only one under that key), whose tokens differ: the hit stops there.
    assert kv.find_cached_prefix(make_seq(list(range(12)), seq_id=2)) == first_blocks[:1]


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = make_seq(list(range(9)))
    compute(kv, a, 9)
    b = make_seq(list(range(9)), seq_id=1)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert kv.allocate(b, 1, hits)
    free_before = kv.num_free_blocks
    kv.free(a)
    # a's two shared blocks are still held by b; only a's private third block returns.
    assert kv.num_free_blocks == free_before + 1
    assert all(kv.pool.ref_counts[blk] == 1 for blk in hits)


def test_lru_evicts_oldest_cached_blocks_first():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    old = make_seq([1, 2, 3, 4, 5])
    compute(kv, old, 4)
    kv.free(old)
    new = make_seq([7, 8, 9, 10, 11], seq_id=1)
    compute(kv, new, 4)
    kv.free(new)
    # Allocating 2 blocks must evict old's blocks (released earlier), keeping new's cached.
    filler = make_seq([50, 51, 52, 53], seq_id=2)
    assert kv.allocate(filler, 4)
    assert kv.find_cached_prefix(make_seq([1, 2, 3, 4, 5], seq_id=3)) == []
    assert len(kv.find_cached_prefix(make_seq([7, 8, 9, 10, 11], seq_id=4))) == 2


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    first = make_seq(list(range(12)))
    compute(kv, first, 12)
    assert kv.find_cached_prefix(make_seq(list(range(12)), seq_id=1)) == []


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3, 4, 5])
    compute(kv, seq, 4)
    assert not kv.pool.reset_prefix_cache()
    kv.free(seq)
    assert kv.pool.reset_prefix_cache()
    assert kv.find_cached_prefix(make_seq([1, 2, 3, 4, 5], seq_id=1)) == []


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_pool_needs_room_beyond_the_null_block(num_blocks):
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
