"""Errors no request is to blame for: the device failed (out of memory, a CUDA fault) or the
engine's tensor-parallel workers are gone.

The batch job stops (or restarts the engine) on them instead of blaming a row, and the engine lets
them through where it would otherwise fail only the requests behind an error (an adapter that
cannot be loaded).
"""

from __future__ import annotations


def is_device_failure(error: BaseException) -> bool:
    import torch

    fatal = (MemoryError, torch.cuda.OutOfMemoryError, getattr(torch, "AcceleratorError", MemoryError))
    return isinstance(error, fatal) or "CUDA error" in str(error)


def is_engine_stopped(error: BaseException) -> bool:
    """The engine can run nothing more: its tensor-parallel workers are gone or were stopped."""
    from tokenmill.distributed.worker_processes import WorkerDiedError

    return isinstance(error, WorkerDiedError)


def drop_tracebacks(error: BaseException | None) -> None:
    """Forget the tracebacks of ``error`` and the exceptions it chains: a step's frames reference
    the engine that raised it, which must be freed before another is loaded (the message is kept)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
