"""Write a GGUF file from a tiny Hugging Face model folder, laid out as llama.cpp's converter lays
out that architecture: llama.cpp tensor names, each layer's experts merged into one 3-D tensor per
projection, Qwen2-MoE's shared-expert gate squeezed to 1-D, metadata under llama.cpp's keys and
the byte-level BPE tokenizer as ``tokenizer.ggml.*`` arrays.

Written independently of tokenmill's reader (only the ``gguf`` package's name table is shared), so
the GGUF tests check our reading against a second account of the format. Some tensors can be
stored quantized or in fp16; the function returns the Hugging Face state dict whose values are
exactly the ones the file encodes, so a transformers model loaded from it is the reference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

# HF model_type -> llama.cpp's general.architecture (llama.cpp writes Mixtral as "llama").
LLAMA_CPP_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
_EXPERT = re.compile(r"(?P<block>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")
# A dense MLP inside a MoE architecture (Qwen3-MoE's mlp_only_layers): gguf's per-architecture
# table has no name for it, so these follow the dense models' names.
_DENSE_MLP = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(hf_dir: Path, out: Path, quantize: Mapping[str, Any] | None = None,
               f16: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Write ``out`` from the model in ``hf_dir``. ``quantize``: GGUF tensor name (no ``.weight``)
    -> ``gguf.GGMLQuantizationType``; ``f16``: GGUF tensor names stored as F16; the rest is F32.
    Returns the HF-named tensors (hub layout, one tensor per expert) holding the file's values."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = LLAMA_CPP_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config)
    _write_tokenizer(writer, hf_dir, config)

    quantize, f16 = dict(quantize or {}), set(f16)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH(_arch_enum(arch)), config["num_hidden_layers"])
    encoded: dict[str, torch.Tensor] = {}
    for hf_base, tensor in _merged(load_file(str(hf_dir / "model.safetensors"))).items():
        module, suffix = hf_base.rsplit(".", 1)
        gguf_name = name_map.get_name(module) or _dense_name(module)
        assert gguf_name is not None, f"no GGUF name for {hf_base}"
        array = tensor.float().numpy()
        if module.endswith("shared_expert_gate"):
            array = array.reshape(-1)  # llama.cpp's converter squeezes the [1, H] gate to [H]
        qtype = quantize.pop(gguf_name, None)
        if qtype is not None:
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(f"{gguf_name}.{suffix}", data, raw_shape=data.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(data, qtype)
        elif gguf_name in f16:
            f16.discard(gguf_name)
            stored = array.astype("float16")
            writer.add_tensor(f"{gguf_name}.{suffix}", stored)
        else:
            stored = array
            writer.add_tensor(f"{gguf_name}.{suffix}", array)
        encoded[hf_base] = torch.from_numpy(stored.astype("float32")).reshape(tensor.shape)
    assert not quantize and not f16, f"no such GGUF tensors: {sorted(quantize) + sorted(f16)}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _split(encoded)


def _arch_enum(arch: str) -> int:
    import gguf

    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)


def _dense_name(module: str) -> str | None:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(mlp\.\w+)", module)
    if m and m[2] in _DENSE_MLP:
        return f"blk.{m[1]}.{_DENSE_MLP[m[2]]}"
    return None


def _merged(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked, expert by expert, into ``...experts.{proj}.weight`` [E, rows, cols]."""
    merged: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(f"{m['block']}.{m['proj']}.weight", {})[int(m["e"])] = tensor
        else:
            merged[name] = tensor
    for name, by_index in experts.items():
        merged[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return merged


def _split(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``_merged``: back to the hub's one tensor per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        m = re.fullmatch(r"(?P<block>.+\.experts)\.(?P<proj>\w+)\.weight", name)
        if m and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                out[f"{m['block']}.{e}.{m['proj']}.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def _write_metadata(writer: Any, config: dict) -> None:
    """The keys llama.cpp's converter writes for these architectures (TextModel + its MoE subclasses)."""
    writer.add_name("tiny " + config["model_type"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_expert_count(config.get("num_experts") or config.get("num_local_experts"))
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_file_type(0)  # LlamaFileType.ALL_F32: the bulk of the file


def _write_tokenizer(writer: Any, hf_dir: Path, config: dict) -> None:
    import gguf

    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["content"] for t in data["added_tokens"] if t.get("special")}
    for token in data["added_tokens"]:
        vocab.setdefault(token["content"], token["id"])
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # GPT-2's split regex, as the tiny tokenizer's ByteLevel uses
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in data["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    template = hf_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
