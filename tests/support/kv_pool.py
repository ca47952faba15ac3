"""What a quantization config gives the KV cache on a GPU (the GPU quant tests' memory-plan check):
the same dummy model loaded unquantized and with ``quantization_config`` at the same utilisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def kv_bytes_gained(root: Path, config: dict[str, Any], quantization_config: dict[str, Any]) -> tuple[int, dict]:
    """(the bytes the quantized model's KV pool holds beyond the unquantized one's, each run's
    (blocks, bytes a block) for a failure message). ``config``: the config.json of a model to build
    with dummy weights, in folders under ``root``."""
    import gc
    import json

    import torch

    from tokenmill import LLM

    blocks = {}
    for name, quant in (("unquantized", None), ("quantized", quantization_config)):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
        llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=4096,
                  gpu_memory_utilization=0.5, enforce_eager=True)
        engine = llm.llm_engine
        blocks[name] = (engine.executor.num_blocks, engine.executor.driver.runner.kv_bytes_per_block())
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    return (blocks["quantized"][0] - blocks["unquantized"][0]) * blocks["unquantized"][1], blocks
