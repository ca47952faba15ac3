"""A fix-up of Triton's CPU interpreter for the kernel tests that run under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from typing import Any


def patch_triton_interpreter_for_numpy() -> None:
    """numpy >= 2.4 refuses int() of a 1-element array, which triton 3.6's interpreter does for
    ``range(lo, hi)`` with run-time bounds (triton-lang/triton#9171, fixed upstream by #9172).
    Wrap its tensor patching so ``__index__`` takes the element explicitly (harmless where triton
    is fixed; skipped with an older numpy). Only for tests under TRITON_INTERPRET=1."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor
    if getattr(original, "_tokenmill_patched", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tokenmill_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
