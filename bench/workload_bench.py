"""The chat-style workload with the sampling settings users copy from tutorials, one setting at a
time and all together, on any engine with vLLM's offline API (like peer_bench.py).

Usage: python bench/workload_bench.py ENGINE SHAPE [VARIANT ...] [--matched-vocab]
  ENGINE   tokenmill | vllm | any importable module exposing LLM and SamplingParams
  SHAPE    qwen3-0.6b | llama3-8b (random weights with the real shapes, from peer_bench.py)
  VARIANT  temperature | top_p | top_k | top_k_top_p | repetition | all | logit_bias | logprobs1 | logprobs2 | json
           (default: every one but json, in that order)

Workload ("chat"): 1,024 requests sharing a 256-token system prefix, each with its own U[16, 256]
tokens, output U[32, 512] tokens, eos ignored, temperature 0.7 (random.seed(0)). The variants add
top_p 0.9, top_k 50, top_k 100 with top_p 0.95 (issue 15's filter target), repetition_penalty 1.1,
top_p 0.9, top_k 50 and repetition_penalty 1.1 together, a logit bias on ten ids, or logprobs 1 / 2. One LLM serves every variant (after a
warm-up call), its prefix cache emptied before each: every variant's prompts are prefilled, as the
first's are (without the reset a later variant found every prompt of an earlier one cached and
looked faster by that prefill, docs/perf.md 53); the last variant's results are dropped and the
heap collected outside the timing, so every variant starts from the same heap (a full collection
inside a timed call stops the host for tens of ms, docs/perf.md 49). A variant may be named twice
(the first and last run of one setting show any drift in the lease). Each prints one JSON row (output tokens /
wall seconds of the generate call) and appends it to $RESULTS when set; a row whose requests stopped
before their max_tokens (got_tokens < out_tokens) also prints a warning.

json: every request constrained by JSON_SCHEMA through structured outputs (xgrammar on both engines),
what grammar-constrained decoding costs; compare it with temperature from the same process
(``... ENGINE qwen3-0.6b temperature json``). It needs a real tokenizer (the model folder's stand-in has
1,002 tokens, which would make the per-step mask unrepresentatively cheap): SmolLM2-135M-Instruct's
(49,152 tokens) from $BENCH_TOKENIZER, default .bench_tokenizer/ at the repo root (git-ignored: made by
bench/prepare_bench_tokenizer.sh, carried to the GPU machine). When a variant named needs it, the one
LLM is built with that tokenizer (skip_tokenizer_init=False) for every variant named, on the same
random-weight model folder (vocabulary 151,936: ids past the tokenizer's are never allowed by the
grammar). Those 102,784 padding ids are this bench's, not a real checkpoint's (Qwen3 pads 267):
tokenmill hands xgrammar the tokenizer's ids only, vLLM 0.26 the model's vocabulary size, which
makes each of its masks and token steps several times dearer here (docs/perf.md 66).
--matched-vocab runs every variant named on the shape with its vocabulary cut to the bench
tokenizer's (49,152 ids, lm_head and embeddings shrunk to match; rows say "vocab_size"): no padding
ids, as with a real checkpoint, for comparing engines on json. vLLM is started with structured_outputs_config={"backend": "xgrammar",
"disable_any_whitespace": True}: vLLM 0.26's xgrammar backend compiles JSON schemas with
any_whitespace=True unless that engine-wide option is set (the request's own disable_any_whitespace
is not read by that backend), and tokenmill compiles them compact (any_whitespace=False, which it
does not let that option change); with it both compile the same grammar.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import shutil
import sys
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_usage import check_usage  # noqa: E402
from peer_bench import model_dir  # noqa: E402
from result_row import emit  # noqa: E402

VARIANTS = {
    "temperature": {},
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=50),
    "top_k_top_p": dict(top_k=100, top_p=0.95),
    "repetition": dict(repetition_penalty=1.1),
    "all": dict(top_p=0.9, top_k=50, repetition_penalty=1.1),
    # A logit bias on a few ids (every request its own): the per-sequence bias rows' fill (perf.md 50).
    "logit_bias": dict(logit_bias={token: -2.0 for token in range(3, 13)}),
    # The sampled token's logprob and the top-1 (RL rollouts, evaluations), and the top-2: tokenmill
    # makes the first from two passes over the logits (perf.md 60), the second too, with a topk of the
    # logits, since perf.md 61 (before it, from the whole table: run it at 6f08266 for that).
    "logprobs1": dict(logprobs=1),
    "logprobs2": dict(logprobs=2),
    # Every request short of its min_tokens to its last token (min_tokens = its max_tokens, written
    # here as MAX_TOKENS) with a stop id, so the ban on that id is applied every step and no request
    # stops early: the temperature variant's work (perf.md 93: the ban's host sync).
    "min_tokens": dict(min_tokens="MAX_TOKENS", stop_token_ids=[0]),
}

# The json variant's schema, as one string (both engines compile this exact text: tokenmill keys a dict
# schema by its sorted dump, vLLM by its dump as given, and the property order is the grammar's).
# It must keep every request generating to its max_tokens (eos ignored) on a random-weight model, on
# both engines: a grammar that completed would leave only eos allowed, and what each engine does
# after that (ignore_eos) differs. Here it cannot complete within 512 tokens whatever the model picks:
# tags needs 512 strings, and each item after the first needs the separator '", "' (compact JSON),
# which no SmolLM2 token contains: each separator spans a token boundary, 511 of them for 512 items,
# while 512 tokens have 511 boundaries, some of them spent on id and summary.
# A random model writes a long integer, a long summary string, then a few tags: in a string the mask
# allows 48,799 of the tokenizer's 49,152 tokens (those with a quote or a backslash checked against
# the context), one or a few elsewhere, and never the 102,784 ids past the tokenizer's. Simulated
# with xgrammar 0.2.9 and 0.2.7 (the vLLM bundle's), a random pick among the allowed tokens each step,
# uniform or with tokenmill's random-weight logits' spread (N(0, 0.64) / 0.7, fresh or with a fixed
# per-request part), 512 steps, 700 matchers: none completed, at most 5 tags.
JSON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "summary": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 512},
    },
    "required": ["id", "summary", "tags"],
})
VARIANTS["json"] = dict(structured_outputs=dict(json=JSON_SCHEMA))
# Variants that need the tokenizer, and are left out of the default list (it runs without one).
TOKENIZER_VARIANTS = {"json"}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chat_workload() -> tuple[list[list[int]], list[int]]:
    seed(0)
    system = [randint(0, 10000) for _ in range(256)]
    prompts = [system + [randint(0, 10000) for _ in range(randint(16, 256))] for _ in range(1024)]
    return prompts, [randint(32, 512) for _ in prompts]


def chat_settings(variant: str) -> dict:
    """SamplingParams keywords of a variant: the workload's temperature 0.7 with the variant's settings
    (json's structured_outputs as a dict of StructuredOutputsParams keywords: see engine_settings)."""
    return dict(temperature=0.7, **VARIANTS[variant])


def bench_tokenizer() -> str:
    """The tokenizer folder of the variants that need one: $BENCH_TOKENIZER, or .bench_tokenizer/ at the repo root."""
    folder = os.path.abspath(os.environ.get("BENCH_TOKENIZER") or os.path.join(REPO_ROOT, ".bench_tokenizer"))
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise SystemExit(f"workload_bench: no tokenizer at {folder} (the json variant needs one): run "
                         "bench/prepare_bench_tokenizer.sh, carry .bench_tokenizer/ to the GPU machine, or set BENCH_TOKENIZER")
    return folder


def matched_vocab_dir(shape: str, tokenizer) -> str:
    """The shape's model folder with its vocabulary (and bos / eos ids) the tokenizer's; random
    weights either way."""
    folder = f"{model_dir(shape, False)}-vocab{len(tokenizer)}"
    if not os.path.exists(os.path.join(folder, "config.json")):
        shutil.copytree(model_dir(shape, False), folder, dirs_exist_ok=True)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                       "eos_token_id": tokenizer.eos_token_id}, f)
    return folder


