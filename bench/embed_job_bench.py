"""An embedding job (`tokenmill run --task embed`'s loop) beside `LLM.embed` on P6's inputs, one
process, one engine, alternating (gpu_suite part `job-embed`; docs/perf.md 106).

    python bench/embed_job_bench.py [SHAPE ...] [--rounds N]     SHAPE: qwen3-embed-0.6b | bert-minilm (both)

embed_bench.py's model and inputs (random weights, token-id rows: 16,384 of U[8,384] / 65,536 of
U[8,128] tokens); the job reads them as JSONL rows and writes its JSONL output and journal under
/tmp with the CLI's defaults off a terminal. The difference is what the job adds to each row: its
loop, the request it builds, the vector written as a JSON line. Prints a JSON row per run (``via``:
embed or job; input tokens/s) and appends it to $RESULTS when that is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from random import randint, seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed_bench import SHAPES, model_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # No choices= here: argparse checks a nargs="*" default against them as one value and refuses it.
    parser.add_argument("shapes", nargs="*", default=list(SHAPES), help=f"any of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    from tokenmill import LLM

    for shape in args.shapes:
        _, count, longest = SHAPES[shape]
        llm = LLM(model=model_dir(shape), runner="pooling", load_format="dummy", dtype="bfloat16", max_model_len=512,
                  gpu_memory_utilization=0.9, seed=0)
        seed(0)
        inputs = [[randint(2, 10000) for _ in range(randint(8, longest))] for _ in range(count)]
        tokens = sum(map(len, inputs))
        llm.embed([{"prompt_token_ids": ids} for ids in inputs[:64]], use_tqdm=False)
        for round_ in range(args.rounds):
            for via in ("embed", "job"):
                seconds = _run(via, llm, inputs)
                row = dict(engine="tokenmill", shape=shape, workload="embed", via=via, round=round_ + 1, inputs=count,
                           in_tokens=tokens, seconds=round(seconds, 3), in_tok_s=round(tokens / seconds, 1))
                print(json.dumps(row), flush=True)
                if os.environ.get("RESULTS"):
                    with open(os.environ["RESULTS"], "a") as f:
                        f.write(json.dumps(row) + "\n")
        del llm


def _run(via: str, llm: object, inputs: list[list[int]]) -> float:
    """Wall seconds of one run; raises if a row is missing or failed."""
    if via == "embed":
        start = time.time()
        out = llm.embed([{"prompt_token_ids": ids} for ids in inputs], use_tqdm=False)
        seconds = time.time() - start
        if len(out) != len(inputs):
            raise SystemExit(f"embed_job_bench: embed gave {len(out)} outputs for {len(inputs)} inputs")
        return seconds
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.job import run_job

    with tempfile.TemporaryDirectory() as folder:
        rows = Path(folder) / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in inputs))
        output = Path(folder) / "out.jsonl"
        config = JobConfig(input=str(rows), output=str(output), model="embed_bench", task="embed", progress=False)
        start = time.time()
        summary = run_job(config, llm=llm)
        seconds = time.time() - start
        written = sum(1 for _ in output.open())
    if summary.failed or written != len(inputs):
        raise SystemExit(f"embed_job_bench: the job wrote {written} rows for {len(inputs)}, {summary.failed} failed")
    return seconds


if __name__ == "__main__":
    main()
