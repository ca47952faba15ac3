"""The sampling defaults a model ships in its generation_config.json (vLLM's ``generation_config``).

    LLM(folder).get_default_sampling_params()   # e.g. SamplingParams(temperature=0.6, top_p=0.9)

``generation_config="auto"`` reads the model's own file, a folder reads that folder's, "vllm"
none; ``override_generation_config`` is laid over either. A value SamplingParams refuses is
reported with where it came from: the user passed no SamplingParams to blame.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.sampling_params import SamplingParams

# generation_config.json keys that map onto SamplingParams fields (vLLM's generation_config="auto"
# and override_generation_config).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_sampling_params(generation_config: str, models_file: dict[str, Any],
                            overrides: dict[str, Any] | None) -> SamplingParams:
    """SamplingParams from ``generation_config`` ("auto": ``models_file``, the model's
    generation_config.json; "vllm": nothing; else a folder holding one) with ``overrides`` over it."""
    if generation_config == "auto":
        found, source = dict(models_file), "the model's generation_config.json"
    elif generation_config == "vllm":
        found, source = {}, "vLLM's defaults"
    else:
        path = Path(generation_config) / "generation_config.json"
        found, source = _read(path, generation_config), str(path)
    found.update(overrides or {})
    if overrides:
        source += " with override_generation_config"
    # As vLLM: the sampling fields only. do_sample is transformers' switch; a generation_config
    # with do_sample false and a temperature still samples at that temperature in vLLM.
    fields = {field: found[key] for key, field in GENERATION_CONFIG_FIELDS.items() if found.get(key) is not None}
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the default sampling settings from {source} are invalid: {exc}") from exc


def _read(path: Path, folder: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config={folder!r}: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"generation_config={folder!r}: {path} holds a JSON {type(data).__name__}, not an object")
    return data
