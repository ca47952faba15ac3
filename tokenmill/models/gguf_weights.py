"""Read a GGUF file as Hugging Face-named fp32 tensors.

GGUF (llama.cpp's format) names tensors ``blk.N.attn_q.weight`` and may store them quantized.
We dequantize with the ``gguf`` package, map names back to HF ones with gguf's own name table,
and undo the q/k row permutation llama.cpp's converter applies to the architectures its LlamaModel
converts ("llama", "granite", "smollm3": it reorders each head's rows from HF's half-split rope
layout to interleaved pairs). Phi-3 files keep the checkpoint's fused ``attn_qkv`` and gate+up
``ffn_up``, which map to HF's ``qkv_proj`` and ``gate_up_proj``. The rope tensors (``rope_freqs``,
Phi-3's ``rope_factors_long/short``) are not weights: the config reader turns them into the
config's rope parameters (gguf_rope.py) and they are skipped here.

Mixture-of-experts files (Qwen2-MoE, Qwen3-MoE) hold each layer's experts merged into one 3-D
tensor per projection (``blk.N.ffn_gate_exps.weight`` [E, I, H] in torch order); we split it into
the hub's one tensor per expert (``model.layers.N.mlp.experts.{e}.gate_proj.weight``), so a
converted folder has the same layout as the model's own safetensors folder.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# HF module names of one decoder block and of the model ends, for the name map.
_BLOCK_MODULES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "input_layernorm", "post_attention_layernorm",
    # Mixture of experts: the router, the merged experts (HF's fused module names, split below),
    # Qwen2-MoE's shared expert and its gate.
    "mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
_GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# llama.cpp converters that permute q/k rows: LlamaModel and its subclasses (Qwen2/Qwen3/Phi-3's do not).
_PERMUTED_ARCHS = ("llama", "granite", "smollm3")
# Fused projections llama.cpp keeps as the checkpoint has them, per architecture: GGUF name -> HF module.
_FUSED_BLOCK = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# Tensors that describe the rotary embedding, not weights (read by gguf_rope.py).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp architectures whose merged experts we split (and whose configs gguf_config fixes up).
MOE_ARCHS = ("qwen2moe", "qwen3moe")
# Every llama.cpp architecture a GGUF file of ours may have (gguf_config.py reads their configs).
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "granite", "smollm3", *MOE_ARCHS)
# A dense MLP block inside a MoE architecture (Qwen3-MoE's ``mlp_only_layers``): gguf's table
# for these architectures has no dense FFN names, so they get the dense models' names.
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MERGED_EXPERTS = re.compile(r"(?P<block>.+\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` (memory-mapped; tensors are read when dequantized)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises assorted errors on bad files
        raise ValueError(f"cannot read GGUF file {path}: {type(exc).__name__}: {exc}") from exc
    refuse_foreign_byte_order(reader, path)
    refuse_unsupported_architecture(reader, path)
    refuse_split_file(reader, path)
    refuse_unloadable_experts(reader, path)
    return reader


def refuse_foreign_byte_order(reader: Any, path: Path) -> None:
    """Refuse a GGUF of the other byte order (a big-endian file, written for s390x): gguf's reader
    reads its metadata, but its dequantizer takes every tensor's bytes as this machine's order, so
    each weight would load as garbage without an error (llama.cpp refuses such files too)."""
    if reader.byte_order != "I":
        raise ValueError(f"GGUF file {path} is {reader.endianess.name.lower()}-endian and this machine is "
                         f"{sys.byteorder}-endian: its tensors cannot be read; convert it first "
                         "(the gguf package's gguf_convert_endian script)")


def refuse_unsupported_architecture(reader: Any, path: Path) -> None:
    """Refuse a file whose architecture we have no model for before transformers reads its config:
    transformers' own refusal names neither the file nor what loads ("GGUF model with architecture
    foo is not supported yet"), and for architectures it does read the failure comes later and
    deeper (an AttributeError of its config class)."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF file {path} has general.architecture={arch!r}, which tokenmill cannot load; "
                         f"supported: {list(GGUF_ARCHS)}")


def refuse_split_file(reader: Any, path: Path) -> None:
    """Refuse one part of a GGUF that llama.cpp's gguf-split cut into several files: the tensors of
    the other parts would be reported missing one by one (and a MoE file's layers misread as dense)."""
    parts = field(reader, "split.count")
    if parts and int(parts) > 1:
        raise ValueError(f"GGUF file {path} has split.count={int(parts)}: it is one part of a split model, and split "
                         "GGUF files do not load; merge the parts first (llama.cpp: llama-gguf-split --merge)")


