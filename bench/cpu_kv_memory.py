"""Resident memory of a `tokenmill run` over many tiny prompts on the CPU (issue 20, finding 9).

Each row is a short prompt whose prompt and output fill at least one KV block, so every row leaves
a prefix-cache block behind. With the default 4 GiB CPU pool the old allocator reused freed blocks
oldest-first and so walked the whole pool: resident memory grew to the pool's size. The pool now
grows on demand. Prints RSS after the model load, the peak during the job, and at the end.

The default model is a random one-layer Qwen3 with SmolLM2's tokenizer and a wide KV (32 KV heads
of 128): 16 KiB of KV per token in bf16, close to SmolLM2's 11.25 KiB (30 layers x 3 heads x 64),
at a fraction of the compute, so 20,000 rows run in minutes on a CPU; the memory behaviour is the
pool's, not the model's. --model runs a real one instead (SmolLM2 takes hours for 20,000 rows on a
small CPU).

    python bench/cpu_kv_memory.py --rows 20000
    python bench/cpu_kv_memory.py --rows 20000 --kv-cache-memory-bytes 4294967296   # a sized pool: the old policy
    python bench/cpu_kv_memory.py --rows 2000 --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--model", default=None, help="default: a random KV-heavy one-layer model (see above)")
    args = parser.parse_args()

    from tokenmill import LLM
    from tokenmill.batch.job import JobConfig, run_job

    scratch = tempfile.TemporaryDirectory()
    model = args.model or wide_kv_model(scratch.name)
    engine = {"max_model_len": 1024}  # 256 sequences x 1024 tokens: the pool is the 4 GiB default
    if args.kv_cache_memory_bytes is not None:
        engine["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
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
            for i in range(args.rows):  # ~14 prompt tokens + max_tokens: one full 16-token block per row
                f.write(json.dumps({"prompt": f"Row {i}: say one short word about the number {i}."}) + "\n")
        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        start = time.perf_counter()
        summary = run_job(JobConfig(input=source, output=os.path.join(tmp, "out.jsonl"), model=model,
                                    sampling={"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
                                    engine=engine, progress=False), llm=llm)
        done.set()
        watcher.join()
    kv = llm.llm_engine.kv
    touched = kv.num_usable_blocks - len(getattr(kv.pool, "untouched", []))
    print(json.dumps({
        "model": args.model or "wide-kv one-layer Qwen3", "rows": summary.rows_done, "failed": summary.failed, "seconds": round(time.perf_counter() - start, 1),
        "kv_blocks": kv.num_usable_blocks, "kv_blocks_touched": touched,
        "rss_after_load_mib": round(loaded), "rss_peak_mib": round(max(peak[0], rss_mib())), "rss_end_mib": round(rss_mib()),
        "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }))


if __name__ == "__main__":
    main()
