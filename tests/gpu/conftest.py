"""GPU tests: skipped, not failed, where no CUDA device is visible (the CPU CI runs this folder too).

The check is an autouse fixture, so it applies to this folder only and runs before any test body
imports triton; modules here must import triton (and tokenmill's triton kernels) lazily.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
# The test modules that can run on the CPU interpreter under TOKENMILL_KERNEL_DRYRUN=1.
_DRYRUN_MODULES = ("test_kernels_gpu", "test_paged_attention_gpu", "test_varlen_attention_gpu", "test_qkv_prologue_gpu",
                   "test_sampler_kernel_gpu", "test_deterministic_gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with the whole session's items, not just this folder's: filter by path.
    for item in items:
        if Path(item.path).resolve().is_relative_to(_HERE):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _require_cuda(request: pytest.FixtureRequest) -> None:
    if os.environ.get("TOKENMILL_KERNEL_DRYRUN") == "1" and request.module.__name__.endswith(_DRYRUN_MODULES):
        # Self-check of the GPU tests on the CPU interpreter (see tests/support/gpu_kernel_cases.py).
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TOKENMILL_KERNEL_DRYRUN=1 needs TRITON_INTERPRET=1 as well")
        from support.triton_interpreter import patch_triton_interpreter_for_numpy

        patch_triton_interpreter_for_numpy()
        return
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
