"""Small-batch decode on the Llama-3-8B shape: 32 sequences of 512 prompt tokens, 512 greedy output
tokens each (eos ignored), bf16 weights against quantized ones (issue 18's target: W4A16 >= 2x the
bf16 output tok/s). Random weights: ``load_format="dummy"``; for W4A16 the model folder's
config.json carries a GPTQ quantization_config (4-bit, group 128, symmetric), so the dummy loader
draws random packed codes and scales. One variant per process (each takes most of the GPU):
    python bench/quant_decode_bench.py bf16|w4a16|fp8 [sequences, default 32: workload "decode<sequences>"]
Prints one JSON row (peer_bench.py's fields) and appends it to $RESULTS when set."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from random import randint, seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_bench import model_dir  # noqa: E402
from result_row import emit  # noqa: E402

GPTQ_W4A16 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    if variant not in ("bf16", "w4a16", "fp8"):
        raise SystemExit(f"variant {variant!r}: one of bf16, w4a16, fp8")
    seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    from tokenmill import LLM, SamplingParams, __version__

    folder = model_dir("llama3-8b", False)
    kwargs = {}
    if variant == "w4a16":
        quantized = folder + "-w4a16"
        if not os.path.exists(os.path.join(quantized, "config.json")):
            shutil.copytree(folder, quantized, dirs_exist_ok=True)
            config = json.loads(Path(quantized, "config.json").read_text())
            Path(quantized, "config.json").write_text(json.dumps({**config, "quantization_config": GPTQ_W4A16}))
        folder = quantized
    elif variant == "fp8":
        kwargs["quantization"] = "fp8"
    start = time.time()
    llm = LLM(model=folder, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              gpu_memory_utilization=0.9, seed=0, **kwargs)
    init_s = time.time() - start
    warm = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, warm, use_tqdm=False)
    seed(0)
    prompts = [{"prompt_token_ids": [randint(0, 10000) for _ in range(512)]} for _ in range(seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True, detokenize=False)
    start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.time() - start
    got = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = dict(engine=f"tokenmill_{variant}", version=__version__, shape="llama3-8b", workload=f"decode{seqs}",
               seqs=seqs, in_tokens=seqs * 512, out_tokens=seqs * 512, got_tokens=got, seconds=round(seconds, 2),
               out_tok_s=round(seqs * 512 / seconds, 1), init_s=round(init_s, 1))
    emit(row)


if __name__ == "__main__":
    main()