def refuse_unloadable_experts(reader: Any, path: Path) -> None:
    """Refuse a mixture-of-experts file of an architecture we do not split (every reader of a GGUF
    goes through open_gguf, so this runs before transformers builds a config from it). llama.cpp
    writes Mixtral as architecture "llama" with ``llama.expert_count`` > 0: transformers would make
    a dense LlamaConfig of it and the load would fail on tensors nobody expects."""
    arch = field(reader, "general.architecture")
    experts = field(reader, f"{arch}.expert_count")
    if experts and int(experts) > 0 and arch not in MOE_ARCHS:
        raise ValueError(
            f"GGUF file {path} has {arch}.expert_count={int(experts)}: mixture-of-experts GGUF files load only for "
            f"general.architecture in {list(MOE_ARCHS)}, not {arch!r} (llama.cpp writes Mixtral as 'llama' with "
            "experts); load such a model from its Hugging Face safetensors folder instead"
        )


def field(reader: Any, key: str) -> Any:
    """The value of metadata ``key``, or None when the file has no such key."""
    entry = reader.fields.get(key)
    return None if entry is None else entry.contents()


def gguf_to_hf_names(reader: Any) -> dict[str, str]:
    """GGUF tensor name -> HF tensor name for the decoder family of this file."""
    import gguf

    arch_name = field(reader, "general.architecture")
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"GGUF general.architecture={arch_name!r} is unknown to the gguf package")
    num_blocks = int(field(reader, f"{arch_name}.block_count"))
    name_map = gguf.get_tensor_name_map(arch, num_blocks)
    hf_modules = [f"model.layers.{i}.{m}" for i in range(num_blocks) for m in _BLOCK_MODULES]
    mapping: dict[str, str] = {}
    for hf in (*_GLOBAL_MODULES, *hf_modules):
        gguf_name = name_map.get_name(hf)
        if gguf_name is not None:
            for suffix in (".weight", ".bias"):
                mapping[gguf_name + suffix] = hf + suffix
    for i in range(num_blocks):
        for gguf_part, hf_module in _FUSED_BLOCK.get(arch_name, {}).items():
            for suffix in (".weight", ".bias"):
                mapping[f"blk.{i}.{gguf_part}{suffix}"] = f"model.layers.{i}.{hf_module}{suffix}"
    if arch_name in MOE_ARCHS:
        for i in range(num_blocks):
            for gguf_ffn, hf_mlp in _DENSE_MLP.items():
                mapping.setdefault(f"blk.{i}.{gguf_ffn}.weight", f"model.layers.{i}.{hf_mlp}.weight")
    return mapping


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: rows (head, pair, 2) -> (head, 2, pair)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: Path, reader: Any | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every weight in the file (not the rope tensors); unmapped
    names pass through as is so that the model's ``load_weights`` reports them as unexpected instead
    of dropping them."""
    import gguf
    import numpy as np

    reader = reader if reader is not None else open_gguf(path)
    arch_name = field(reader, "general.architecture")
    names = gguf_to_hf_names(reader)
    permute = arch_name in _PERMUTED_ARCHS
    num_heads = int(field(reader, f"{arch_name}.attention.head_count") or 0)
    num_kv_heads = int(field(reader, f"{arch_name}.attention.head_count_kv") or num_heads)
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            continue
        try:
            array = gguf.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}) in {path}: {exc}") from exc
        # np.array copies: unquantized tensors come back as read-only views of the memory map.
        # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = torch.from_numpy(np.array(array, dtype=np.float32, order="C")).reshape(shape)
        hf_name = names.get(tensor.name, tensor.name)
        if permute and ".attn_q." in tensor.name:
            weight = _unpermute(weight, num_heads)
        elif permute and ".attn_k." in tensor.name:
            weight = _unpermute(weight, num_kv_heads)
        elif hf_name.endswith(".shared_expert_gate.weight") and weight.dim() == 1:
            weight = weight.unsqueeze(0)  # llama.cpp's converter squeezes HF's [1, H] gate to [H]
        merged = _MERGED_EXPERTS.fullmatch(hf_name) if weight.dim() == 3 else None
        if merged is None:
            yield hf_name, weight
            continue
        # [E, rows, cols]: expert e is slice e. Each is cloned so that no two yielded tensors share
        # storage (safetensors refuses to save those) and the merged tensor is freed after the loop.
        for e in range(weight.shape[0]):
            yield f"{merged['block']}.{e}.{merged['proj']}.weight", weight[e].clone()
        del weight
