"""peer_bench.py's workloads with LoRA adapters, for any engine with vLLM's offline API (tokenmill
or vllm): random weights with a real shape, random rank-16 adapters on all seven projections of
every layer (PEFT folders written here), eos ignored.

    python bench/lora_bench.py ENGINE SHAPE MODE WORKLOAD [WORKLOAD ...]

MODE: ``base`` (enable_lora off: the yardstick), ``lora-none`` (enable_lora=True, max_loras=4, no
request names an adapter: what enabling LoRA costs), ``lora-1`` (every request with one adapter) and
``lora-4`` (requests spread over four adapters, max_loras=4). WORKLOAD: peer_bench's, or
refill_bench's as ``refill-short`` / ``refill-long`` (more requests than run at once: prompts
admitted beside running decodes every step). Rows go to stdout and to $RESULTS.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_usage import check_usage  # noqa: E402
import peer_bench  # noqa: E402

RANK = 16
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def adapter_dir(shape: str, index: int) -> str:
    """A random PEFT LoRA folder for ``shape`` (rank 16, alpha 32, every projection of every layer)."""
    import torch
    from safetensors.torch import save_file

    folder = Path(f"/tmp/models/{shape}-lora{index}")
    if (folder / "adapter_config.json").exists():
        return str(folder)
    c = peer_bench.CONFIGS[shape]
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(index)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for module in PROJECTIONS:
            fan_in, fan_out = shapes[module.split(".")[1]]
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(RANK, fan_in, generator=gen) * 0.01).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(fan_out, RANK, generator=gen) * 0.01).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                  target_modules=[m.split(".")[1] for m in PROJECTIONS], bias="none", modules_to_save=None,
                  use_dora=False, use_rslora=False, fan_in_fan_out=False, base_model_name_or_path=peer_bench.model_dir(shape, False))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def main() -> None:
    check_usage(__doc__, 3)
    engine, shape, mode, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    mod = importlib.import_module(engine)
    LoRARequest = importlib.import_module(f"{engine}.lora.request").LoRARequest
    count = {"base": 0, "lora-none": 0, "lora-1": 1, "lora-4": 4}[mode]
    adapters = [LoRARequest(f"adapter{i}", i + 1, adapter_dir(shape, i)) for i in range(count)]
    max_loras = {"base": 0, "lora-none": 4, "lora-1": 1, "lora-4": 4}[mode]
    lora = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=RANK) if max_loras else {}
    start = time.time()
    llm = mod.LLM(model=peer_bench.model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=4096, gpu_memory_utilization=0.9, seed=0, **lora)
    init_s = time.time() - start
    warm = [{"prompt_token_ids": [1, 2, 3, 4]}] * 4
    llm.generate(warm, mod.SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False,
                 lora_request=[adapters[i % count] for i in range(4)] if count else None)
    for name in names:
        prompts, outs, settings = _workload(name)
        params = [mod.SamplingParams(ignore_eos=True, max_tokens=o, detokenize=False, **settings) for o in outs]
        requests = [adapters[i % count] for i in range(len(prompts))] if count else None
        t = time.time()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=requests)
        seconds = time.time() - t
        got = sum(len(r.outputs[0].token_ids) for r in results)
        row = dict(engine=engine, version=getattr(mod, "__version__", "?"), shape=shape, workload=name, lora=mode,
                   seqs=len(prompts), out_tokens=sum(outs), got_tokens=got, seconds=round(seconds, 2),
                   out_tok_s=round(sum(outs) / seconds, 1), init_s=round(init_s, 1))
        print(json.dumps(row), flush=True)
        if os.environ.get("RESULTS"):
            with open(os.environ["RESULTS"], "a") as f:
                f.write(json.dumps(row) + "\n")


def _workload(name: str) -> tuple[list[list[int]], list[int], dict]:
    if name.startswith("refill-"):
        from refill_bench import refill_workload

        return refill_workload(name.removeprefix("refill-"))
    return peer_bench.workload(name)


if __name__ == "__main__":
    main()
