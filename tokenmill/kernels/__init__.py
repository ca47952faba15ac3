"""Kernels: plain-torch twins in ``reference`` (CPU path and test oracle) and Triton kernels in
``kernels.triton`` (imported only on first GPU use, so ``import tokenmill`` never loads triton)."""
