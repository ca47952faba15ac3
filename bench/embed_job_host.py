"""Host cost per row of an embedding job (``tokenmill run --task embed``), the model's forward
replaced by a fixed random buffer of the right shape (so the vectors are formatted as real ones are,
and neither the CPU's matmuls nor a GPU are measured).

A GPU runs P6's BERT shape in ~3 s for 65,536 texts (~45 us a text), so the job's own work per
row (reading it, tokenizing, building the request, turning the vector into a JSON line, the journal)
decides how an embedding job compares with ``LLM.embed``. Runs on the CPU with the tiny BERT of
``pooling_host_bench.py`` (MiniLM's width, 384, and its real tokenizer): a warm-up job of 2,000
rows, then the measured job of ``--rows`` texts of U[6, 100] words into JSONL, both in this process.
``--ids`` writes token-id rows of U[8, 128] tokens instead (P6's BERT inputs, as
``embed_job_bench.py`` feeds them on a GPU: no tokenizer in the row's cost). ``--profile`` prints
cProfile's top functions of the measured job (``SORT=cumtime TOP=70`` in the environment: another
order, more rows; default tottime, 20).

    python bench/embed_job_host.py [--rows 20000] [--ids] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from random import randint, seed

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from pooling_host_bench import SHAPES, _copy_minilm_tokenizer, _ZeroForward  # noqa: E402


class _RandomForward(_ZeroForward):
    """A fixed random buffer instead of zeros: a vector of zeros formats as short "0.0"s."""

    def __init__(self, config, hidden: int, max_tokens: int):
        super().__init__(config, hidden, max_tokens)
        self.zeros = torch.randn(max_tokens, hidden, generator=torch.Generator().manual_seed(0))


def _stub_the_forward() -> None:
    from tokenmill.pooling import runner

    made = runner.PoolingRunner.__init__

    def init(self, model, device, pooling):
        made(self, model, device, pooling)
        self.model = _RandomForward(model.config, model.config.hidden_size, 65536)

    runner.PoolingRunner.__init__ = init


def _run(folder: Path, rows: Path, out: Path, ids: bool) -> None:
    from tokenmill.cli import main

    args = ["run", str(rows), *([] if ids else ["--text-field", "text"]), "-o", str(out), "--task", "embed", "--model", str(folder),
            "--device", "cpu", "--load-format", "dummy", "--dtype", "float32", "--max-num-batched-tokens", "65536",
            "--max-num-seqs", "65536"]
    try:
        main(args)
    except SystemExit as done:
        if done.code not in (0, None):
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--ids", action="store_true", help="token-id rows of U[8, 128] tokens instead of texts")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _stub_the_forward()
    config, _ = SHAPES["bert"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        words = _copy_minilm_tokenizer(folder)
        seed(0)
        for name, count in (("warm", 2000), ("rows", args.rows)):
            with open(folder / f"{name}.jsonl", "w") as f:
                for i in range(count):
                    if args.ids:
                        row = {"id": i, "prompt_token_ids": [randint(2, 10000) for _ in range(randint(8, 128))]}
                    else:
                        row = {"id": i, "text": " ".join(words[randint(0, len(words) - 1)] for _ in range(randint(6, 100)))}
                    f.write(json.dumps(row) + "\n")
        _run(folder, folder / "warm.jsonl", folder / "warm.out.jsonl", args.ids)
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        _run(folder, folder / "rows.jsonl", folder / "rows.out.jsonl", args.ids)
        seconds = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "20")))
        size = (folder / "rows.out.jsonl").stat().st_size
    print(json.dumps({"bench": "embed_job_host", "rows": args.rows, "hidden": config["hidden_size"], "seconds": round(seconds, 3),
                      "us_per_row": round(seconds / args.rows * 1e6, 1), "output_bytes_per_row": round(size / args.rows),
                      "rows_of": "token ids" if args.ids else "texts", "profiled": args.profile}))


if __name__ == "__main__":
    main()
