"""How many KV-cache blocks to allocate, and the zero-filled tensors that hold them (`lazy_zeros`).

``num_gpu_blocks_override`` is taken as it is. Otherwise ``kv_cache_memory_bytes`` wins when
given. On a GPU the pool takes what is left of ``gpu_memory_utilization`` of the card after the
weights and a measured peak (``ModelRunner.profile_run``): one forward at the largest step, then a
sampler pass at the most rows a step samples, while the largest per-sequence sampling state the
engine can reach is held (the penalty and logit-bias tables at ``slot_capacity(max_num_seqs)``
rows, 6.125 V bytes a row: ~0.95 GB at V = 151,936 and 1,024 sequences; with the sampler's pass
over the logits, 12-16 V bytes a row more (21 while raw logprobs were one float32 table), ~3-3.8 GB
for sampling there; see ``worker/sampling_profile.py``), so turning those features on late in a
long run finds its memory already set aside. On the CPU the pool defaults to 4 GiB (vLLM's CPU
default); since the tensors are allocated untouched, pages only become resident as tokens are
written, and that pool reuses blocks it has written before touching new ones (engine/kv_cache.py),
so memory follows the work. Either way the pool is never larger than ``max_num_seqs`` full-length
sequences need.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.worker.piecewise_graphs import kept_output_bytes

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 4 * 1024**3


def cpu_spare_bytes(kv_pool_bytes: int, ranks: int = 1) -> int:
    """Host memory one of ``ranks`` CPU ranks may still take for good: what the OS reports as
    available, less every rank's KV pool (allocated untouched, so still counted as available) and
    1 GiB of headroom, shared among the ranks; 0 where the OS does not say."""
    available = _host_available_bytes()
    return max(0, (available - ranks * kv_pool_bytes - 2**30) // ranks) if available else 0


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def choose_num_blocks(config: "EngineConfig", runner: "ModelRunner", prompt_graph_tokens: int = 0) -> int:
    """``prompt_graph_tokens``: the largest prompt step the runner will capture graphs for (0: none);
    their memory pool holds that step's activations for good, so the KV pool leaves room for it."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override  # vLLM's num_gpu_blocks_override: the pool as given, unsized
    per_block = runner.kv_bytes_per_block()
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    enough = config.max_num_seqs * blocks_per_seq + 1  # +1: the null block
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif config.device.type == "cuda":
        budget = _gpu_budget(config, runner, prompt_graph_tokens)
    else:
        budget = CPU_DEFAULT_KV_BYTES
    num_blocks = min(budget // per_block, enough)
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache gets {budget} bytes, less than 2 blocks of {per_block} bytes; "
            "raise kv_cache_memory_bytes or gpu_memory_utilization"
        )
    if num_blocks - 1 < blocks_per_seq:
        logger.warning(
            "the KV cache holds %d tokens, fewer than one max_model_len=%d sequence; long requests will be refused",
            (num_blocks - 1) * config.block_size, config.max_model_len,
        )
    return int(num_blocks)


def _gpu_budget(config: "EngineConfig", runner: "ModelRunner", prompt_graph_tokens: int) -> int:
    device = config.device
    # An LLM the caller dropped keeps its GPU weights until the garbage collector breaks their
    # reference cycles (each parameter's weight_loader is a bound method of its module); collect
    # now, or its bytes would count as ours and shrink this engine's KV pool.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    sampling = runner.profile_run(config.max_num_batched_tokens, config.max_num_seqs, config.max_logprobs)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline  # sampling state included
    # The prompt graphs' pool: the profiled forward's activations, scaled to the largest graph's
    # tokens (activations grow with the token count), held beside every later step's own peak.
    graph_pool = runner.forward_activation_bytes * min(1.0, prompt_graph_tokens / config.max_num_batched_tokens)
    if prompt_graph_tokens:  # and what the graphs keep
        graph_pool += kept_output_bytes(prompt_graph_tokens, runner.hidden_bytes_per_token, runner.lora)
    torch.cuda.empty_cache()
    # Memory other processes hold counts against our share, like vLLM's utilisation setting.
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    ours = config.gpu_memory_utilization * total - used_by_others - torch.cuda.memory_allocated(device)
    # 10% over what was measured or scaled (the forward's and the sampler's working memory, the graph
    # pool), and 256 MB for the allocator; not over the sampling-state tables, which stay allocated at
    # the very size profiled (their growth's transient copy is in the measured part). On a KV-bound run
    # every GiB counts: Qwen3-30B-A3B's P2 requests take ~4% longer with 2.7% less cache (perf.md 92).
    state = sampling.state_bytes
    budget = int(ours - (activation_peak - state + graph_pool) * 1.1 - state) - 256 * 1024**2
    logger.info(
        "GPU memory: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB (the forward's own %.2f; with %.2f GiB "
        "of sampling state in %d slots and a sampler pass over %d rows), prompt-step graphs %.2f GiB, KV cache %.2f GiB",
        total / 2**30, baseline / 2**30, activation_peak / 2**30, runner.forward_activation_bytes / 2**30,
        state / 2**30, sampling.state_rows, sampling.sampler_rows, graph_pool / 2**30, budget / 2**30,
    )
    return max(budget, 0)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor, so a slot read before it is written (the masked tail of a
    block) holds a finite number: a NaN would survive an attention mask.

    On the CPU, numpy's zeros come from calloc: the OS maps zero pages lazily, so a 4 GiB pool is
    instant, where torch.zeros would write every byte (seconds here). A GPU zero-fills 100 GiB in
    tens of milliseconds, so torch.zeros is fine there.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize])
    return torch.from_numpy(raw).view(dtype)
