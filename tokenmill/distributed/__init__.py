"""Tensor parallelism over the GPUs (or CPU processes) of one host; see docs/architecture.md."""
