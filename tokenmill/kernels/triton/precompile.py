"""Compiling kernel variants before a run, on several threads at once.

Triton compiles a kernel variant the first time it is launched with a new combination of
compile-time constants and specialisations, and that takes about a second. A variant first met
in the middle of a long job stalls it for that second (P1 lost 1.7 s that way on a fresh
machine). So the runner compiles every variant the engine can launch while ``LLM()`` starts:
the kernel wrappers take ``compile_only=True``, which compiles what the call would launch and
launches nothing, and inside ``parallel_compile()`` those compilations run on a thread pool (the
compiler releases the GIL) and are all done when the block exits.

Compiling is not all a first launch costs: Triton then builds the kernel's launcher, a small C
extension per argument signature that it compiles with the system's C compiler (~0.4 s each;
cached on disk, so only a machine with a cold Triton cache pays), and loads the binary on the
device. ``kernel.warmup`` does neither, so ``parallel_compile`` also loads every kernel it
compiled: the launchers build on the pool, the binaries load on the calling thread's device.
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import triton

from tokenmill.host_cpus import usable_cpus

# The kernels compiled by compile-only launches inside ``parallel_compile`` (None outside it).
_compiled: ContextVar[list[Any] | None] = ContextVar("tokenmill_precompiled", default=None)


def launcher(kernel: triton.JITFunction, grid: tuple[int, ...], compile_only: bool) -> Callable[..., Any]:
    """``kernel[grid]``, or with ``compile_only`` a call that compiles that launch without running it."""
    return functools.partial(_compile, kernel, grid) if compile_only else kernel[grid]


def _compile(kernel: triton.JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    pending = _compiled.get()
    if pending is not None and compiled is not None:
        pending.append(compiled)
    return compiled


@contextlib.contextmanager
def parallel_compile(max_workers: int | None = None) -> Iterator[None]:
    """Compile-only launches inside this block compile concurrently; on exit every one is done
    and loaded, ready to launch."""
    workers = max_workers or min(16, usable_cpus())
    compiled: list[Any] = []
    token = _compiled.set(compiled)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
            with _async_compile(pool):
                yield
            _load(compiled, pool)
    finally:
        _compiled.reset(token)


def _async_compile(pool: Executor) -> contextlib.AbstractContextManager[Any]:
    try:
        # Triton's own hook for concurrent compilation (3.4 and later; not a public module yet).
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton compiles each launch in turn: slower, same result
        return contextlib.nullcontext()
    # ignore_errors: a variant that fails to compile here is simply not cached, and compiles
    # (and raises) where a step launches it, as without this block.
    return AsyncCompileMode(pool, ignore_errors=True)


def _load(compiled: list[Any], pool: Executor) -> None:
    """What a kernel's first launch would do besides compiling: build its launcher (on the pool:
    the C compiler runs as a subprocess) and load its binary on this thread's device. A kernel
    that fails here fails again, with the same error, where a step launches it."""
    from triton.runtime.driver import driver

    # Inside AsyncCompileMode a launch returns a future, resolved (or failed: None) on its exit.
    kernels = [k.result(ignore_errors=True) if hasattr(k, "result") else k for k in compiled]
    kernels = list({id(k): k for k in kernels if k is not None}.values())

    def build_launcher(kernel: Any) -> None:
        with contextlib.suppress(Exception):
            driver.active.launcher_cls(kernel.src, kernel.metadata)  # kept in Triton's disk cache

    list(pool.map(build_launcher, kernels))
    for kernel in kernels:
        with contextlib.suppress(Exception):
            kernel._init_handles()  # finds its launcher in the cache; loads the binary
