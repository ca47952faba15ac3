"""Fix-ups of Triton's CPU interpreter for the kernel tests that run under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


@contextlib.contextmanager
def interpreter_dot_in_fixed_order() -> Iterator[None]:
    """Under TRITON_INTERPRET=1, make ``tl.dot`` compute every row of its output by a call of its own, so
    a row's bits do not depend on its place in the tile or on the other rows.

    A tensor-core MMA computes each element of its tile the same way wherever the element sits; the
    interpreter's dot is a numpy (BLAS) matmul whose rounding depends on the row's place in the tile
    (rows 10-15 of a 16-row fp32 product differ from the same data in rows 0-5). The batch-invariance
    checks of the deterministic kernels need the hardware's property, so they run under this; the
    bits it gives are not the GPU's, only equally independent of a row's place. Tests only.
    """
    import numpy as np
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8 operands: as before
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32, b32 = a.data.astype(np.float32), b.data.astype(np.float32)
        # One product per row: each row's call is the same whatever the other rows hold.
        rows = [np.matmul(a32[..., i : i + 1, :], b32) for i in range(a32.shape[-2])]
        acc = np.concatenate(rows, axis=-2) + d.data.astype(np.float32)
        return interpreter.TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


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
