"""The fused mixture-of-experts layer (``kernels/triton/fused_moe.fused_experts``) against a
per-expert torch loop, on one layer's experts in bf16.

Shapes: Qwen3-30B-A3B (H 2048, I 768, 128 experts, top 8) and Mixtral-8x7B (H 4096, I 14336,
8 experts, top 2), at T = 1 to 8192 tokens with random routing (a router's softmax top-k over
random logits). Each row gives, in µs per call:
- ``fused_us``: ``fused_experts`` with the engine's tiles, timed by CUDA-graph replays (what a
  decode step runs); ``fused_eager_us``: the same call launched eagerly (its ~20 small alignment
  launches and the GEMMs' launch costs show up here);
- ``fp8_weights_us``: the same call on fp8 codes with per-channel scales (``quantization="fp8"``'s
  experts: half the weight bytes);
- ``small_tiles_us`` / ``large_tiles_us``: the smallest and largest of ``tile_classes`` at every T
  (``bench/moe_tile_sweep.py`` times every candidate), ``align_us``: ``moe_align`` alone (one
  launch up to 8,192 pairs), ``align_torch_us``: its torch way at the same size (where the two cross
  is where ``ONE_LAUNCH_MAX_PAIRS`` belongs);
- ``loop_us``: the model's CPU path run on the GPU (``models/layers/moe.experts_by_loop``: pairs
  grouped by expert, counts read on the host, then per expert ``F.linear`` for gate_up, SiLU-mul,
  ``F.linear`` for down, routing weight, ``index_add_``), timed by CUDA events around eager calls
  (it reads the counts back, so no graph can hold it);
- TFLOP/s (6 T K H I flops) and weight GB/s (the bytes of the experts the routing touches, each
  read once) of the fused call.
Every timed call cycles through ROUTINGS routings, so consecutive calls touch different experts
and weights come from HBM rather than L2. The fused output is checked against the loop first.
One JSON row per (model, T) on stdout.
    python bench/moe_bench.py [qwen3-30b-a3b] [mixtral-8x7b]
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # gpu_timing, tokenmill
from gpu_timing import _provenance, _time_events, _time_graph  # noqa: E402

from tokenmill.kernels.triton import fused_moe  # noqa: E402
from tokenmill.kernels.triton.moe_align import _moe_align_torch  # noqa: E402
from tokenmill.models.layers.moe import experts_by_loop as loop_experts  # noqa: E402  (the CPU path's loop)

MODELS = {  # name: (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
ROUTINGS = 4


def _routings(tokens: int, experts: int, top_k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    routings = []
    for _ in range(ROUTINGS):
        probs = torch.softmax(torch.randn(tokens, experts, device="cuda"), dim=-1)
        weights, ids = probs.topk(top_k, dim=-1)
        routings.append(((weights / weights.sum(dim=-1, keepdim=True)).contiguous(), ids.contiguous()))
    return routings


def _cycled_graph(calls: list, per_graph: int) -> float:
    """Median µs per call of ``calls`` run in turn, ``per_graph`` rounds of them a graph replay."""
    median, _ = _time_graph(lambda: [c() for c in calls], calls_per_graph=per_graph)
    return median / len(calls)


def _cycled_events(calls: list, rounds: int) -> float:
    median, _ = _time_events(lambda: [c() for c in calls], calls=rounds, repeats=5)
    return median / len(calls)


def bench(model: str) -> None:
    hidden, inter, experts, top_k = MODELS[model]
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    expert_bytes = 3 * hidden * inter * w13.element_size()
    # quantization="fp8"'s experts: the same weights as codes and per-output-channel scales.
    from tokenmill.quantization.fp8 import quantize_rows

    (q13, s13), (q2, s2) = quantize_rows(w13), quantize_rows(w2)
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        routings = _routings(tokens, experts, top_k)
        want = loop_experts(x, w13, w2, *routings[0])
        got = fused_moe.fused_experts(x, w13, w2, *routings[0])
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2)
        # Fewer calls a graph replay as calls grow long (Mixtral's experts at 8192 tokens: ~10 ms).
        per_graph = 10 if tokens <= 512 else 2
        auto = fused_moe.choose_config(tokens * top_k, experts, x.dtype, fused_moe.tile_classes(hidden, inter, False))

        def fused(config: fused_moe.MoeConfig | None = None) -> list:
            return [lambda w=w, i=i: fused_moe.fused_experts(x, w13, w2, w, i, config=config) for w, i in routings]

        fused_us = _cycled_graph(fused(), per_graph)
        small_us = _cycled_graph(fused(fused_moe.SMALL_TILES), per_graph)
        large_us = _cycled_graph(fused(fused_moe.LARGE_TILES), per_graph)
        align_us = _cycled_graph([lambda i=i: fused_moe.moe_align(i, experts, auto.block_m) for _, i in routings], 10)
        align_torch_us = _cycled_graph([lambda i=i: _moe_align_torch(i, experts, auto.block_m) for _, i in routings], 10)
        fp8_us = _cycled_graph([lambda w=w, i=i: fused_moe.fused_experts(x, q13, q2, w, i, w13_scale=s13, w2_scale=s2)
                                for w, i in routings], per_graph)
        eager_us = _cycled_events(fused(), 3)
        loop_us = _cycled_events([lambda w=w, i=i: loop_experts(x, w13, w2, w, i) for w, i in routings], 3)
        touched = sum(int(i.unique().numel()) for _, i in routings) / len(routings)  # experts a call reads
        flops = 6 * tokens * top_k * hidden * inter
        row = {**_provenance("fused_moe", f"{model}-t{tokens}"), "tokens": tokens, "hidden": hidden, "inter": inter,
               "experts": experts, "top_k": top_k, "config": dataclasses.asdict(auto), "fused_us": round(fused_us, 2),
               "fused_eager_us": round(eager_us, 2), "small_tiles_us": round(small_us, 2), "large_tiles_us": round(large_us, 2),
               "align_us": round(align_us, 2), "align_torch_us": round(align_torch_us, 2), "fp8_weights_us": round(fp8_us, 2), "loop_us": round(loop_us, 2), "speedup_vs_loop": round(loop_us / fused_us, 2),
               "tflops": round(flops / fused_us / 1e6, 1), "experts_touched": touched,
               "weight_gbps": round(touched * expert_bytes / fused_us / 1e3, 1)}
        print(json.dumps(row), flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("moe_bench.py needs a CUDA GPU")
    names = [a for a in sys.argv[1:] if a in MODELS] or list(MODELS)
    for name in names:
        bench(name)


if __name__ == "__main__":
    main()
