"""The Hugging Face config of a GGUF file: transformers' reading of its metadata, plus what that
reading leaves out or gets wrong for the architectures we load, read the way llama.cpp's converter
(convert_hf_to_gguf.py) wrote it.

- Llama, Qwen2, Qwen3, Phi-3, Qwen2-MoE, Qwen3-MoE: transformers' reading is done here, from the
  keys our own reader has parsed already: the same keys into the same config fields as its legacy
  reader (``load_gguf_checkpoint``), which would otherwise parse the whole file a second time
  (~4-5 s for SmolLM2's 49k-token vocabulary). tests/test_gguf_config.py holds the two to every
  field. A "llama" file named "mistral", which that reader alone makes a Mistral, still goes to it.

- Every architecture: the rope scaling (gguf_rope.py), and ``head_dim`` from
  ``{arch}.attention.key_length`` where the file states it (transformers keeps Qwen3's class
  default of 128 whatever the file says).
- Phi-3: the rotary width (``phi3.rope.dimension_count``, a fraction of the head: Phi-4-mini rotates
  three quarters), the sliding window and the pretraining length, which transformers does not read.
- Granite and SmolLM3: transformers refuses these architectures, so their config is built here
  from llama.cpp's keys: Granite's four multipliers are ``granite.attention.scale``,
  ``.embedding_scale``, ``.residual_scale`` and ``.logit_scale`` (a multiplier the converter left
  out was 0/unset in the original config: HF's default, 1, applies); SmolLM3's layers without
  rotary follow llama.cpp's fixed rule (every fourth, no key says otherwise), HF's default for
  ``no_rope_layer_interval=4``.
- Qwen2-MoE / Qwen3-MoE: transformers reads only ``expert_count`` and ``expert_used_count`` of the
  MoE keys; everything else would fall back to the class defaults, which describe
  Qwen1.5-MoE-A2.7B / Qwen3-30B-A3B rather than the file (``moe_intermediate_size`` 1408 / 768,
  ``shared_expert_intermediate_size`` 5632 would give experts of the wrong width).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.models.gguf_weights import field

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# llama.cpp's graphs renormalise the router's top k for qwen3moe (build_moe_ffn(..., norm_w=true))
# and not for qwen2moe (norm_w=false), whatever the original config said; no GGUF key says so.
# transformers sets qwen3_moe's itself and leaves qwen2_moe's at its class default: we state both,
# so neither depends on a transformers version.
_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}
# Architectures whose config transformers cannot build from a GGUF: general.architecture -> model_type.
CONFIG_BUILT_HERE = {"granite": "granite", "smollm3": "smollm3"}
# Architectures whose config transformers' legacy reader builds, built here the same way from the
# keys already read: general.architecture -> model_type.
_READ_AS_TRANSFORMERS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                         "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# The keys that reader maps to config fields, per architecture ({arch}.KEY -> field); a key the
# file lacks leaves the config class's default, as there. (Its table: GGUF_CONFIG_MAPPING.)
_TRANSFORMERS_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                      "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                      "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                      "attention.head_count_kv": "num_key_value_heads",
                      "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
_TRANSFORMERS_ARCH_KEYS = {"llama": {"rope.dimension_count": "head_dim"},
                           "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
                           "qwen3moe": {"attention.key_length": "head_dim", "expert_count": "num_experts",
                                        "expert_used_count": "num_experts_per_tok"}}
_TRANSFORMERS_TOKEN_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                            "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id"}
# Granite's multipliers: HF config field -> the key llama.cpp's converter writes it under.
_GRANITE_SCALES = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                   "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}


# Keys llama.cpp refuses a file of our families without ({arch}.KEY); transformers would take its
# class defaults for them (Qwen2's 32768 positions, Llama's 1e-6 norm epsilon) and run another model.
_REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon")
# The size fields of a config and the llama.cpp keys they are read from ({arch}.KEY).
_SIZE_KEYS = {"max_position_embeddings": "context_length", "hidden_size": "embedding_length",
              "intermediate_size": "feed_forward_length", "num_hidden_layers": "block_count",
              "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
              "head_dim": "attention.key_length", "vocab_size": "vocab_size"}


def read_gguf_config(gguf_path: Path, reader: Any) -> "PretrainedConfig":
    """The HF config of the model in the GGUF at ``gguf_path`` (``reader``: its open_gguf reader)."""
    arch = field(reader, "general.architecture")
    try:
        if arch in CONFIG_BUILT_HERE:
            config = _config_from_keys(reader, arch, gguf_path)
        elif arch in _READ_AS_TRANSFORMERS and not (arch == "llama" and field(reader, "general.name") == "mistral"):
            config = _config_as_transformers_reads_it(reader, arch, gguf_path)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers' readers and config validators raise assorted errors
        raise ValueError(f"cannot read the model config from GGUF file {gguf_path}: {type(exc).__name__}: {exc}") from exc
    check_gguf_config(config, reader, gguf_path)
    fix_dense_config(config, reader, gguf_path)
    fix_moe_config(config, reader)
    return config


def check_gguf_config(config: "PretrainedConfig", reader: Any, path: Path) -> None:
    """Refuse metadata that would load and then run wrong or fail deep in the model, naming the key:
    a required key missing, a size that is not a positive integer, kv heads that do not divide the
    heads, a rope base that is not a positive number (every rotation NaN), a bos/eos id outside the
    vocabulary (the eos never sampled: generation would not stop)."""
    from tokenmill.param_checks import is_int, is_number

    arch = field(reader, "general.architecture")
    missing = [f"{arch}.{key}" for key in _REQUIRED_KEYS if field(reader, f"{arch}.{key}") is None]
    if missing:
        raise ValueError(f"GGUF file {path} has no {', '.join(missing)}, which a {arch} model needs (llama.cpp "
                         "refuses the file too)")
    for name, key in _SIZE_KEYS.items():
        value = getattr(config, name, None)
        if value is not None and not (is_int(value) and value >= 1):
            raise ValueError(f"GGUF file {path}: {arch}.{key}={value!r} ({name}) is invalid: must be an integer >= 1")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % kv_heads:
        raise ValueError(f"GGUF file {path}: {arch}.attention.head_count_kv={kv_heads} does not divide "
                         f"{arch}.attention.head_count={heads}: each kv head serves a whole group of heads")
    theta = field(reader, f"{arch}.rope.freq_base")
    if theta is not None and not (is_number(theta) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"GGUF file {path}: {arch}.rope.freq_base={theta!r} is invalid: must be a number > 0")
    tokens = field(reader, "tokenizer.ggml.tokens")
    for role in ("bos", "eos"):
        token_id = field(reader, f"tokenizer.ggml.{role}_token_id")
        if tokens is not None and token_id is not None and not 0 <= int(token_id) < len(tokens):
            raise ValueError(f"GGUF file {path}: tokenizer.ggml.{role}_token_id={int(token_id)} is not a token of the "
                             f"file's vocabulary (tokenizer.ggml.tokens: ids 0..{len(tokens) - 1})")


def _config_as_transformers_reads_it(reader: Any, arch: str, path: Path) -> "PretrainedConfig":
    """The config ``AutoConfig.from_pretrained(folder, gguf_file=...)`` builds for this file, from
    our reader's values: the mapped keys the file has, the tokenizer's special ids, the name, the
    vocabulary size from the tokens when the key is absent, the head tied when there is no
    ``output.weight``, and Qwen3-MoE's ``norm_topk_prob`` (its reader's default for llama.cpp)."""
    from transformers import AutoConfig

    model_type = _READ_AS_TRANSFORMERS[arch]
    values: dict[str, Any] = {"model_type": model_type,
                              "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors)}
    if model_type == "qwen3_moe":
        values["norm_topk_prob"] = True
    keys = {f"{arch}.{k}": name for k, name in {**_TRANSFORMERS_KEYS, **_TRANSFORMERS_ARCH_KEYS.get(arch, {})}.items()}
    keys.update({f"tokenizer.ggml.{k}": name for k, name in _TRANSFORMERS_TOKEN_KEYS.items()})
    for key, name in keys.items():
        value = field(reader, key)
        if value is not None:
            values[name] = value
    name = field(reader, "general.name")
    if name is not None:  # that reader writes the model type for the architecture wherever it appears
        values["_model_name_or_path"] = name.replace(arch, model_type)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in values and tokens is not None:
        values["vocab_size"] = len(tokens.data)  # counted, not parsed: 49k strings cost ~0.1 s
    return AutoConfig.for_model(**values, name_or_path=str(path.parent))


def _config_from_keys(reader: Any, arch: str, path: Path) -> "PretrainedConfig":
    """A Granite or SmolLM3 config from the Llama keys llama.cpp writes for both (plus Granite's
    multipliers)."""
    from transformers import AutoConfig

    from tokenmill.models.gguf_rope import fp32_value

    def key(name: str, required: bool = True) -> Any:
        value = field(reader, f"{arch}.{name}")
        if value is None and required:
            raise ValueError(f"GGUF file {path} has no {arch}.{name}, which a {arch} model needs")
        return value

    heads = int(key("attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = key("vocab_size", required=False) or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF file {path} has neither {arch}.vocab_size nor tokenizer.ggml.tokens: the vocabulary "
                         "size is unknown")
    fields: dict[str, Any] = {
        "max_position_embeddings": int(key("context_length")),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", required=False) or heads),
        "rms_norm_eps": fp32_value(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": fp32_value(key("rope.freq_base", required=False) or 10000.0)},
        "vocab_size": int(vocab),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch == "granite":
        for hf_name, gguf_name in _GRANITE_SCALES.items():
            value = key(gguf_name, required=False)
            fields[hf_name] = fp32_value(value) if value else 1.0
    return AutoConfig.for_model(CONFIG_BUILT_HERE[arch], **fields)


def fix_dense_config(config: "PretrainedConfig", reader: Any, path: Path) -> None:
    """Set what transformers' reading leaves out for the families we load (see the module
    docstring): head_dim, biases, Phi-3's rotary width, window and pretraining length, and the rope
    scaling."""
    from tokenmill.models.gguf_rope import rope_scaling_from_gguf

    arch = field(reader, "general.architecture")

    def key(name: str) -> Any:
        return field(reader, f"{arch}.{name}")

    if key("attention.key_length"):
        config.head_dim = int(key("attention.key_length"))
    # No key says whether the projections have biases; the tensors do, as for llama.cpp, which loads
    # whichever bias tensors a file has. (Qwen2 and Qwen2-MoE always bias q/k/v and never o: their
    # classes know, and their attention_bias means something else.)
    names = {t.name for t in reader.tensors}
    for flag, parts in (("attention_bias", ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv")),
                        ("mlp_bias", ("ffn_gate", "ffn_up", "ffn_down"))):
        if arch not in ("qwen2", "qwen2moe") and hasattr(config, flag):
            setattr(config, flag, any(f"blk.0.{part}.bias" in names for part in parts))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    partial = 1.0
    if arch == "phi3":
        rotating = key("rope.dimension_count")
        if rotating and int(rotating) != head_dim:
            partial = int(rotating) / head_dim
        config.partial_rotary_factor = partial
        window = key("attention.sliding_window")
        config.sliding_window = int(window) if window else None  # the converter writes 0 for none
        if key("rope.scaling.original_context_length"):
            config.original_max_position_embeddings = int(key("rope.scaling.original_context_length"))
    else:
        # The file's head size: transformers reads a "llama" file's rope.dimension_count as head_dim.
        file_head_dim = int(key("attention.key_length") or config.hidden_size // config.num_attention_heads)
        _refuse_partial_rotary(key, arch, file_head_dim, path)
    theta = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    scaling = rope_scaling_from_gguf(reader, path, theta, int(head_dim * partial), int(config.max_position_embeddings))
    base = {"rope_type": "default", "rope_theta": theta}
    if partial != 1.0 or "partial_rotary_factor" in rope:
        base["partial_rotary_factor"] = partial
    config.rope_parameters = {**base, **scaling}


def _refuse_partial_rotary(key: Any, arch: str, head_dim: int, path: Path) -> None:
    """llama.cpp rotates the first ``{arch}.rope.dimension_count`` dims of each head (it refuses a
    "llama" file where that is not the whole head). Our other families rotate whole heads, as their
    transformers classes do: a file rotating fewer would run with every head's other dims rotated."""
    rotating = key("rope.dimension_count")
    if rotating is not None and int(rotating) != head_dim:
        raise ValueError(f"GGUF file {path} has {arch}.rope.dimension_count={int(rotating)}, but its heads have "
                         f"{head_dim} dims: rotary over part of each head loads only for general.architecture "
                         "'phi3'; supported: the key absent or equal to the head size")


