"""Helpers shared by the tests (and bench/kernels_bench.py), kept out of the installed package.

Imported as ``support``: pytest puts tests/ on sys.path (rootdir conftest, no __init__.py there),
test worker scripts in tests/ get it as their script folder, and bench scripts add it themselves.
Fixtures stay in tests/conftest.py; this package holds the plain code behind them:

- ``tiny_models``: tiny random Hugging Face models and tokenizers (the conftest fixtures save them)
- ``paged_cache``: ``PagedCache``, a model driven step by step like the runner drives it
- ``kernel_cases``: random paged batches and qkv-prologue cases for the kernel tests and benchmark
- ``sampling_cases``: random rows of every filter kind for the sampling kernel tests (wide top-p rows, tail-heavy rows for the argmax rounds)
- ``gpu_kernel_cases``: the GPU kernel tests' head layouts, scheduler steps and tolerances (and their CPU dry run)
- ``seeded_weights``: random weights that are one model at every tensor_parallel_size (a seeded full tensor sliced per rank)
- ``processes``: ``child_pids``, the processes a test left behind
- ``jsonl``: JSON Lines input files and job records for the batch-job tests
- ``eager_graphs``: a CPU stand-in for the decode CUDA graphs (their tensor-parallel mirroring over gloo)
- ``triton_interpreter``: fix-ups of Triton's CPU interpreter (numpy, fp8 rounding) and its dot made
  row-invariant for the deterministic kernels' checks (``TRITON_INTERPRET=1`` only)

HF-transformers reference computations (the oracle the engine is held to) stay in tests/reference.py.
"""