def _is_vllm(mod) -> bool:
    """Whether the engine module serves vLLM's classes (vllm itself or a wrapper such as vllm_fp8)."""
    return mod.SamplingParams.__module__.split(".")[0] == "vllm"


def structured_outputs_class(mod):
    """The engine's StructuredOutputsParams: the module's own, else the one beside its SamplingParams
    (vLLM keeps it in vllm.sampling_params), else its top package's (tokenmill exports it there)."""
    home = mod.SamplingParams.__module__
    for where in (mod, sys.modules.get(home), importlib.import_module(home.split(".")[0])):
        cls = getattr(where, "StructuredOutputsParams", None)
        if cls is not None:
            return cls
    raise SystemExit(f"workload_bench: engine {mod.__name__!r} has no StructuredOutputsParams (looked in {mod.__name__}, "
                     f"{home} and {home.split('.')[0]}): the json variant needs structured outputs")


def engine_settings(mod, settings: dict) -> dict:
    """A variant's SamplingParams keywords with its structured_outputs made the engine's own class."""
    settings = dict(settings)
    if isinstance(settings.get("structured_outputs"), dict):
        settings["structured_outputs"] = structured_outputs_class(mod)(**settings["structured_outputs"])
    return settings


def per_request(settings: dict, max_tokens: int) -> dict:
    """A variant's keywords for one request: any value written MAX_TOKENS becomes its max_tokens."""
    return {key: max_tokens if value == "MAX_TOKENS" else value for key, value in settings.items()}