def fix_moe_config(config: "PretrainedConfig", reader: Any) -> None:
    """Set the MoE fields transformers does not read from a qwen2moe/qwen3moe file (see the module
    docstring); a config of any other model type is left as it is."""
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}.get(getattr(config, "model_type", None))
    if arch is None:
        return

    def key(name: str) -> Any:
        return field(reader, f"{arch}.{name}")

    used = int(key("expert_used_count") or config.num_experts_per_tok)
    dense_width = key("feed_forward_length")
    # llama.cpp's rule when the key is absent (files from before it was written): n_ff / n_expert_used.
    expert_width = key("expert_feed_forward_length") or (int(dense_width) // used if dense_width else None)
    if expert_width is None:
        raise ValueError(f"GGUF has neither {arch}.expert_feed_forward_length nor {arch}.feed_forward_length: "
                         "the experts' intermediate size is unknown")
    config.moe_intermediate_size = int(expert_width)
    if arch == "qwen2moe":
        # llama.cpp's rule when absent: the shared expert is as wide as feed_forward_length.
        shared_width = key("expert_shared_feed_forward_length") or dense_width
        if shared_width is None:
            raise ValueError(f"GGUF has neither {arch}.expert_shared_feed_forward_length nor "
                             f"{arch}.feed_forward_length: the shared expert's intermediate size is unknown")
        config.shared_expert_intermediate_size = int(shared_width)
    config.norm_topk_prob = _NORM_TOPK_PROB[arch]
    # Which layers have experts: llama.cpp's converter writes every layer as sparse, but a file may
    # hold dense MLP blocks (a Qwen3-MoE with mlp_only_layers); a block without a router is one.
    # transformers would assume decoder_sparse_step=1 and no dense layers whatever the tensors say.
    names = {t.name for t in reader.tensors}
    config.decoder_sparse_step = 1
    config.mlp_only_layers = [i for i in range(config.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
