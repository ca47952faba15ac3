"""LoRA adapters in `tokenmill run`: the job's adapters (vLLM's ``--lora-modules NAME=PATH``) and
which one each row runs with.

The job serves each adapter under its name, as ``vllm serve --lora-modules`` does: an OpenAI batch
line selects one with ``body.model`` (the base model's name, or no ``model``, means no adapter), a
generic row (JSONL, CSV, Parquet) with its ``lora`` field (empty or missing: the base model). Ids
are 1..N in the order the adapters were given. A row naming an adapter the job does not have is an
error row that names the field, the value and the adapters the job has; the job goes on.

Checked in two places, both before any row runs: the folders exist before the model loads
(`check_lora_modules`, a typo costs a second), and each adapter fits the loaded model (`JobAdapters.
register`, vLLM's ``add_lora`` at start-up: rank, modules, shapes), so a bad adapter is a usage error,
not a file of error rows. Importing this module stays light (stdlib only), like the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from tokenmill.batch.requests import ADAPTER_FIELD, RowError, RowRequest

if TYPE_CHECKING:
    from tokenmill.batch.config import JobConfig
    from tokenmill.lora.request import LoRARequest

OPTION = "--lora-modules"
_SHOWN_NAMES = 20


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """``--lora-modules``' values, ``NAME=PATH`` or vLLM's JSON form ``{"name": ..., "path": ...}``,
    as {name: path} in the order given; a ValueError names the option and the value at fault."""
    modules: dict[str, str] = {}
    for value in values:
        name, path = _parse_one(value)
        if name in modules:
            raise ValueError(f"{OPTION}: the name {name!r} is given twice ({modules[name]!r} and {path!r}); "
                             "each adapter needs a name of its own")
        modules[name] = path
    return modules


def _parse_one(value: str) -> tuple[str, str]:
    text = value.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{OPTION} {value!r} is not valid JSON ({e}); give NAME=PATH or "
                             '{"name": "NAME", "path": "PATH"}') from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError(f'{OPTION} {value!r} needs string fields "name" and "path"')
        # vLLM's base_model_name only says which model an adapter was made for: accepted, as vLLM does.
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{OPTION} {value!r}: field(s) {unknown} are not supported (supported: name, path, "
                             "base_model_name)")
        name, path = spec["name"], spec["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{OPTION} {value!r} is not NAME=PATH (a positional argument after {OPTION} is read as "
                             f"an adapter: put INPUT before {OPTION})")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"{OPTION} {value!r} needs both a name and a path (NAME=PATH)")
    return name, path


def check_lora_modules(config: "JobConfig") -> "JobConfig":
    """The job's adapters checked before the model loads, with absolute paths (replicas and resumed runs
    read the same folders whatever their working directory), and LoRA enabled in the engine options
    (``--lora-modules`` implies ``--enable-lora``). A job without adapters comes back unchanged."""
    if not config.lora_modules:
        return config
    if config.task != "generate":
        raise ValueError(f"{OPTION} is for generation; --task {config.task} runs a pooling model, which takes no "
                         "LoRA adapters")
    if config.engine.get("enable_lora") is False:
        raise ValueError(f"{OPTION} needs LoRA enabled; enable_lora=False contradicts it")
    modules: dict[str, str] = {}
    for name, path in config.lora_modules.items():
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"{OPTION}: {name!r}={path!r} needs a non-empty name and path")
        if name in base_model_names(config.model):  # an OpenAI line naming it would be ambiguous
            raise ValueError(f"{OPTION} {name}={path}: {name!r} is the base model's name (--model {config.model}); "
                             "give the adapter another name")
        full = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(full):
            raise ValueError(f"{OPTION} {name}={path}: {full} is not a folder (a PEFT adapter folder holds "
                             "adapter_config.json and adapter_model.safetensors)")
        if not os.path.isfile(os.path.join(full, "adapter_config.json")):
            raise ValueError(f"{OPTION} {name}={path}: {full} has no adapter_config.json (a PEFT adapter folder "
                             "holds adapter_config.json and adapter_model.safetensors)")
        modules[name] = full
    return dataclasses.replace(config, lora_modules=modules, engine={**config.engine, "enable_lora": True})


def base_model_names(model: str) -> set[str]:
    """The names an OpenAI line may give for the base model: ``--model`` as given, or its last path part
    (a line written for a hub id or a folder names the model without the folder's location)."""
    return {model, os.path.basename(model.rstrip("/\\"))}


class JobAdapters:
    """The job's adapters as LoRARequests (ids 1..N in order) and each row's choice among them."""

    def __init__(self, modules: dict[str, str], base_model: str):
        from tokenmill.lora.request import LoRARequest

        self.requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(modules.items(), start=1)}
        self.base_model, self.base_names = base_model, base_model_names(base_model)

    def register(self, engine: Any) -> None:
        """Check every adapter against the loaded model and read it (vLLM's ``add_lora`` at start-up)."""
        for name, request in self.requests.items():
            try:
                engine.add_lora(request)
            except ValueError as e:
                raise ValueError(f"{OPTION} {name}={request.lora_path}: {_flag_names(str(e))}") from None

    def for_row(self, request: RowRequest, where: str) -> "LoRARequest | None":
        """The adapter ``request`` runs with (None: the base model); RowError for a name the job lacks."""
        name = request.adapter
        if request.openai is not None:
            if name is None or name in self.base_names:
                return None
            field = "body.model"
        elif name is None:
            return None
        else:
            field = repr(ADAPTER_FIELD)
        adapter = self.requests.get(name)
        if adapter is None:
            known = list(self.requests)
            shown = known[:_SHOWN_NAMES] + (["..."] if len(known) > _SHOWN_NAMES else [])
            base = f"the base model ({self.base_model!r}) or " if request.openai is not None else ""
            raise RowError(f"{where}: {field}={name!r} is not a LoRA adapter of this job; it must name {base}one of "
                           f"{shown} ({OPTION})", request.row_id,
                           **({"param": "model", "status": 404} if request.openai is not None else {}))
        return adapter


def no_adapters(request: RowRequest, where: str) -> None:
    """A job without adapters: an OpenAI line's ``body.model`` is ignored (any name runs the job's
    model), but a generic row naming an adapter would silently run the base model, so it fails."""
    if request.openai is None and request.adapter is not None:
        raise RowError(f"{where}: {ADAPTER_FIELD!r}={request.adapter!r} names a LoRA adapter, and this job has none; "
                       f"pass {OPTION} NAME=PATH", request.row_id)


def _flag_names(message: str) -> str:
    """The engine's message speaks of LLM keywords; the command's user sets flags."""
    return f"{message} (max_lora_rank is --max-lora-rank)" if "max_lora_rank" in message else message
