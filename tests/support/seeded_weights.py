"""Random weights that are the same model at every tensor_parallel_size.

``load_format="dummy"`` draws each rank's *shard* from its own generator, so TP=2 and TP=1 run
different models. Here every checkpoint tensor is drawn at full size from a generator seeded by
(seed, name), on each rank alike, and handed to the model's own ``load_weights``, whose weight
loaders keep the rank's slice: every rank holds a slice of one model, and TP=N equals TP=1.
Names and full shapes come from the Hugging Face model built on the meta device (no memory).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Iterator

import torch


def seeded_full_weights(config: Any, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full fp32 tensor) for every parameter of ``config``'s causal LM: norm scales
    1 + N(0, 0.05), everything else N(0, 0.02) (activations stay finite through 32 layers)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = [(name, tuple(p.shape)) for name, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    for name, shape in shapes:
        generator = torch.Generator(device=device)
        generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        yield name, (1.0 + 0.05 * values) if name.endswith("norm.weight") else 0.02 * values


@torch.no_grad()
def load_seeded_weights(worker: Any, model_dir: str | Path, seed: int) -> None:
    """collective_rpc target: replace this rank's weights by its slices of the seeded full model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    worker.model.load_weights(seeded_full_weights(config, seed, worker.device))


@torch.no_grad()
def hf_seeded_model(model_dir: str | Path, seed: int) -> Any:
    """The same seeded model in Hugging Face transformers (fp32, CPU): the reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(seeded_full_weights(config, seed, torch.device("cpu"))), strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)  # tied head
    return model.eval()
