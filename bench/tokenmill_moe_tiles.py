"""tokenmill whose fused mixture-of-experts GEMMs take their tiles from a rule of
bench/moe_tile_sweep.py's family (a tile per bucket of mean token-expert pairs an expert) instead of
the engine's classes (``fused_moe.tile_classes``), as an engine module for peer_bench.py / moe_peer_bench.py:
``TOKENMILL_MOE_TILES=rule.json PYTHONPATH=bench python bench/moe_peer_bench.py tokenmill_moe_tiles
qwen3-30b-a3b nano``, where rule.json is the sweep's last row. Rows are tagged ``"engine":
"tokenmill_moe_tiles"``; an A/B against ``tokenmill`` in one call measures the rule end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams, __version__
from tokenmill.kernels.triton import fused_moe
from tokenmill.kernels.triton.moe_align import ONE_LAUNCH_MAX_PAIRS

_SOURCE = os.environ["TOKENMILL_MOE_TILES"]
_ROW = json.loads(Path(_SOURCE).read_text() if Path(_SOURCE).is_file() else _SOURCE)
_RULE = [(b.pop("max_pairs_per_expert") or float("inf"), fused_moe.MoeConfig(**b)) for b in (dict(r) for r in _ROW["rule"])]
_engine_choice = fused_moe.choose_config


def _choose_config(num_pairs: int, num_experts: int, dtype: torch.dtype,
                   classes: list[tuple[float, fused_moe.MoeConfig]]) -> fused_moe.MoeConfig:
    if dtype == torch.float32:
        return _engine_choice(num_pairs, num_experts, dtype, classes)
    per_expert = num_pairs / num_experts
    return next(config for edge, config in _RULE if per_expert <= edge)


def _variant_token_counts(classes: list, num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """The fewest tokens of each bucket (its tile), the one-launch alignment's largest call and the
    chunked alignment's smallest."""
    counts, lower = [1], 0.0
    for edge, _ in _RULE:
        first = int(lower * num_experts // top_k) + 1
        if lower and first <= max_tokens:
            counts.append(first)
        lower = edge
    counts.append(min(ONE_LAUNCH_MAX_PAIRS // top_k, max_tokens))
    counts.append(min(ONE_LAUNCH_MAX_PAIRS // top_k + 1, max_tokens))
    return sorted(set(counts))


# fused_experts and precompile_experts look both up in the module at every call: this process's
# engines (no tensor-parallel workers) take the rule.
fused_moe.choose_config = _choose_config
fused_moe.variant_token_counts = _variant_token_counts
__all__ = ["LLM", "SamplingParams", "__version__"]
