"""Turn the user's ``model=`` string into a concrete set of files to load.

Accepted, in the order they are tried:
1. a local path: an HF folder (config.json + safetensors), a ``.gguf`` file, or a folder plus
   ``gguf_file``;
2. a built-in name (``tokenmill models`` lists them), fetched and converted on first use;
3. a Hugging Face Hub id already present in the local HF cache (nothing is downloaded).
Anything else is a ValueError that lists every place that was looked at.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tokenmill.models.builtin import (BUILTIN_MODELS, ensure_builtin, ensure_gguf_converted, find_builtin, similar_builtin,
                                      stored_dtype)
from tokenmill.param_checks import is_int

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["BUILTIN_MODELS", "ModelSource", "resolve_model"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    config_dir: Path | None  # folder holding config.json; None when the config comes from a GGUF
    weights_format: Literal["safetensors", "pt", "gguf"]
    weights_path: Path | None  # model.safetensors, model.safetensors.index.json or the .gguf; None if absent
    hf_config: "PretrainedConfig"
    tokenizer_path: str  # for AutoTokenizer.from_pretrained(tokenizer_path, **tokenizer_kwargs)
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)  # generation_config.json, {} if absent
    # The open gguf.GGUFReader of weights_path when the config was read from it, so that the weights
    # and the tokenizer reuse it rather than parse the file again (~4 s each for SmolLM2).
    gguf_reader: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # A worker process opens the file itself: the reader's memory map would pickle as the whole file.
        return {**self.__dict__, "gguf_reader": None}


def resolve_model(
    model: str,
    tokenizer: str | None = None,
    revision: str | None = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    device: str = "auto",
    load_format: str = "auto",
) -> ModelSource:
    """``dtype`` and ``device`` (LLM's arguments) choose the dtype a GGUF's cached conversion is
    stored in; ``load_format="gguf"`` reads a GGUF file itself instead of its cached conversion."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model={model!r} must be a non-empty string: a local path, a built-in name or a hub id")
    tried: list[str] = []
    store = None if load_format == "gguf" else stored_dtype(dtype, device)
    path = Path(model).expanduser()
    if path.exists():
        return _from_local(model, path, tokenizer, gguf_file, trust_remote_code, store)
    tried.append(f"local path {str(path.absolute())!r} (does not exist)")

    builtin = find_builtin(model)
    if builtin is not None:
        folder = ensure_builtin(builtin, dtype=store or "float32")
        return _from_local(model, folder, tokenizer, None, trust_remote_code, None)
    meant = similar_builtin(model)
    tried.append(f"built-in models {sorted(BUILTIN_MODELS)} (no match{f'; did you mean {meant!r}?' if meant else ''})")

    if _looks_like_hub_id(model):
        snapshot, reason = _hub_cache_snapshot(model, revision)
        if snapshot is not None:
            return _from_local(model, snapshot, tokenizer, gguf_file, trust_remote_code, store)
        tried.append(f"Hugging Face cache for {model!r} (not found: {reason}; hub downloads are not available)")
    raise ValueError(f"cannot find model {model!r}; tried: " + "; ".join(tried))


def apply_hf_overrides(source: ModelSource, overrides: Any) -> ModelSource:
    """The source with config.json fields replaced (vLLM's ``hf_overrides``): a dict whose values
    replace the config's (a dict given for a nested config updates that config's fields), or a
    function taking the config and returning the one to use."""
    import copy

    config = copy.deepcopy(source.hf_config)
    if callable(overrides):
        config = overrides(config)
        if not hasattr(config, "to_dict"):  # e.g. a function that edits in place and returns nothing
            raise ValueError(f"hf_overrides={overrides!r} returned {type(config).__name__ if config is not None else None}: "
                             "it must return the config (a transformers PretrainedConfig)")
    else:
        _update_config(config, overrides)
    check_config_sizes(config, "hf_overrides")
    return dataclasses.replace(source, hf_config=config)


# The config's sizes our models build tensors from (those in the second group may be unset). A
# string, float, null or 0 there reached torch as a tensor size: a TypeError or IndexError from
# deep inside a model's constructor, naming neither the field nor the file.
_CONFIG_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                 "max_position_embeddings")
_OPTIONAL_CONFIG_SIZES = ("num_key_value_heads", "head_dim")
_ALL_SIZES = (*_CONFIG_SIZES, *_OPTIONAL_CONFIG_SIZES)


