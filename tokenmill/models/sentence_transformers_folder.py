"""What a sentence-transformers model folder (one with a ``modules.json``) says about serving it:
an embedder's pooling, normalisation and maximum length, a cross-encoder's activation.

sentence-transformers has written two layouts, and both are read as sentence-transformers reads them:

- before 5.0: the Pooling module's ``pooling_mode_*`` flags, ``max_seq_length`` in
  ``sentence_bert_config.json``, a cross-encoder's activation in config.json (its
  ``sentence_transformers`` section, or ``sbert_ce_default_activation_function``);
- from 5.0: one ``pooling_mode`` name, the maximum length as the tokenizer's ``model_max_length``
  (tokenizer_config.json), a cross-encoder's ``activation_fn`` in ``config_sentence_transformers.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# sentence-transformers' pooling modes -> our pooling types; the others (max, mean_sqrt_len_tokens,
# weightedmean, or several concatenated) are refused.
_POOLING_TYPES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
# The flags of the older Pooling config, each naming one mode (sentence-transformers' own mapping).
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# A tokenizer saved without a maximum length gets transformers' stand-in for "none" (int(1e30)).
_NO_TOKENIZER_LIMIT = 10**12


def is_sentence_transformers_folder(folder: Path | None) -> bool:
    return folder is not None and (folder / "modules.json").is_file()


def has_pooling_module(folder: Path | None) -> bool:
    """Whether the folder is a sentence-transformers embedder: its modules.json has a Pooling module
    (vLLM then runs it as a pooling model whatever its architecture; Qwen3-Embedding's is Qwen3ForCausalLM)."""
    if not is_sentence_transformers_folder(folder):
        return False
    return any(str(module.get("type", "")).rsplit(".", 1)[-1] == "Pooling" for module in _read_json(folder / "modules.json"))


def embedder_settings(folder: Path | None) -> dict[str, Any]:
    """pooling_type, normalize and max_seq_length of a sentence-transformers embedder folder ({} if
    not one).

    Modules we do not implement (Dense projections, other poolings) are refused: the embeddings
    would silently differ from what sentence-transformers computes.
    """
    if not is_sentence_transformers_folder(folder):
        return {}
    found: dict[str, Any] = {"normalize": False}
    for module in _read_json(folder / "modules.json"):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            found["pooling_type"] = _pooling_type(folder / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind != "Transformer":
            raise ValueError(
                f"{folder / 'modules.json'} has a {module.get('type')!r} module; tokenmill implements Transformer, "
                "Pooling and Normalize, so its embeddings would differ from sentence-transformers'"
            )
    length = _max_seq_length(folder)
    if length is not None:
        found["max_seq_length"] = length
    return found


def cross_encoder_activation(folder: Path | None) -> str | None:
    """The activation a cross-encoder's folder names in config_sentence_transformers.json (None:
    none there; config.json's older spellings are read with the config)."""
    if not is_sentence_transformers_folder(folder) or not (folder / "config_sentence_transformers.json").is_file():
        return None
    activation = _read_json(folder / "config_sentence_transformers.json").get("activation_fn")
    return activation if isinstance(activation, str) else None


def _pooling_type(path: Path) -> str:
    config = _read_json(path)
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = list(mode) if isinstance(mode, (list, tuple)) else [mode]
        field = "pooling_mode"
    else:  # all flags off is mean pooling to sentence-transformers
        modes = [name for flag, name in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
        field = "pooling_mode_* flags"
    if len(modes) != 1 or modes[0] not in _POOLING_TYPES:
        raise ValueError(f"{path}: {field} {modes} not supported; supported: one of {sorted(_POOLING_TYPES)}")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{path}: include_prompt=false (pooling without the instruction tokens) is not supported")
    return _POOLING_TYPES[modes[0]]


def _max_seq_length(folder: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length, else (as sentence-transformers >= 5 keeps it) the
    tokenizer's model_max_length."""
    lengths = [(folder / "sentence_bert_config.json", "max_seq_length"), (folder / "tokenizer_config.json", "model_max_length")]
    for path, key in lengths:
        if path.is_file():
            length = _read_json(path).get(key)
            if isinstance(length, int) and not isinstance(length, bool) and 0 < length < _NO_TOKENIZER_LIMIT:
                return length
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
