"""The Hugging Face config of a GGUF file: transformers' reading of its metadata, plus what that
reading leaves wrong for the mixture-of-experts architectures we load.

transformers (5.x, ``integrations/ggml.py``) maps ``qwen2moe``/``qwen3moe`` metadata to
``qwen2_moe``/``qwen3_moe`` configs but reads only ``expert_count`` and ``expert_used_count`` of
the MoE keys. Everything else falls back to the config class's defaults, which describe
Qwen1.5-MoE-A2.7B / Qwen3-30B-A3B rather than the file: ``moe_intermediate_size`` (1408 / 768)
and ``shared_expert_intermediate_size`` (5632) would give experts of the wrong width. We set them
(and the fields llama.cpp's graphs fix without a key) from the file, the way llama.cpp reads it.
"""

from __future__ import annotations

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


def read_gguf_config(gguf_path: Path, reader: Any) -> "PretrainedConfig":
    """transformers' config for the GGUF at ``gguf_path`` (``reader``: its open_gguf reader), fixed
    up where transformers' reading differs from the model the file holds."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fix_moe_config(config, reader)
    return config


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
