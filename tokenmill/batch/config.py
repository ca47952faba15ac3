"""What a `tokenmill run` job is: its settings (the job loop, the replicas and the CLI all read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.batch.requests import PromptSettings

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class JobConfig:
    input: str
    output: str
    model: str = DEFAULT_MODEL
    input_format: str = "auto"
    prompt: PromptSettings = field(default_factory=PromptSettings)
    sampling: dict[str, Any] = field(default_factory=dict)  # job-wide SamplingParams values (rows may override)
    seed: int = 0  # per-row seeds derive from it (see requests.row_seed)
    engine: dict[str, Any] = field(default_factory=dict)  # LLM(...) keyword arguments
    chat_template: str | None = None
    overwrite: bool = False
    max_inflight: int | None = None
    fsync_interval: float = 1.0
    progress: bool = True
    log_interval: float = 10.0
    task: str = "generate"  # or a pooling task: "embed", "classify", "score" (see batch/pooling.py)
    pooling: dict[str, Any] = field(default_factory=dict)  # job-wide PoolingParams values (rows may override)
    replicas: int = 1  # engine processes on this host (batch/replicas.py), or Ray replicas with ray_address
    ray_address: str | None = None  # run on a Ray cluster, one engine per Ray actor (batch/ray_job.py)
    # End the process when no engine step returns for this long (batch/stall_watchdog.py); 0: never.
    # Off for the Python API (the process is the caller's); `tokenmill run` sets 600 s.
    stall_timeout: float = 0.0
    # LoRA adapters by name -> PEFT folder (--lora-modules; ids 1..N in this order), served under their
    # names: rows pick one (batch/lora_modules.py). Implies engine enable_lora.
    lora_modules: dict[str, str] = field(default_factory=dict)
