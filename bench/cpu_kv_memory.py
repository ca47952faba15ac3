"""Resident memory of the CPU's KV pool over many tiny rows (issue 20, finding 9).

Each row is a short prompt whose prompt and output fill one KV block and start a second, so every
row leaves a prefix-cache block behind. The default CPU pool (4 GiB) is allocated untouched and
becomes resident page by page as slots are written. The old allocator reused freed blocks
oldest-first and so walked the whole pool: resident memory crept up to its size. The pool now
grows on demand (engine/kv_cache.py).

Two ways to measure:

  default: the pool alone, as the engine drives it. SmolLM2-135M's KV geometry in bf16 (30 layers,
  3 KV heads of 64), the runner's own lazily zeroed tensors and the engine's KVCacheManager; rows
  run 256 at a time (max_num_seqs), each allocates its blocks, writes its 18 tokens' keys and values
  in every layer, commits its full block to the prefix cache and is freed. Seconds for 20,000 rows.

  --engine: a whole `tokenmill run` (run_job) on a random one-layer model with a wide KV (16 KiB a
  token in bf16, near SmolLM2's 11.25 KiB) and SmolLM2's tokenizer. The same memory behaviour plus
  everything else the job holds; minutes to hours for 20,000 rows, depending on the CPU.

    python bench/cpu_kv_memory.py --rows 20000                  # the pool as it is now (grows on demand)
    python bench/cpu_kv_memory.py --rows 20000 --old-policy     # the pool as it was (oldest freed block first)
    python bench/cpu_kv_memory.py --rows 20000 --engine [--kv-cache-memory-bytes 4294967296]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time

BLOCK = 16
ROW_TOKENS = 18  # ~14 prompt tokens + 4 generated: one full block and part of a second


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pool_only(rows: int, old_policy: bool) -> dict:
    import torch

    from tokenmill.engine.kv_cache import KVCacheManager
    from tokenmill.engine.request import Request, Sequence
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.sizing import lazy_zeros
    from tokenmill.worker.sizing import CPU_DEFAULT_KV_BYTES

    layers, heads, dim, dtype, max_num_seqs, max_model_len = 30, 3, 64, torch.bfloat16, 256, 8192
    per_block = layers * 2 * BLOCK * heads * dim * dtype.itemsize
    num_blocks = min(CPU_DEFAULT_KV_BYTES // per_block, max_num_seqs * (max_model_len // BLOCK) + 1)
    before = rss_mib()
    caches = [lazy_zeros((2, num_blocks, BLOCK, heads, dim), dtype, torch.device("cpu")) for _ in range(layers)]
    allocated = rss_mib()
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True, grow_on_demand=not old_policy)
    peak = allocated
    values = torch.randn(2, max_num_seqs * ROW_TOKENS, heads, dim).to(dtype)
    start = time.perf_counter()
    for first in range(0, rows, max_num_seqs):
        wave, slots = [], []
        for i in range(first, min(first + max_num_seqs, rows)):
            tokens = [1000 + i] * ROW_TOKENS  # a distinct prefix per row
            request = Request(str(i), None, tokens, SamplingParams())
            seq = Sequence(i, 0, request, tokens)
            request.sequences.append(seq)
            assert kv.allocate(seq, ROW_TOKENS)
            slots += [seq.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(ROW_TOKENS)]
            wave.append(seq)
        index = torch.tensor(slots)
        for cache in caches:  # what the runner's KV store writes for these tokens
            cache.view(2, num_blocks * BLOCK, heads, dim)[:, index] = values[:, : len(slots)]
        for seq in wave:
            seq.num_computed_tokens = ROW_TOKENS
            kv.commit_computed(seq)
            kv.free(seq)
        peak = max(peak, rss_mib())
    return {
        "mode": "pool only, SmolLM2 KV geometry, bf16", "policy": "oldest freed first" if old_policy else "grows on demand",
        "rows": rows, "seconds": round(time.perf_counter() - start, 1), "kv_blocks": kv.num_usable_blocks,
        "kv_pool_mib": round(num_blocks * per_block / 2**20), "rss_before_pool_mib": round(before),
        "rss_after_pool_allocated_mib": round(allocated), "rss_peak_mib": round(peak), "rss_end_mib": round(rss_mib()),
    }


def wide_kv_model(folder: str) -> str:
    """A random one-layer Qwen3 with 32 KV heads of 128 and SmolLM2's tokenizer, saved in ``folder``."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tokenmill.models.source import resolve_model

    tokenizer = resolve_model("smollm2-135m-instruct").tokenizer_path
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tokenizer, name)):
            shutil.copy(os.path.join(tokenizer, name), folder)
    return folder


def whole_job(rows: int, kv_cache_memory_bytes: int | None, model: str | None) -> dict:
    from tokenmill import LLM
    from tokenmill.batch.job import JobConfig, run_job

    scratch = tempfile.TemporaryDirectory()
    model = model or wide_kv_model(scratch.name)
    engine = {"max_model_len": 1024}  # 256 sequences x 1024 tokens: the pool is the 4 GiB default
    if kv_cache_memory_bytes is not None:
        engine["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    llm = LLM(model, device="cpu", seed=0, **engine)
    loaded = rss_mib()
    peak = [loaded]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[0] = max(peak[0], rss_mib())

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "rows.jsonl")
        with open(source, "w") as f:
            for i in range(rows):
                f.write(json.dumps({"prompt": f"Row {i}: say one short word about the number {i}."}) + "\n")
        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        start = time.perf_counter()
        summary = run_job(JobConfig(input=source, output=os.path.join(tmp, "out.jsonl"), model=model,
                                    sampling={"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                    engine=engine, progress=False), llm=llm)
        done.set()
        watcher.join()
    kv = llm.llm_engine.kv
    return {
        "mode": "whole job", "model": model, "rows": summary.rows_done, "failed": summary.failed,
        "seconds": round(time.perf_counter() - start, 1), "kv_blocks": kv.num_usable_blocks,
        "kv_blocks_touched": kv.num_usable_blocks - len(kv.pool.untouched),
        "rss_after_load_mib": round(loaded), "rss_peak_mib": round(max(peak[0], rss_mib())), "rss_end_mib": round(rss_mib()),
        "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--old-policy", action="store_true", help="pool only: reuse the oldest freed block first")
    parser.add_argument("--engine", action="store_true", help="run a whole job instead of the pool alone")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="--engine: a sized pool (the old policy)")
    parser.add_argument("--model", default=None, help="--engine: a real model instead of the wide-KV one")
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(whole_job(args.rows, args.kv_cache_memory_bytes, args.model)))
    else:
        print(json.dumps(pool_only(args.rows, args.old_policy)))


if __name__ == "__main__":
    main()
