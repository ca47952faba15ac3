"""What ``cpu_offload_gb`` costs: decode throughput with a share of the weights in pinned CPU memory.

64 sequences of 128 random prompt tokens, 128 greedy output tokens each (eos ignored), random
weights (``load_format="dummy"``) with the real architecture's shapes (peer_bench.py's configs).
``FRACTION`` of all the weights' bytes is offloaded (0: none, the baseline with CUDA graphs).
Every forward streams the offloaded bytes over the host link once, so a step takes at least
offloaded bytes / link bandwidth; the row's ``stream_gb_s`` is offloaded bytes x steps / seconds,
the bandwidth the run sustained (compare it with the link's, ~50 GB/s for PCIe Gen5 x16).
    python bench/offload_bench.py qwen3-0.6b|llama3-8b FRACTION
Prints one JSON row (peer_bench.py's fields and the above) and appends it to $RESULTS when set."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from random import randint, seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_usage import check_usage  # noqa: E402
from peer_bench import CONFIGS, model_dir  # noqa: E402
from result_row import emit  # noqa: E402

SEQS, PROMPT, OUTPUT = 64, 128, 128


def weight_bytes(shape: str) -> int:
    """bf16 bytes of every weight of the shape (embedding and LM head once each unless tied)."""
    c = CONFIGS[shape]
    h, inter, heads, kv_heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or h // heads
    layer = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim + 3 * h * inter + 2 * h
    embeddings = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return 2 * (c["num_hidden_layers"] * layer + embeddings + h)


def main() -> None:
    check_usage(__doc__, 2)
    shape, fraction = sys.argv[1], float(sys.argv[2])
    from tokenmill import LLM, SamplingParams, __version__

    offload_gb = fraction * weight_bytes(shape) / 2**30
    start = time.time()
    llm = LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
              seed=0, cpu_offload_gb=offload_gb)
    init_s = time.time() - start
    offloader = llm.llm_engine.executor.driver.offloader
    offloaded = offloader.offloaded_bytes if offloader is not None else 0
    warm = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, warm, use_tqdm=False)
    seed(0)
    prompts = [{"prompt_token_ids": [randint(0, 10000) for _ in range(PROMPT)]} for _ in range(SEQS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True, detokenize=False)
    steps_before = llm.llm_engine.stats.num_steps
    start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.time() - start
    steps = llm.llm_engine.stats.num_steps - steps_before
    got = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = dict(engine="tokenmill_offload", version=__version__, shape=shape, workload=f"decode{SEQS}x{OUTPUT}",
               seqs=SEQS, in_tokens=SEQS * PROMPT, out_tokens=SEQS * OUTPUT, got_tokens=got, seconds=round(seconds, 2),
               out_tok_s=round(SEQS * OUTPUT / seconds, 1), init_s=round(init_s, 1), offload_fraction=fraction,
               offloaded_gib=round(offloaded / 2**30, 2), steps=steps,
               stream_gb_s=round(offloaded * steps / seconds / 1e9, 1) if offloaded else None)
    emit(row)


if __name__ == "__main__":
    main()
