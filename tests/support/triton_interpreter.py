"""Fix-ups of Triton's CPU interpreter for the kernel tests that run under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from typing import Any

import torch


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


def patch_triton_interpreter_fp8_rounding() -> None:
    """triton 3.6's interpreter rounds a downcast to float8 e4m3 by adding one to the mantissa
    without carrying into the exponent, so a value that rounds up to the next power of two comes
    out at half of it (31.8 -> 16 instead of 32). Hardware (cvt.rn.satfinite) rounds correctly; so
    does torch, which the patched conversion uses for fp32/fp16 -> e4m3. Only for tests under
    TRITON_INTERPRET=1."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter._convert_float
    if getattr(original, "_tokenmill_patched", False):
        return

    def patched(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16):
            values = torch.from_numpy(np.ascontiguousarray(input).astype(np.float32))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(input, input_dtype, output_dtype, rounding_mode)

    patched._tokenmill_patched = True  # type: ignore[attr-defined]
    interpreter._convert_float = patched
