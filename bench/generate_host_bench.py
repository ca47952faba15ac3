"""Host cost per sequence-step of LLM.generate: the engine's own work (scheduling, building each
step's inputs and sampling tensors, reading back and bookkeeping), with the model's forward,
logits and draw replaced by trivial stand-ins (so neither the CPU's matmuls and sampling nor a GPU
are measured).

On the H200 the host is as busy as the GPU at 256 sequences a step (P1, docs/perf.md entry 14) and
the busier of the two from ~500 (P2's 1,024 and P4's 768 sequences): every microsecond per
sequence-step here is about ``sequences`` microseconds of step time there. Runs on the CPU with a tiny
Qwen3-shaped config (vocabulary 10,240: the protocols' token ids stay below 10,001) on the chosen
protocol's requests (bench/peer_bench.py's workloads). Stubbed: the forward (zeros), the logits (one
cached random tensor), the sampler (token ids taken from a cached random tensor and, for requests
asking for logprobs, logprob tensors of the real SamplerOutput's shapes: on the GPU its kernels'
host cost is the launches, timed by bench/sampler_bench.py); everything else is the real engine,
asynchronous scheduling's bookkeeping and the logprobs' read-back and output objects included.

    python bench/generate_host_bench.py [nano|uniform|sampling|prefill|chat|refill-short|refill-long] [--variant NAME] [--job] [--profile]

--job runs the same requests as the rows of a JSONL file through `tokenmill run`'s loop
(`batch.job.run_job` over the loaded engine; progress off, output written as the job writes it),
so its figure is the batch job's host cost per sequence-step beside generate's.

refill-short / refill-long are bench/refill_bench.py's (more requests than max_num_seqs). chat is bench/workload_bench.py's workload; --variant takes its sampling settings (temperature,
top_p, repetition, ...: workload_bench.VARIANTS, at temperature 0.7) instead of the workload's own.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.engine.step import SamplerOutput
    from tokenmill.worker.sampler import SamplingBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer_bench import workload  # noqa: E402
from refill_bench import refill_workload  # noqa: E402
from workload_bench import VARIANTS, chat_settings, chat_workload  # noqa: E402

VOCAB = 10240
CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
              rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", nargs="?", default="sampling", choices=["nano", "uniform", "sampling", "prefill", "chat", "refill-short", "refill-long"])
    parser.add_argument("--variant", choices=list(VARIANTS), help="the chat workload's settings of that name")
    parser.add_argument("--job", action="store_true", help="through the batch job's loop instead of LLM.generate")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions by own time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tokenmill import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(CONFIG))
        # The protocols' GPU settings: a 16,384-token budget and up to 1,024 sequences a step.
        llm = LLM(folder, load_format="dummy", dtype="float32", device="cpu", max_model_len=4096, seed=0,
                  skip_tokenizer_init=True, max_num_batched_tokens=16384, max_num_seqs=1024)
    runner = llm.llm_engine.executor.runner
    hidden = CONFIG["hidden_size"]
    logits = torch.randn(1024, VOCAB)
    draws = torch.randint(0, VOCAB, (1024,))
    runner.model.forward = lambda ids, positions, ctx, **kw: torch.zeros(ids.shape[0], hidden)
    runner.model.compute_logits = lambda h: logits[: h.shape[0]]
    runner.sampler = _StubSampler(draws)

    if args.workload == "chat":
        (prompts, outs), settings = chat_workload(), chat_settings("temperature")
    elif args.workload.startswith("refill-"):
        prompts, outs, settings = refill_workload(args.workload.split("-", 1)[1])
    else:
        prompts, outs, settings = workload(args.workload)
    if args.variant is not None:
        settings = chat_settings(args.variant)
    params = [SamplingParams(**settings, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:4], params[:4], use_tqdm=False)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    start, cpu_start = time.perf_counter(), time.process_time()
    if args.job:
        _run_as_job(llm, dict(settings, ignore_eos=True, detokenize=False), prompts, outs)
    else:
        llm.generate(inputs, params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    gc.callbacks.remove(pauses)
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    sequence_steps = sum(outs)  # one sampled token per sequence-step (prefill chunks add a few more steps)
    print(json.dumps({"bench": "generate_host", "via": "job" if args.job else "generate", "workload": args.workload, "variant": args.variant, "seqs": len(prompts),
                      "out_tokens": sequence_steps, "seconds": round(seconds, 3),
                      "us_per_sequence_step": round(seconds / sequence_steps * 1e6, 2),
                      # CPU time: steadier than wall time on a shared machine (torch runs one thread)
                      "cpu_us_per_sequence_step": round(cpu_seconds / sequence_steps * 1e6, 2), "profiled": args.profile,
                      # The interpreter's collections during the call: a full one stops the host for as
                      # long as it takes to walk every tracked object (the GPU idles meanwhile).
                      "gc_full_collections": pauses.full, "gc_longest_pause_ms": round(pauses.longest * 1e3, 2),
                      "gc_pause_ms": round(pauses.total * 1e3, 2)}))


def _run_as_job(llm: object, sampling: dict, prompts: list[list[int]], outs: list[int]) -> None:
    """The requests as JSONL rows (token ids, each row's max_tokens) through the batch job's loop."""
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.job import run_job

    with tempfile.TemporaryDirectory() as folder:
        rows = Path(folder) / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt_token_ids": p, "sampling_params": {"max_tokens": o}}) + "\n"
                                for p, o in zip(prompts, outs)))
        config = JobConfig(input=str(rows), output=str(Path(folder) / "out.jsonl"), model="stub", sampling=sampling,
                           progress=False)
        summary = run_job(config, llm=llm)
        if summary.failed or summary.rows_done != len(prompts):
            raise SystemExit(f"generate_host_bench: {summary.failed} of {summary.rows_done} rows failed in the job")


class _StubSampler:
    """The sampler's stand-in: cached random token ids and, when a row asks for logprobs
    (``batch.max_num_logprobs >= 0``), tensors shaped as the real `SamplerOutput`'s (the sampled
    tokens' float32 logprobs and int64 ranks [N]; for k >= 1 the top ids int64 and logprobs float32
    [N, k]), so the host's read-back and logprob bookkeeping are the engine's own. As at
    temperature 0.7, about half the rows drew their top-1 (rank 1, listed first among the top ones)."""

    def __init__(self, draws: torch.Tensor) -> None:
        rows = draws.shape[0]
        generator = torch.Generator().manual_seed(1)
        self.draws = draws
        self.logprobs = -torch.rand(rows, generator=generator) * 3
        self.ranks = torch.where(torch.rand(rows, generator=generator) < 0.5, 1,
                                 torch.randint(2, 20, (rows,), generator=generator))
        self.top_ids = torch.randint(0, VOCAB, (rows, 20), generator=generator)
        self.top_ids[:, 0] = torch.where(self.ranks == 1, draws, self.top_ids[:, 0])
        self.top_logprobs = -torch.rand(rows, 20, generator=generator).cumsum(dim=1)

    def __call__(self, step_logits: torch.Tensor, batch: "SamplingBatch") -> "SamplerOutput":
        from tokenmill.engine.step import SamplerOutput

        n, k = step_logits.shape[0], batch.max_num_logprobs
        if k < 0:
            return SamplerOutput(self.draws[:n].clone())
        top = (self.top_ids[:n, :k].clone(), self.top_logprobs[:n, :k].clone()) if k > 0 else (None, None)
        return SamplerOutput(self.draws[:n].clone(), self.logprobs[:n].clone(), self.ranks[:n].clone(), *top)


class _GcPauses:
    """A ``gc.callbacks`` hook: how many full (generation 2) collections ran, the longest pause, the sum."""

    def __init__(self) -> None:
        self.full, self.longest, self.total, self._start = 0, 0.0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        self.full += info["generation"] == 2
        self.longest, self.total = max(self.longest, took), self.total + took


if __name__ == "__main__":
    main()
