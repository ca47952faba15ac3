"""Host cost per request of LLM.embed: the engine's own work, with the model's forward replaced by
zeros of the right shape (so neither the CPU's matmuls nor a GPU are measured).

P6 is host-bound on its BERT shape (65,536 requests of U[8,128] tokens on a 22M-parameter model:
about 0.5 s of GPU work), so microseconds per request here are most of its time there. Runs on the
CPU with a tiny config of the chosen P6 shape's architecture, the P6 inputs (token ids, U[8, hi])
and a 64K-token step, as on a large GPU. ``--profile`` prints cProfile's top functions.
Usage: python bench/pooling_host_bench.py [bert|qwen3] [--requests 65536] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from random import randint, seed

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # a tiny model of each P6 architecture, and P6's longest input
    "bert": (dict(architectures=["BertModel"], model_type="bert", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, vocab_size=30522, max_position_embeddings=512, type_vocab_size=2), 128),
    "qwen3": (dict(architectures=["Qwen3Model"], model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=151669, rms_norm_eps=1e-6,
                   max_position_embeddings=32768, tie_word_embeddings=True), 384),
}


class _ZeroForward:
    """The model's forward replaced by zeros of the right shape; its config stays (the runner reads
    the heads' dtype from it)."""

    def __init__(self, config, hidden: int):
        self.config, self.hidden = config, hidden

    def __call__(self, ids, positions, ctx, **kw):
        return torch.zeros(ids.shape[0], self.hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", default="bert", choices=list(SHAPES))
    parser.add_argument("--requests", type=int, default=65536)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tokenmill import LLM

    config, longest = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        llm = LLM(folder, runner="pooling", load_format="dummy", dtype="float32", device="cpu", max_model_len=512, seed=0,
                  skip_tokenizer_init=True, max_num_batched_tokens=65536, max_num_seqs=65536)
    engine = llm.llm_engine
    hidden = config["hidden_size"]
    engine.runner.model = _ZeroForward(engine.runner.model.config, hidden)
    seed(0)
    inputs = [{"prompt_token_ids": [randint(2, 10000) for _ in range(randint(8, longest))]} for _ in range(args.requests)]
    llm.embed(inputs[:64], use_tqdm=False)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    llm.embed(inputs, use_tqdm=False)
    seconds = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    tokens = sum(len(x["prompt_token_ids"]) for x in inputs)
    print(json.dumps({"bench": "pooling_host", "shape": args.shape, "requests": args.requests, "in_tokens": tokens,
                      "seconds": round(seconds, 3), "us_per_request": round(seconds / args.requests * 1e6, 1),
                      "profiled": args.profile}))


if __name__ == "__main__":
    main()