def _alloc_retries() -> int | None:
    """This process's CUDA allocator retries so far (None without CUDA in this process: the CPU, or
    an engine whose GPU work runs in another process)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def main() -> None:
    check_usage(__doc__, 2)
    args = [arg for arg in sys.argv[1:] if arg != "--matched-vocab"]
    matched = len(args) < len(sys.argv) - 1
    engine, shape = args[0], args[1]
    names = args[2:] or [name for name in VARIANTS if name not in TOKENIZER_VARIANTS]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"workload_bench: unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    mod = importlib.import_module(engine)
    LLM, SamplingParams = mod.LLM, mod.SamplingParams
    kwargs = dict(skip_tokenizer_init=True)
    if TOKENIZER_VARIANTS.intersection(names):
        structured_outputs_class(mod)  # fail now, not after the other variants ran
        kwargs = dict(tokenizer=bench_tokenizer(), skip_tokenizer_init=False)
        if _is_vllm(mod):  # compact JSON, as tokenmill compiles it (module docstring)
            kwargs["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    folder, vocab_size = model_dir(shape, False), None
    if matched:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(bench_tokenizer())
        folder, vocab_size = matched_vocab_dir(shape, tokenizer), len(tokenizer)
    start = time.time()
    llm = LLM(model=folder, load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.9, seed=0, **kwargs)
    init_s = time.time() - start
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    prompts, outs = chat_workload()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for name in names:
        results = None  # the last variant's outputs, before this one allocates its own
        gc.collect()
        settings = chat_settings(name)
        params = [SamplingParams(**per_request(engine_settings(mod, settings), o), ignore_eos=True, max_tokens=o,
                                 detokenize=False) for o in outs]
        if not llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: a variant would reuse the last one's prompts")
        full_collections, retries = gc.get_stats()[2]["collections"], _alloc_retries()
        start = time.time()
        results = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.time() - start
        # Two host stalls a variant could meet and another not (docs/perf.md 54): full garbage
        # collections, and CUDA allocations that had to free the cache and retry (a device sync).
        full_collections = gc.get_stats()[2]["collections"] - full_collections
        retries = None if retries is None else _alloc_retries() - retries
        got = sum(len(r.outputs[0].token_ids) for r in results)
        row = dict(engine=engine, version=getattr(mod, "__version__", "?"), shape=shape, workload=f"chat-{name}",
                   seqs=len(prompts), in_tokens=sum(map(len, prompts)), out_tokens=sum(outs), got_tokens=got,
                   seconds=round(seconds, 2), out_tok_s=round(sum(outs) / seconds, 1), init_s=round(init_s, 1),
                   full_collections=full_collections, alloc_retries=retries)
        if not kwargs["skip_tokenizer_init"]:
            row["tokenizer"] = True  # this run's engine had the bench tokenizer (every variant of it, json or not)
        if vocab_size is not None:
            row["vocab_size"] = vocab_size  # --matched-vocab
        emit(row)
        if got < row["out_tokens"]:
            print(f"WARNING: chat-{name}: {got} of {row['out_tokens']} output tokens: some requests stopped before "
                  "max_tokens, so this row did less work than the others", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
