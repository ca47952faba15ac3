"""The batch job's throughput: peer_bench's workloads through `tokenmill run`'s loop beside
LLM.generate on the same engine, in one process (gpu_suite part `job`).

    python bench/job_bench.py SHAPE WORKLOAD [WORKLOAD ...] [--rounds N]

WORKLOAD: peer_bench's (nano, uniform, big, sampling, prefill: token ids, no tokenizer), or
short-text / short-chat / score-text (their own invocation): rows_host_bench.py's 8,192 prompts of
20-80 words as text or as one-turn conversations, 16 tokens out, on the shape with the bench
tokenizer's vocabulary (.bench_tokenizer/), through generate / chat beside the job: a row's own host
work (tokenizing, rendering, building, writing) against the GPU's short share of it; score-text:
8,192 texts of 64-512 words scored (prompt_logprobs=0, one greedy token out, the text decoded), a
perplexity-filtering job, whose rows carry every prompt token's logprob.

Each workload runs as generate, then as a job, ``--rounds`` times (default 2), alternating. The job
reads the requests as JSONL rows (token ids, each row's ``max_tokens`` in its ``sampling_params``,
the workload's settings job-wide) and writes its output JSONL and journal under /tmp, with the
CLI's defaults off a terminal: an fsync a second, a progress line every 10 s (to stderr). Both
ways run peer_bench's engine (random weights, no tokenizer, eos ignored), so the difference is
what the job adds: its loop, its per-row seeds, its outputs written as rows finish. Prints a JSON
row per run (``via``: generate or job) and appends it to $RESULTS when that is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_bench import model_dir, workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=["qwen3-0.6b", "llama3-8b"])
    parser.add_argument("workloads", nargs="+", choices=["nano", "uniform", "big", "sampling", "prefill", *SHORT])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from tokenmill import LLM, SamplingParams, __version__

    short = [name for name in args.workloads if name in SHORT]
    if short and len(short) < len(args.workloads):
        raise SystemExit("job_bench: short-text / short-chat / score-text run in an invocation of their own (the bench tokenizer's vocabulary)")
    start = time.time()
    if short:
        from transformers import AutoTokenizer
        from workload_bench import bench_tokenizer, matched_vocab_dir

        folder = matched_vocab_dir(args.shape, AutoTokenizer.from_pretrained(bench_tokenizer()))
        llm = LLM(model=folder, tokenizer=bench_tokenizer(), load_format="dummy", max_model_len=4096,
                  gpu_memory_utilization=0.9, seed=0)
    else:
        llm = LLM(model=model_dir(args.shape, False), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                  gpu_memory_utilization=0.9, seed=0)
    init_s = time.time() - start
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    for name in args.workloads:
        prompts, outs, settings = _short_workload(name) if name in SHORT else workload(name)
        for _ in range(args.rounds):
            for via in ("generate", "job"):
                seconds = _run(via, llm, SamplingParams, prompts, outs, settings)
                row = dict(engine="tokenmill", version=__version__, shape=args.shape, workload=name, via=via,
                           seqs=len(prompts), out_tokens=sum(outs), seconds=round(seconds, 2),
                           out_tok_s=round(sum(outs) / seconds, 1), rows_s=round(len(prompts) / seconds, 1),
                           init_s=round(init_s, 1))
                if name not in SHORT:
                    row["in_tokens"] = sum(map(len, prompts))
                print(json.dumps(row), flush=True)
                if os.environ.get("RESULTS"):
                    with open(os.environ["RESULTS"], "a") as f:
                        f.write(json.dumps(row) + "\n")


SHORT = ("short-text", "short-chat", "score-text")


def _short_workload(name: str) -> tuple[list, list[int], dict]:
    """rows_host_bench.py's prompts, 8,192 of them: texts, or one-turn conversations."""
    import random

    from rows_host_bench import SAMPLING, WORDS

    rng = random.Random(0)
    if name == "score-text":
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(64, 512))) for _ in range(8192)]
        return texts, [1] * len(texts), {"temperature": 0.0, "prompt_logprobs": 0}
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) for _ in range(8192)]
    prompts = [[{"role": "user", "content": t}] for t in texts] if name == "short-chat" else texts
    settings = {k: v for k, v in SAMPLING.items() if k not in ("max_tokens", "ignore_eos")}
    return prompts, [SAMPLING["max_tokens"]] * len(prompts), settings


def _row(prompt: object, out: int) -> dict:
    """A job row: token ids, text or a conversation, with its own max_tokens."""
    key = "prompt_token_ids" if isinstance(prompt, list) and isinstance(prompt[0], int) else \
        "messages" if isinstance(prompt, list) else "prompt"
    return {key: prompt, "sampling_params": {"max_tokens": out}}


def _run(via: str, llm: object, sampling_params: type, prompts: list, outs: list[int], settings: dict) -> float:
    """Wall seconds of one run; raises if a token or a row is missing."""
    from rows_host_bench import TEMPLATE

    chat = isinstance(prompts[0], list) and isinstance(prompts[0][0], dict)
    # Token-id workloads run without a tokenizer; text and chat ones detokenize, as a real job does.
    detokenize = chat or isinstance(prompts[0], str)
    if via == "generate":
        params = [sampling_params(ignore_eos=True, max_tokens=o, detokenize=detokenize, **settings) for o in outs]
        start = time.time()
        if chat:
            results = llm.chat(prompts, params, use_tqdm=False, chat_template=TEMPLATE)
        else:
            results = llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
        seconds = time.time() - start
        got = sum(len(r.outputs[0].token_ids) for r in results)
    else:
        from tokenmill.batch.config import JobConfig
        from tokenmill.batch.job import run_job

        with tempfile.TemporaryDirectory() as folder:
            rows = Path(folder) / "rows.jsonl"
            rows.write_text("".join(json.dumps(_row(p, o)) + "\n" for p, o in zip(prompts, outs)))
            output = Path(folder) / "out.jsonl"
            config = JobConfig(input=str(rows), output=str(output), model="peer_bench", chat_template=TEMPLATE,
                               sampling=dict(settings, ignore_eos=True, detokenize=detokenize))
            start = time.time()
            summary = run_job(config, llm=llm)
            seconds = time.time() - start
            got = sum(json.loads(line)["completion_tokens"] for line in output.open())
            if summary.failed:
                raise SystemExit(f"job_bench: {summary.failed} rows failed")
    if got != sum(outs):
        raise SystemExit(f"job_bench: {via} gave {got} tokens, {sum(outs)} asked")
    return seconds


if __name__ == "__main__":
    main()
