"""vLLM's ``LoRARequest``: which adapter a request runs with (``vllm.lora.request`` becomes
``tokenmill.lora.request``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tokenmill.param_checks import is_integer


@dataclass(eq=False)
class LoRARequest:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) by name and id.

    ``lora_int_id`` identifies the adapter inside the engine (its device slot, ``list_loras``); as in
    vLLM it must be unique per adapter. Two requests are equal when their names are (vLLM's rule).
    ``base_model_name``, ``tensorizer_config_dict`` and ``load_inplace`` are vLLM's fields:
    ``load_inplace=True`` reloads the folder even when the id is already known.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict[str, Any] | None = field(default=None, repr=False)
    load_inplace: bool = False

    def __post_init__(self) -> None:
        # vLLM's LoRARequest (a msgspec Struct) takes any integer, numpy's too (ids read from an array or a
        # DataFrame); stored as a Python int, so list_loras() and the cache keys hold one kind of id.
        if not is_integer(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: must be an integer > 0")
        self.lora_int_id = int(self.lora_int_id)
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: must be a non-empty string")
        if not isinstance(self.lora_path, (str, os.PathLike)):  # was a bare TypeError when the adapter was read
            raise ValueError(f"lora_path={self.lora_path!r:.100} is invalid for LoRA adapter {self.lora_name!r}: must be "
                             "the adapter's folder, a string")
        if not self.lora_path:
            raise ValueError(f"lora_path is empty for LoRA adapter {self.lora_name!r}: give the adapter's folder")
        if self.tensorizer_config_dict is not None:
            raise ValueError("tensorizer_config_dict is not supported: give the adapter as a PEFT folder (lora_path)")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
