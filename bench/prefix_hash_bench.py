"""Host cost per KV block of the prefix-cache key and of checking a hit.

    python bench/prefix_hash_bench.py [--block-size 16] [--blocks 20000]

Every full block of every prompt (and of every output, once it fills a block) gets a key chained
over its parent's key and its token ids; a hit then compares the block's token ids with the ones
stored with the cached block. This times tokenmill's key (``kv_cache.chain_hash``, a 128-bit
BLAKE2b digest) against Python's ``hash((parent, tuple(tokens)))`` (the key before) and sha256,
each fed the block's token ids as ``seq.tokens`` slices them, and the hit check
(``BlockPool.lookup``). Prints nanoseconds per block, the best of 5 runs; token ids random below
152k (Qwen's vocabulary).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.engine.kv_cache import _ROOT_HASH, BlockPool, chain_hash  # noqa: E402


def python_hash(parent: int, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


def sha256(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def chain(fn: Callable, root: object, blocks: list[list[int]]) -> Callable[[], None]:
    def run() -> None:
        parent = root
        for tokens in blocks:
            parent = fn(parent, tokens)

    return run


def best_ns_per_block(run: Callable[[], object], count: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        run()
        best = min(best, time.perf_counter_ns() - start)
    return best / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=20000)
    args = parser.parse_args()
    rng = random.Random(0)
    bs, count = args.block_size, args.blocks
    tokens = [rng.randrange(152_000) for _ in range(bs * count)]
    blocks = [tokens[i * bs : (i + 1) * bs] for i in range(count)]
    # A pool holding every block, to time hits.
    pool = BlockPool(count + 1)
    keys, parent = [], _ROOT_HASH
    for block_id, block in enumerate(blocks, start=1):
        parent = chain_hash(parent, block)
        keys.append(parent)
        pool.register(block_id, parent, block)
    variants: dict[str, Callable[[], object]] = {
        "key: kv_cache.chain_hash (BLAKE2b-128)": chain(chain_hash, _ROOT_HASH, blocks),
        "key: sha256": chain(sha256, bytes(32), blocks),
        "key: hash((parent, tuple(tokens))) (before)": chain(python_hash, 0, blocks),
        "hit: BlockPool.lookup (key + token check)": lambda: [pool.lookup(k, b) for k, b in zip(keys, blocks)],
        "hit: dict lookup alone (before)": lambda: [pool.cached.get(k) for k in keys],
    }
    print(f"block_size {bs}, {count} blocks")
    for name, run in variants.items():
        print(f"  {name:<46} {best_ns_per_block(run, count):7.0f} ns/block")


if __name__ == "__main__":
    main()
