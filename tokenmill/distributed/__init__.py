"""Tensor parallelism over the GPUs (or CPU processes) of one host; see docs/architecture.md."""


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's clean-up after ``del llm``: collect the engines no longer referenced (their worker
    processes stop with them; tokenmill never touches torch.distributed's global group) and give
    the GPU memory they held back to the device. ``shutdown_ray``: tokenmill starts no Ray."""
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
