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


def test_a_sequence_sharing_committed_blocks_adopts_their_keys_instead_of_hashing_again(monkeypatch):
    """A fork or a later sample admitted on its source's blocks: those already in the prefix cache
    count as committed, with the keys its own tokens give (no hash is computed for them again),
    and its next full block chains on from them; the source's uncommitted tail is not adopted."""
    from tokenmill.engine import kv_cache

    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    source = make_seq(list(range(14)))
    compute(kv, source, 14)  # blocks 0-2 full and committed, block 3 half full
    fork = make_seq(list(range(13)) + [99], seq_id=1)  # same tokens up to position 13
    expected = make_seq(list(range(13)) + [99] + [5, 6], seq_id=2)
    kv._extend_hashes(expected, 4)  # the keys its tokens give, computed the ordinary way
    hashed = []
    real = kv_cache.chain_hash
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: hashed.append(tokens) or real(parent, tokens))
    assert kv.allocate(fork, 2, source.block_ids[:3])  # 12 tokens shared, 2 to compute
    assert fork.num_committed_blocks == 3 and fork.block_hashes == expected.block_hashes[:3] and hashed == []
    fork.output_token_ids += [5, 6]
    assert kv.allocate(fork, 2)
    fork.num_computed_tokens += 4
    kv.commit_computed(fork)  # its own fourth block: one hash, chained on the adopted keys
    assert hashed == [[12, 99, 5, 6]] and fork.block_hashes == expected.block_hashes and fork.num_committed_blocks == 4

    uncommitted = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    lone = make_seq(list(range(9)), seq_id=3)
    assert uncommitted.allocate(lone, 9)  # computed but never committed: nothing to adopt
    sample = make_seq(list(range(9)), seq_id=4)
    assert uncommitted.allocate(sample, 1, lone.block_ids[:2])
    assert sample.num_committed_blocks == 0 and sample.block_hashes == []


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


def touched_blocks(kv: KVCacheManager) -> int:
    return kv.num_usable_blocks - len(kv.pool.untouched)


def run_many(kv: KVCacheManager, count: int, tokens: int = 6) -> None:
    """``count`` short sequences one after another, each committing one full block (a distinct prefix)."""
    for i in range(count):
        seq = make_seq([1000 + i] * tokens, seq_id=i)
        compute(kv, seq, tokens)
        kv.free(seq)


def test_a_pool_that_grows_on_demand_touches_what_the_work_needs():
    """The CPU's default pool: memory becomes resident as blocks are first written, so blocks used
    before are reused (oldest first) before a never-used one, beyond a cache of an eighth of the pool."""
    eager = KVCacheManager(num_blocks=801, block_size=4, enable_prefix_caching=True)
    run_many(eager, 1000)
    assert touched_blocks(eager) == 800  # reuse oldest-first walks the whole pool
    lazy = KVCacheManager(num_blocks=801, block_size=4, enable_prefix_caching=True, grow_on_demand=True)
    run_many(lazy, 1000)
    assert touched_blocks(lazy) <= 800 // 8 + 2  # the kept cache + what one sequence holds
    assert lazy.num_free_blocks == 800
    # Still a prefix cache, LRU: the newest prefixes hit, the oldest were evicted.
    assert len(lazy.find_cached_prefix(make_seq([1999] * 6, seq_id=5000))) == 1
    assert lazy.find_cached_prefix(make_seq([1000] * 6, seq_id=5001)) == []


def test_a_pool_that_grows_on_demand_still_hands_out_every_block():
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True, grow_on_demand=True)
    run_many(kv, 3)
    seq = make_seq(list(range(32)), seq_id=99)
    assert kv.allocate(seq, 32) and sorted(seq.block_ids) == list(range(1, 9))
    assert not kv.allocate(make_seq([5] * 4, seq_id=100), 4)


def test_the_cpu_default_pool_grows_on_demand_and_a_sized_one_does_not(tiny_llama_dir):
    from tokenmill import LLM

    prompts = [f"row {i} of many, many rows that a batch job sends" for i in range(120)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    default = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64)
    sized = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 30)
    kv = default.llm_engine.kv
    assert kv.pool.untouched and not sized.llm_engine.kv.pool.untouched
    assert kv.num_usable_blocks == sized.llm_engine.kv.num_usable_blocks == 256 * 4  # max_num_seqs full sequences
    texts = []
    for start in range(0, len(prompts), 8):  # a job feeding the engine a few rows at a time
        texts += [o.outputs[0].text for o in default.generate(prompts[start:start + 8], params, use_tqdm=False)]
    assert touched_blocks(kv) <= kv.pool.keep_freed + 8 * 4  # the kept cache, plus what 8 rows hold at once
    assert touched_blocks(kv) < 2 * len(prompts)  # where the old pool walked 3 fresh blocks per row
    assert texts == [o.outputs[0].text for o in sized.generate(prompts, params, use_tqdm=False)]
    assert default.generate(prompts[-1:], params, use_tqdm=False)[0].num_cached_tokens >= 16  # still a prefix cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_the_cpu_cache_tensors_start_zeroed_and_own_their_memory(dtype):
    """lazy_zeros' CPU tensors: zero-filled (a masked slot must hold a finite number), the shape and
    dtype asked, memory of their own, and a view keeps its memory alive after the tensor is dropped."""
    import gc

    import torch

    from tokenmill.worker.sizing import lazy_zeros

    dtype = getattr(torch, dtype)
    shape = (2, 7, 16, 3, 8)
    a, b = (lazy_zeros(shape, dtype, torch.device("cpu")) for _ in range(2))
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    assert not a.float().any() and not b.float().any()
    a[1, 6, 15] = 2.0
    assert float(a.float().sum()) == 2.0 * 3 * 8 and not b.float().any()  # no shared memory
    tail = a[1, 6]
    del a
    gc.collect()
    tail.copy_(tail.float() + 1)  # its memory is still there (float8 has no in-place add)
    assert float(tail.float().sum()) == 2.0 * 24 + 16 * 24
    assert lazy_zeros((0, 4), dtype, torch.device("cpu")).shape == (0, 4)