def check_config_sizes(config: Any, origin: str | None) -> None:
    """Refuse a size field of ``config`` (a config, or config.json's dict) that is not a positive
    integer, and kv heads that do not divide the heads; ``origin`` names where it came from (its
    config.json, or hf_overrides; None: the caller names it). Fields the config does not have are skipped."""
    fields = config if isinstance(config, dict) else {n: getattr(config, n) for n in _ALL_SIZES if hasattr(config, n)}
    where = f"{origin}: " if origin else ""
    for name in _ALL_SIZES:
        if name not in fields:
            continue
        value = fields[name]
        if value is None and name in _OPTIONAL_CONFIG_SIZES:
            continue
        if not is_int(value) or value < 1:
            raise ValueError(f"{where}{name}={value!r} is invalid: must be an integer >= 1")
    # transformers reads such a config without complaint; the first forward failed inside attention.
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{where}num_key_value_heads={kv_heads} is invalid: it must divide num_attention_heads={heads} "
                         "(each kv head serves a whole group of heads)")


def _update_config(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            _update_config(current, value)  # a nested config (text_config, ...): update its fields
        else:
            setattr(config, key, value)


def _from_local(
    name: str, path: Path, tokenizer: str | None, gguf_file: str | None, trust_remote_code: bool, store: str | None
) -> ModelSource:
    """``store``: the dtype a GGUF that brings its own config is read from its cached conversion in
    (None: read the GGUF itself)."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={name!r} is a file but not a .gguf file; give a model folder or a .gguf file")
        return _gguf_source(name, path, None, tokenizer, trust_remote_code, store)
    if gguf_file is not None:
        gguf_path = Path(gguf_file).expanduser()
        gguf_path = gguf_path if gguf_path.is_absolute() else path / gguf_path
        if not gguf_path.is_file():
            raise ValueError(f"gguf_file={gguf_file!r} not found (looked for {gguf_path})")
        config_dir = path if (path / "config.json").is_file() else None
        return _gguf_source(name, gguf_path, config_dir, tokenizer, trust_remote_code, store)
    if (path / "config.json").is_file():
        return _hf_folder_source(name, path, tokenizer, trust_remote_code)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_source(name, path / ggufs[0], None, tokenizer, trust_remote_code, store)
    if ggufs:
        raise ValueError(f"model folder {path} holds several GGUF files {ggufs}: choose one with gguf_file=")
    raise ValueError(f"model folder {path} has no config.json and no .gguf file")


# A folder's weight files, in the order they are looked for, and their format.
_FOLDER_WEIGHTS = (("model.safetensors.index.json", "safetensors"), ("model.safetensors", "safetensors"),
                   ("pytorch_model.bin.index.json", "pt"), ("pytorch_model.bin", "pt"))


def _hf_folder_source(name: str, folder: Path, tokenizer: str | None, trust_remote_code: bool) -> ModelSource:
    try:
        config = _read_folder_config(folder, trust_remote_code)
    except Exception as exc:  # OSError, JSON errors, transformers' config validators (StrictDataclassError), ...
        raise ValueError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    check_config_sizes(config, str(folder / "config.json"))
    from tokenmill.quantization.config import refuse_modelopt_file

    refuse_modelopt_file(folder, config)
    # safetensors first; PyTorch's pickled checkpoints (older models ship only those) otherwise.
    weights, fmt = next(((folder / candidate, fmt) for candidate, fmt in _FOLDER_WEIGHTS if (folder / candidate).is_file()),
                        (None, "safetensors"))
    return ModelSource(
        name=name,
        config_dir=folder,
        weights_format=fmt,
        weights_path=weights,
        hf_config=config,
        tokenizer_path=_tokenizer_path(tokenizer, folder),
        tokenizer_kwargs={},
        generation_config=_generation_config(folder),
    )


# The config.json fields our decoder models read, per model_type, whose transformers class defaults
# differ from (or are not restated by) the defaults in our model code. A config.json that spells
# all of them out is read as a plain PretrainedConfig: transformers' model-specific config classes
# take about 1.5 s to import (they pull in torch._dynamo), most of LLM()'s start-up on a CPU.
# Anything else, a field missing or a model type not listed, goes through AutoConfig.
_COMMON_FIELDS = (
    "architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
)
_FIELDS_READ_DIRECTLY: dict[str, tuple[str, ...]] = {
    "llama": _COMMON_FIELDS,
    # Qwen's windows: transformers' classes default to use_sliding_window False and a 4096 window.
    "qwen2": (*_COMMON_FIELDS, "use_sliding_window", "sliding_window"),
    "qwen3": (*_COMMON_FIELDS, "head_dim", "use_sliding_window", "sliding_window"),
    "mistral": (*_COMMON_FIELDS, "sliding_window"),
}


def _read_folder_config(folder: Path, trust_remote_code: bool) -> "PretrainedConfig":
    raw = json.loads((folder / "config.json").read_text())
    if not isinstance(raw, dict):  # transformers would only say it has no model_type
        raise ValueError(f"it holds a JSON {type(raw).__name__}, not an object of config fields")
    # Before transformers reads it: its validators fail on some of these with a TypeError of their own.
    check_config_sizes(raw, None)  # the caller names the file
    needed = _FIELDS_READ_DIRECTLY.get(raw.get("model_type"))
    # transformers 4's layout, a top-level rope_theta beside a rope_scaling dict (Llama 3.1's llama3,
    # Qwen2.5's YaRN), needs the model's config class: a plain PretrainedConfig moves the dict to
    # rope_parameters before it has max_position_embeddings, which llama3 and YaRN read (AttributeError).
    has_rope = "rope_parameters" in raw or ("rope_theta" in raw and not raw.get("rope_scaling"))
    if needed and has_rope and "auto_map" not in raw and all(f in raw for f in needed):
        from transformers import PretrainedConfig

        return PretrainedConfig.from_dict(raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)


def tokenizer_class(path: str, kwargs: dict[str, Any]) -> Any:
    """The class AutoTokenizer would build for this folder, without importing its registry (~1.5 s).

    A folder whose tokenizer_config.json names the generic tokenizers-backed class and holds a
    tokenizer.json gets PreTrainedTokenizerFast directly (AutoTokenizer resolves that name to the
    same class); anything else gets AutoTokenizer.
    """
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    if not kwargs and config_file.is_file() and (folder / "tokenizer.json").is_file():
        try:
            named = json.loads(config_file.read_text()).get("tokenizer_class")
        except (ValueError, AttributeError):
            named = None
        if named in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def _gguf_source(
    name: str, gguf_path: Path, config_dir: Path | None, tokenizer: str | None, trust_remote_code: bool,
    store: str | None = None,
) -> ModelSource:
    if config_dir is None and store is not None:  # config, tokenizer and weights all from the GGUF: convert once
        return _hf_folder_source(name, ensure_gguf_converted(gguf_path, store), tokenizer, trust_remote_code)
    from transformers import AutoConfig

    from tokenmill.models.gguf_config import read_gguf_config
    from tokenmill.models.gguf_tokenizer import gguf_generation_ids
    from tokenmill.models.gguf_weights import open_gguf

    folder = config_dir or gguf_path.parent
    generation = _generation_config(folder)
    reader = None
    if config_dir is not None:
        config = AutoConfig.from_pretrained(str(config_dir), trust_remote_code=trust_remote_code)
        check_config_sizes(config, str(config_dir / "config.json"))
    else:
        reader = open_gguf(gguf_path)
        config = read_gguf_config(gguf_path, reader)  # both name the file and what is wrong in it
        generation = {**gguf_generation_ids(reader), **generation}  # as a conversion writes them
    if tokenizer is not None:
        tok_path, tok_kwargs = _tokenizer_path(tokenizer, folder), {}
    elif config_dir is not None and any((config_dir / f).is_file() for f in _TOKENIZER_FILES):
        tok_path, tok_kwargs = str(config_dir), {}
    else:
        tok_path, tok_kwargs = str(gguf_path.parent), {"gguf_file": gguf_path.name}
    return ModelSource(
        name=name,
        config_dir=config_dir,
        weights_format="gguf",
        weights_path=gguf_path,
        hf_config=config,
        tokenizer_path=tok_path,
        tokenizer_kwargs=tok_kwargs,
        generation_config=generation,
        gguf_reader=reader,
    )


def _tokenizer_path(tokenizer: str | None, default: Path) -> str:
    if tokenizer is None:
        return str(default)
    path = Path(tokenizer).expanduser()
    if path.exists():
        return str(path)
    builtin = find_builtin(tokenizer)
    if builtin is not None:
        return str(ensure_builtin(builtin))
    if _looks_like_hub_id(tokenizer):
        snapshot, reason = _hub_cache_snapshot(tokenizer, None)
        if snapshot is not None:
            return str(snapshot)
        raise ValueError(f"tokenizer={tokenizer!r}: not a local path and not in the Hugging Face cache ({reason})")
    raise ValueError(f"tokenizer={tokenizer!r} is not a local path, a built-in name or a cached hub id")


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _hub_cache_snapshot(repo_id: str, revision: str | None) -> tuple[Path | None, str]:
    """A snapshot already in the local Hugging Face cache, or (None, why not)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None, "huggingface_hub is not installed"
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True)), ""
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError, ...
        return None, type(exc).__name__
