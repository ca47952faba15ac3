"""`LLM.start_profile` / `stop_profile`: a torch.profiler trace of every rank, like vLLM's.

Profiling is on when ``profiler_config`` names the torch profiler and a folder
(``{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}``, vLLM's fields) or, as in older
vLLM versions, when the environment variable ``VLLM_TORCH_PROFILER_DIR`` names the folder. Each
rank records its own process (CPU activity, and CUDA kernels on a GPU) from ``start_profile`` to
``stop_profile`` and writes a Chrome trace there, ``<prefix>_tp<rank>.<time>.pt.trace.json[.gz]``,
which chrome://tracing, Perfetto or TensorBoard open.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
# vLLM's settings for profiling a window of iterations; tokenmill records everything between
# start_profile and stop_profile, so only their defaults are accepted.
_WINDOW_DEFAULTS = {
    "capture_torch_profiler": False, "detailed_trace_annotation": False, "ignore_frontend": False,
    "delay_iterations": 0, "max_iterations": 0, "warmup_iterations": 0, "active_iterations": 5, "wait_iterations": 0,
}


@dataclass
class ProfilerConfig:
    """vLLM's ProfilerConfig fields (``profiler="cuda"`` and iteration windows are not implemented)."""

    profiler: str | None = None  # "torch", or None: profiling off
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True  # vLLM prints a table; the trace has the same numbers
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    capture_torch_profiler: bool = False
    detailed_trace_annotation: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    def __post_init__(self) -> None:
        if self.profiler not in (None, "torch"):
            raise ValueError(f"LLM(profiler_config={{'profiler': {self.profiler!r}}}) is not supported by tokenmill: "
                             "supported: 'torch' (a torch.profiler trace) or None")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("LLM(profiler_config={'profiler': 'torch'}) needs 'torch_profiler_dir': the folder for the traces")
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError("LLM(profiler_config) has torch_profiler_dir but not profiler='torch'")
        for name, default in _WINDOW_DEFAULTS.items():
            if getattr(self, name) != default:
                raise ValueError(f"LLM(profiler_config={{{name!r}: {getattr(self, name)!r}}}) is not supported by tokenmill: "
                                 f"the trace covers start_profile() to stop_profile() (supported: {default!r})")
        if self.torch_profiler_dir:
            self.torch_profiler_dir = str(Path(self.torch_profiler_dir).expanduser().absolute())


def resolve_profiler_config(value: Any) -> ProfilerConfig | None:
    """The profiler settings of ``LLM(profiler_config=value)``; None when profiling is off."""
    if value is None:
        folder = os.environ.get(PROFILER_DIR_ENV)
        return ProfilerConfig("torch", folder) if folder else None
    if isinstance(value, ProfilerConfig):
        config = value
    else:
        given = value if isinstance(value, dict) else {k: v for k, v in vars(value).items() if not k.startswith("_")}
        known = {f.name for f in dataclasses.fields(ProfilerConfig)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"LLM(profiler_config) has unknown fields {unknown}; known: {sorted(known)}")
        config = ProfilerConfig(**given)
    return config if config.profiler is not None else None


class Profiler:
    """One rank's torch.profiler session."""

    def __init__(self, config: ProfilerConfig, rank: int, on_gpu: bool):
        self.config = config
        self.rank = rank
        self.on_gpu = on_gpu
        self._session: Any = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self, prefix: str | None = None) -> None:
        import torch.profiler as tp

        if self._session is not None:
            raise RuntimeError("start_profile() was called twice without stop_profile() in between")
        config = self.config
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.on_gpu else [])
        Path(config.torch_profiler_dir).mkdir(parents=True, exist_ok=True)
        self._session = tp.profile(
            activities=activities,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=tp.tensorboard_trace_handler(
                config.torch_profiler_dir, worker_name=f"{prefix or 'tokenmill'}_tp{self.rank}",
                use_gzip=config.torch_profiler_use_gzip,
            ),
        )
        self._session.start()

    def stop(self) -> None:
        """Stop recording and write the trace (on a GPU, after the device's queued work is done)."""
        if self._session is None:
            raise RuntimeError("stop_profile() was called without start_profile()")
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()
        session, self._session = self._session, None
        session.stop()  # calls on_trace_ready, which writes the file
