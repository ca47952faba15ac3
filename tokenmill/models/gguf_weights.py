"""Read a GGUF file as Hugging Face-named fp32 tensors.

GGUF (llama.cpp's format) names tensors ``blk.N.attn_q.weight`` and may store them quantized.
We dequantize with the ``gguf`` package, map names back to HF ones with gguf's own name table,
and undo the q/k row permutation llama.cpp's converter applies to "llama" architecture models
(it reorders each head's rows from HF's half-split rope layout to interleaved pairs).
"""

from __future__ import annotations

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
)
_GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# llama.cpp converters that permute q/k rows (Qwen2/Qwen3 converters do not).
_PERMUTED_ARCHS = ("llama",)


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` (memory-mapped; tensors are read when dequantized)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises assorted errors on bad files
        raise ValueError(f"cannot read GGUF file {path}: {type(exc).__name__}: {exc}") from exc


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def gguf_to_hf_names(reader: Any) -> dict[str, str]:
    """GGUF tensor name -> HF tensor name for the decoder family of this file."""
    import gguf

    arch_name = _field(reader, "general.architecture")
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"GGUF general.architecture={arch_name!r} is unknown to the gguf package")
    num_blocks = int(_field(reader, f"{arch_name}.block_count"))
    name_map = gguf.get_tensor_name_map(arch, num_blocks)
    hf_modules = [f"model.layers.{i}.{m}" for i in range(num_blocks) for m in _BLOCK_MODULES]
    mapping: dict[str, str] = {}
    for hf in (*_GLOBAL_MODULES, *hf_modules):
        gguf_name = name_map.get_name(hf)
        if gguf_name is not None:
            for suffix in (".weight", ".bias"):
                mapping[gguf_name + suffix] = hf + suffix
    return mapping


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: rows (head, pair, 2) -> (head, 2, pair)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: Path, reader: Any | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor in the file; unmapped names pass through as is
    so that the model's ``load_weights`` reports them as unexpected instead of dropping them."""
    import gguf
    import numpy as np

    reader = reader if reader is not None else open_gguf(path)
    arch_name = _field(reader, "general.architecture")
    names = gguf_to_hf_names(reader)
    permute = arch_name in _PERMUTED_ARCHS
    num_heads = int(_field(reader, f"{arch_name}.attention.head_count") or 0)
    num_kv_heads = int(_field(reader, f"{arch_name}.attention.head_count_kv") or num_heads)
    for tensor in reader.tensors:
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
        yield hf_name, weight
