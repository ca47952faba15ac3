"""PEFT LoRA adapters for the tests, made with peft itself, and their Hugging Face + PEFT references.

PEFT starts every lora_B at zero (an adapter that changes nothing, so any comparison would pass);
here every lora_A and lora_B is redrawn from a seeded generator, large enough that greedy tokens
change (tests/test_lora.py asserts that they do for the prompts it uses). The references are the
base model loaded by transformers in fp32 with ``PeftModel.from_pretrained`` around it: the unmerged
LoRA forward ``base(x) + scaling * B(A(x))``, written independently of tokenmill.
"""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

# The projections tokenmill applies LoRA to, in every decoder layer.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_base(base_dir: Path | str) -> torch.nn.Module:
    """A fresh fp32 copy of the base model (PEFT injects its layers into the model it wraps)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def redraw_lora_weights(model: torch.nn.Module, seed: int, std: float) -> int:
    """Every lora_A / lora_B (and DoRA magnitude) of ``model`` redrawn N(0, std) from ``seed``, in
    named_parameters order; returns how many tensors were drawn."""
    gen = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))
                drawn += 1
            elif "lora_magnitude_vector" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    return drawn


def make_adapter(model: torch.nn.Module, out: Path, *, seed: int, r: int = 8, lora_alpha: float = 16,
                 target_modules: list[str] | tuple[str, ...] | str = ALL_PROJECTIONS, std: float = 0.1,
                 base_model_name_or_path: str | None = None, **config: Any) -> Path:
    """Wrap ``model`` (modified in place) with a peft LoraConfig, redraw its LoRA weights and save
    the adapter folder (adapter_config.json + adapter_model.safetensors) to ``out``. ``config``:
    more LoraConfig fields (rank_pattern, alpha_pattern, use_rslora, use_dora, bias, ...)."""
    from peft import LoraConfig, get_peft_model

    targets = list(target_modules) if not isinstance(target_modules, str) else target_modules
    lora = LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0,
                      init_lora_weights=False, **config)
    with warnings.catch_warnings():  # peft's notes on transformers deprecations and on saving embedding layers
        warnings.filterwarnings("ignore", message=".*(is_gradient_checkpointing|save_embedding_layers)")
        peft_model = get_peft_model(model, lora)
        assert redraw_lora_weights(peft_model, seed, std) > 0, "the adapter has no LoRA tensors"
        if base_model_name_or_path is not None:
            peft_model.peft_config["default"].base_model_name_or_path = base_model_name_or_path
        peft_model.save_pretrained(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


def save_adapter(base_dir: Path, out: Path, *, seed: int, **kwargs: Any) -> Path:
    """An adapter for the model saved in ``base_dir`` (see make_adapter); made once per ``out``."""
    if (out / "adapter_config.json").is_file():
        return out
    return make_adapter(_hf_base(base_dir), out, seed=seed, base_model_name_or_path=str(base_dir), **kwargs)


def adapter_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "adapter_config.json").read_text())


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def write_adapter(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter folder written by hand (what peft cannot make against this transformers version)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return out


def copy_adapter(src: Path, out: Path, config_changes: dict[str, Any] | None = None,
                 tensor_changes: dict[str, torch.Tensor] | None = None, drop: str | None = None) -> Path:
    """A copy of the adapter in ``src`` with some adapter_config.json fields and/or tensors replaced,
    and the tensors whose names contain ``drop`` left out."""
    if out.exists():
        shutil.rmtree(out)
    config = adapter_config(src)
    config.update(config_changes or {})
    tensors = adapter_tensors(src)
    for name, tensor in (tensor_changes or {}).items():
        assert name in tensors, f"{name} is not in {sorted(tensors)}"
        tensors[name] = tensor
    if drop is not None:
        assert any(drop in name for name in tensors), f"no tensor name contains {drop!r}"
        tensors = {name: tensor for name, tensor in tensors.items() if drop not in name}
    return write_adapter(out, config, tensors)


# --- references -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def peft_model(base_dir: str, adapter_dir: str | None) -> torch.nn.Module:
    """transformers' fp32 model of ``base_dir`` with the PEFT adapter in ``adapter_dir`` (None: none),
    in eval mode (loaded once per pair)."""
    from peft import PeftModel

    base = _hf_base(base_dir)
    if adapter_dir is None:
        return base
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")
        model = PeftModel.from_pretrained(base, adapter_dir).eval()
    assert any(".lora_B." in name and param.abs().max() > 0 for name, param in model.named_parameters())
    return model


@functools.lru_cache(maxsize=256)
def _greedy(base_dir: str, adapter_dir: str | None, prompt: tuple[int, ...], max_new_tokens: int):
    from reference import hf_greedy

    tokens, logprobs = hf_greedy(peft_model(base_dir, adapter_dir), list(prompt), max_new_tokens)
    return tuple(tokens), tuple(logprobs)


def peft_greedy(base_dir: Path | str, adapter_dir: Path | str | None, prompt: list[int],
                max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF + PEFT greedy continuation (full forwards): the tokens and each one's log-probability."""
    tokens, logprobs = _greedy(str(base_dir), None if adapter_dir is None else str(adapter_dir), tuple(prompt),
                               max_new_tokens)
    return list(tokens), list(logprobs)


def peft_beam_search(base_dir: Path | str, adapter_dir: Path | str | None, prompt: list[int], num_beams: int,
                     max_new_tokens: int, length_penalty: float, eos: bool = True) -> list[tuple[list[int], float]]:
    """transformers' beam search through the PEFT model (see reference.hf_beam_search)."""
    from reference import hf_beam_search

    model = peft_model(str(base_dir), None if adapter_dir is None else str(adapter_dir))
    return hf_beam_search(model, prompt, num_beams, max_new_tokens, length_penalty, eos=eos)
