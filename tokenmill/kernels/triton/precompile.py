"""Compiling kernel variants before a run, on several threads at once.

Triton compiles a kernel variant the first time it is launched with a new combination of
compile-time constants and specialisations, and that takes about a second. A variant first met
in the middle of a long job stalls it for that second (P1 lost 1.7 s that way on a fresh
machine). So the runner compiles every variant the engine can launch while ``LLM()`` starts:
the kernel wrappers take ``compile_only=True``, which compiles what the call would launch and
launches nothing, and inside ``parallel_compile()`` those compilations run on a thread pool (the
compiler releases the GIL) and are all done when the block exits.
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import triton


def launcher(kernel: triton.JITFunction, grid: tuple[int, ...], compile_only: bool) -> Callable[..., Any]:
    """``kernel[grid]``, or with ``compile_only`` a call that compiles that launch without running it."""
    return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]


@contextlib.contextmanager
def parallel_compile(max_workers: int | None = None) -> Iterator[None]:
    """Compile-only launches inside this block compile concurrently; on exit every one is done."""
    try:
        # Triton's own hook for concurrent compilation (3.4 and later; not a public module yet).
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton compiles each launch in turn: slower, same result
        yield
        return
    workers = max_workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
        # ignore_errors: a variant that fails to compile here is simply not cached, and compiles
        # (and raises) where a step launches it, as without this block.
        with AsyncCompileMode(pool, ignore_errors=True):
            yield
