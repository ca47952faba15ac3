"""Write a GGUF file from a tiny Hugging Face model folder, laid out as llama.cpp's converter
(convert_hf_to_gguf.py) lays out that architecture: llama.cpp tensor names and metadata keys, the
byte-level BPE tokenizer as ``tokenizer.ggml.*`` arrays, and per family:

- Llama, Mistral, Mixtral, Granite, SmolLM3 (the converter's LlamaModel and its subclasses): each
  head's q/k rows reordered from HF's half-split rotary layout to interleaved pairs; a "llama3"
  rope scaling written as the ``rope_freqs`` tensor (one divisor of each rotary pair's frequency),
  not as keys; Granite's four multipliers as ``*_scale`` keys and its head_dim left out.
- Phi-3: q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up``); its own metadata (the rotary
  width, the pretraining length, the sliding window) and, for LongRoPE, the ``rope_factors_long``
  / ``rope_factors_short`` tensors and the attention factor.
- Linear and YaRN scalings as ``{arch}.rope.scaling.*`` keys (the converter's TextModel).
- Qwen2-MoE / Qwen3-MoE: each layer's experts merged into one 3-D tensor per projection, the
  shared-expert gate squeezed to 1-D.

Written independently of tokenmill's reader (only the ``gguf`` package's name table is shared), so
the GGUF tests check our reading against a second account of the format. Some tensors can be
stored quantized or in fp16; the function returns the Hugging Face state dict whose values are
exactly the ones the file encodes, so a transformers model loaded from it is the reference.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

# HF model_type -> llama.cpp's general.architecture (llama.cpp writes Mistral and Mixtral as "llama").
LLAMA_CPP_ARCH = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "granite": "granite", "smollm3": "smollm3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
}
# model_types the converter's LlamaModel (or a subclass) converts: they permute q/k rows.
_LLAMA_CONVERTER = ("llama", "mistral", "mixtral", "granite", "smollm3")
_EXPERT = re.compile(r"(?P<block>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")
# A dense MLP inside a MoE architecture (Qwen3-MoE's mlp_only_layers): gguf's per-architecture
# table has no name for it, so these follow the dense models' names.
_DENSE_MLP = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf_and_reference(hf_dir: Path, folder: Path, quantize: Mapping[str, str] | None = None,
                             f16: Iterable[str] = (), **kwargs: Any) -> tuple[Path, Path]:
    """``folder/gguf/model.gguf`` written from ``hf_dir`` (alone in its folder) and
    ``folder/reference``, the HF folder of ``hf_dir`` holding the values the file encodes (Q8_0 and
    F16 tensors rounded as stored): transformers on it is the reference. ``quantize`` names each
    GGUF tensor's ``GGMLQuantizationType``; ``kwargs`` go to `write_gguf`."""
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    (folder / "gguf").mkdir(parents=True)
    path = folder / "gguf" / "model.gguf"
    qtypes = {name: gguf.GGMLQuantizationType[q] for name, q in (quantize or {}).items()}
    encoded = write_gguf(hf_dir, path, qtypes, f16, **kwargs)
    original = load_file(str(hf_dir / "model.safetensors"))
    assert encoded.keys() == original.keys()
    if qtypes or f16:  # the stored tensors really hold other values than the original's
        assert any(not torch.equal(encoded[n], original[n]) for n in original)
    reference = folder / "reference"
    shutil.copytree(hf_dir, reference, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(encoded, str(reference / "model.safetensors"), metadata={"format": "pt"})
    return path, reference


def write_gguf(hf_dir: Path, out: Path, quantize: Mapping[str, Any] | None = None,
               f16: Iterable[str] = (), metadata: Mapping[str, Any] | None = None,
               rope_tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Write ``out`` from the model in ``hf_dir``. ``quantize``: GGUF tensor name (no ``.weight``)
    -> ``gguf.GGMLQuantizationType``; ``f16``: GGUF tensor names stored as F16; the rest is F32.
    ``metadata``: extra keys (``{arch}`` in a key is the file's architecture), typed by their
    Python value (str, bool, int as uint32, float as float32), written after the converter's own.
    ``rope_tensors``: written instead of the rope tensors the converter would derive.
    Returns the HF-named tensors (hub layout, one tensor per expert) holding the file's values."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = LLAMA_CPP_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config)
    for key, value in (metadata or {}).items():
        _add_value(writer, key.format(arch=arch), value)
    _write_tokenizer(writer, hf_dir, config)

    quantize, f16 = dict(quantize or {}), set(f16)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH(_arch_enum(arch)), config["num_hidden_layers"])
    encoded: dict[str, torch.Tensor] = {}
    for hf_base, tensor in _merged(load_file(str(hf_dir / "model.safetensors"))).items():
        module, suffix = hf_base.rsplit(".", 1)
        gguf_name = name_map.get_name(module) or _dense_name(module)
        assert gguf_name is not None, f"no GGUF name for {hf_base}"
        heads = _permuted_heads(config, module)
        torch_tensor = tensor.float() if heads is None else _permute(tensor.float(), heads)
        array = torch_tensor.numpy()
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
        value = torch.from_numpy(stored.astype("float32")).reshape(tensor.shape)
        encoded[hf_base] = value if heads is None else _unpermute(value, heads)
    assert not quantize and not f16, f"no such GGUF tensors: {sorted(quantize) + sorted(f16)}"
    for name, values in (_rope_tensors(config) if rope_tensors is None else rope_tensors).items():
        writer.add_tensor(name, values.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _split(encoded)


def _add_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, float(value))


def _arch_enum(arch: str) -> int:
    import gguf

    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)


def _dense_name(module: str) -> str | None:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(mlp\.\w+)", module)
    if m and m[2] in _DENSE_MLP:
        return f"blk.{m[1]}.{_DENSE_MLP[m[2]]}"
    return None


def _permuted_heads(config: dict, module: str) -> int | None:
    """The head count llama.cpp's LlamaModel.permute uses for this module's rows, or None."""
    if config["model_type"] not in _LLAMA_CONVERTER:
        return None
    if module.endswith("self_attn.q_proj"):
        return config["num_attention_heads"]
    if module.endswith("self_attn.k_proj"):
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, rows (2, pair) -> (pair, 2): HF's halves become interleaved rotary pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


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


def _rope(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _write_metadata(writer: Any, config: dict) -> None:
    writer.add_name("tiny " + config["model_type"])  # transformers reads a "llama" file named *mistral* as Mistral
    if config["model_type"] == "phi3":
        _write_phi3_metadata(writer, config)
    else:
        _write_text_model_metadata(writer, config)
    writer.add_file_type(0)  # LlamaFileType.ALL_F32: the bulk of the file


def _write_text_model_metadata(writer: Any, config: dict) -> None:
    """The keys of the converter's TextModel.set_gguf_parameters, plus LlamaModel's and Granite's."""
    import gguf

    llama_converter = config["model_type"] in _LLAMA_CONVERTER
    head_dim = None if config["model_type"] == "granite" else config.get("head_dim")  # Granite's converter drops it
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = _rope(config)
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if llama_converter:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim or config["hidden_size"] // config["num_attention_heads"])
    if config["model_type"] == "granite":  # written only when set (truthy), as the converter does
        for key, add in (("attention_multiplier", writer.add_attention_scale),
                         ("embedding_multiplier", writer.add_embedding_scale),
                         ("residual_multiplier", writer.add_residual_scale), ("logits_scaling", writer.add_logit_scale)):
            if config.get(key):
                add(config[key])


def _write_phi3_metadata(writer: Any, config: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters (it does not call TextModel's: no rope.scaling.type)."""
    rope = _rope(config)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // config["num_attention_heads"])
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_sliding_window(config.get("sliding_window") or 0)  # 0: none
    if (rope.get("rope_type") or rope.get("type")) == "longrope":
        scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _rope_tensors(config: dict) -> dict[str, torch.Tensor]:
    """The rope tensors the converter adds: Llama's ``rope_freqs`` for a "llama3" scaling, Phi-3's
    long and short LongRoPE factors."""
    rope = _rope(config)
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "llama3" and config["model_type"] in _LLAMA_CONVERTER:
        return {"rope_freqs.weight": llama3_rope_factors(rope, _head_dim(config))}
    if kind == "longrope" and config["model_type"] == "phi3":
        return {"rope_factors_long.weight": torch.tensor(rope["long_factor"], dtype=torch.float32),
                "rope_factors_short.weight": torch.tensor(rope["short_factor"], dtype=torch.float32)}
    return {}


def llama3_rope_factors(rope: dict, head_dim: int) -> torch.Tensor:
    """Per rotary pair, the divisor llama.cpp applies to its frequency (1 for short wavelengths,
    ``factor`` for long ones, a smooth blend in the band between): LlamaModel's rope_freqs, in fp32."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


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
