"""Host cost per row of short requests: text or chat prompts of 20-80 words, 16 tokens out, through
LLM.generate / LLM.chat or through `tokenmill run`'s loop (the rows as JSONL, progress off), with
the model's forward, logits and draw stubbed as in generate_host_bench.py. Where outputs are short,
a row's own host work (its prompt tokenized or its conversation rendered, its request built and
checked, its result written) is most of the host's time and can outlast the GPU's share of the
row; this measures it. Needs the bench tokenizer (.bench_tokenizer/, or $BENCH_TOKENIZER); chat
prompts use a ChatML template.

    python bench/rows_host_bench.py [text|chat] [--job] [--rows 2048] [--logprobs K]

``--logprobs K``: every sampled token's logprob and K alternatives, with their decoded tokens
(``detokenize`` stays on, as a user's request has it).

Prints one JSON row (µs per row, and the garbage collector's work inside the timed call) and
appends it to $RESULTS when set.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate_host_bench import _StubSampler  # noqa: E402
from result_row import emit  # noqa: E402
from workload_bench import bench_tokenizer  # noqa: E402

VOCAB = 49152  # the bench tokenizer's (SmolLM2's)
CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
              rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the quick brown fox jumps over lazy dogs while wind blows across open fields of golden wheat".split()
SAMPLING = dict(temperature=0.7, max_tokens=16, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="?", default="text", choices=["text", "chat"])
    parser.add_argument("--job", action="store_true", help="through the batch job's loop instead of LLM.generate / chat")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--logprobs", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tokenmill import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(CONFIG))
        for path in Path(bench_tokenizer()).iterdir():
            shutil.copy(path, folder)
        llm = LLM(folder, load_format="dummy", dtype="float32", device="cpu", max_model_len=4096, seed=0,
                  max_num_batched_tokens=16384, max_num_seqs=256)
    runner = llm.llm_engine.executor.runner
    logits = torch.randn(1024, VOCAB)
    runner.model.forward = lambda ids, positions, ctx, **kw: torch.zeros(ids.shape[0], CONFIG["hidden_size"])
    runner.model.compute_logits = lambda h: logits[: h.shape[0]]
    runner.sampler = _StubSampler(torch.randint(100, 10_000, (1024,)))
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) for _ in range(args.rows)]
    conversations = [[{"role": "user", "content": text}] for text in texts]
    sampling = dict(SAMPLING, logprobs=args.logprobs) if args.logprobs is not None else SAMPLING
    llm.generate(texts[:4], SamplingParams(**sampling), use_tqdm=False)
    with tempfile.TemporaryDirectory() as folder:
        rows = Path(folder) / "rows.jsonl"
        rows.write_text("".join(json.dumps({"messages": c} if args.prompts == "chat" else {"prompt": t}) + "\n"
                                for t, c in zip(texts, conversations)))
        pauses = _Collections()
        gc.callbacks.append(pauses)
        start = time.perf_counter()
        if args.job:
            from tokenmill.batch.config import JobConfig
            from tokenmill.batch.job import run_job

            summary = run_job(JobConfig(input=str(rows), output=str(Path(folder) / "out.jsonl"), model="stub",
                                        sampling=sampling, progress=False, chat_template=TEMPLATE), llm=llm)
            if summary.failed:
                raise SystemExit(f"rows_host_bench: {summary.failed} rows failed")
        elif args.prompts == "chat":
            llm.chat(conversations, SamplingParams(**sampling), use_tqdm=False, chat_template=TEMPLATE)
        else:
            llm.generate(texts, SamplingParams(**sampling), use_tqdm=False)
        seconds = time.perf_counter() - start
        gc.callbacks.remove(pauses)
    emit(dict(bench="rows_host", prompts=args.prompts, via="job" if args.job else "llm", rows=args.rows, logprobs=args.logprobs,
              out_tokens=args.rows * SAMPLING["max_tokens"], seconds=round(seconds, 3),
              us_per_row=round(seconds / args.rows * 1e6, 1), gc_by_generation=pauses.count,
              gc_ms_by_generation=[round(t * 1e3, 1) for t in pauses.seconds]))


class _Collections:
    """A ``gc.callbacks`` hook: collections and their pauses by generation."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


if __name__ == "__main__":
    main()
