"""Host cost of two request kinds that generate_host_bench.py's workloads do not reach, with the
model stubbed as there (forward zeros, cached logits, a stand-in sampler): no GPU, no model
arithmetic, the engine's own Python.

    python bench/host_paths_bench.py beam [--width 4] [--tokens 128] [--detokenize]
    python bench/host_paths_bench.py score [--flat] [--detokenize]

beam:  LLM.beam_search over 256 prompts of U[32, 256] token ids, ``--tokens`` new tokens a beam;
       the stand-in sampler's top-K (ids and falling logprobs) are reshuffled every step, so forks
       and finished beams come and go as in a real search. Figure: µs of host a beam-token.
       ``--detokenize``: with the bench tokenizer, so texts and the logprob entries' tokens are
       decoded, as a user's search has them.
score: LLM.generate over 1,024 prompts of U[64, 512] token ids with prompt_logprobs=1 and one token
       out, detokenize=False (lm-eval's loglikelihood request); a vocabulary of 1,024 keeps the
       CPU's own log-softmax table small. Figure: µs a prompt position spent reading the scored
       positions into the requests' prompt logprobs (``OutputProcessor.record_prompt_logprobs``,
       timed alone), and the call's wall time a position. ``--flat``: flat_logprobs=True.
       ``--detokenize``: detokenize=True, each position's token decoded (as `tokenmill run` rows
       asking for prompt logprobs have it), with the bench tokenizer (.bench_tokenizer/), the prompts
       drawn from the ids that decode alone to whole characters, as text's tokens nearly all do (the
       others' logits set low, so no top alternative is one either).

Prints one JSON row and appends it to $RESULTS when set.
"""

from __future__ import annotations

import argparse
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
from generate_host_bench import CONFIG, _StubSampler  # noqa: E402
from result_row import emit  # noqa: E402
from workload_bench import bench_tokenizer  # noqa: E402


def stub_llm(vocab: int, logit_rows: int, tokenizer: bool = False):
    """The engine on a tiny dummy model whose forward, logits and (for beams) sampler are stand-ins;
    ``tokenizer``: with the bench tokenizer (the model's vocabulary stays ``vocab``, its first ids)."""
    from tokenmill import LLM

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(dict(CONFIG, vocab_size=vocab)))
        if tokenizer:
            for path in Path(bench_tokenizer()).iterdir():
                shutil.copy(path, folder)
        llm = LLM(folder, load_format="dummy", dtype="float32", device="cpu", max_model_len=4096, seed=0,
                  skip_tokenizer_init=not tokenizer, max_num_batched_tokens=16384, max_num_seqs=1024)
    runner = llm.llm_engine.executor.runner
    logits = torch.randn(logit_rows, vocab)
    runner.model.forward = lambda ids, positions, ctx, **kw: torch.zeros(ids.shape[0], CONFIG["hidden_size"])
    runner.model.compute_logits = lambda hidden: logits[: hidden.shape[0]]
    return llm


class _ShuffledTopK(_StubSampler):
    """The stand-in sampler with its rows' top-K reshuffled every step: other candidates each time."""

    def __call__(self, step_logits, batch):
        order = torch.randperm(self.top_ids.shape[0])
        self.top_ids, self.top_logprobs = self.top_ids[order], self.top_logprobs[order]
        return super().__call__(step_logits, batch)


def beam(width: int, tokens: int, tokenizer: bool) -> dict:
    from tokenmill.sampling_params import BeamSearchParams

    llm = stub_llm(CONFIG["vocab_size"], 4096, tokenizer=tokenizer)
    llm.llm_engine.executor.runner.sampler = _ShuffledTopK(torch.randint(0, CONFIG["vocab_size"], (4096,)))
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.randint(2, 1000) for _ in range(random.randint(32, 256))]} for _ in range(256)]
    llm.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    return dict(workload="beam", width=width, tokens=tokens, tokenizer=tokenizer, seqs=len(prompts), seconds=round(seconds, 3),
                us_per_beam_token=round(seconds / (len(prompts) * width * tokens) * 1e6, 2))


def score(flat: bool, detokenize: bool) -> dict:
    from tokenmill import SamplingParams
    from tokenmill.engine.output_processor import OutputProcessor

    vocab = 1024
    llm = stub_llm(vocab, 16384, tokenizer=detokenize)
    ids = list(range(vocab))
    if detokenize:  # text's tokens: the ids that decode alone to whole characters (not single bytes of one)
        tokenizer = llm.get_tokenizer()
        ids = [i for i in ids if not tokenizer.decode([i]).endswith("\ufffd")]
        table = llm.llm_engine.executor.runner.model.compute_logits(torch.empty(16384, 1))  # the stub's table itself
        table[:, sorted(set(range(vocab)) - set(ids))] = -1e4  # nor any top alternative a single byte
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.choice(ids) for _ in range(random.randint(64, 512))]} for _ in range(1024)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=detokenize, flat_logprobs=flat)
    llm.generate(prompts[:4], params, use_tqdm=False)
    spent = [0.0]
    record = OutputProcessor.record_prompt_logprobs

    def timed(self, result):
        begin = time.perf_counter()
        record(self, result)
        spent[0] += time.perf_counter() - begin

    OutputProcessor.record_prompt_logprobs = timed  # type: ignore[method-assign]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    OutputProcessor.record_prompt_logprobs = record  # type: ignore[method-assign]
    positions = sum(len(o.prompt_logprobs) - 1 for o in outputs)
    return dict(workload="score", flat=flat, detokenize=detokenize, seqs=len(prompts), positions=positions, seconds=round(seconds, 3),
                us_per_position=round(seconds / positions * 1e6, 2),
                record_us_per_position=round(spent[0] / positions * 1e6, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["beam", "score"])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("--detokenize", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    row = beam(args.width, args.tokens, args.detokenize) if args.kind == "beam" else score(args.flat, args.detokenize)
    emit(dict(bench="host_paths", **row))


if __name__ == "__main__":
    main()
