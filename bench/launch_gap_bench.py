"""What a kernel boundary costs inside a CUDA graph on this GPU, and whether programmatic dependent
launch (PDL) shortens it (docs/perf.md 39-40: PDL on the decode step's kernels gained nothing).

A chain of CHAIN dependent launches, each reading what the one before wrote (``y = x + 1``), is
captured in one CUDA graph and replayed; the time per launch is the kernel's own work plus the
boundary. Kernels of 1 program (the boundary alone) and of 1,024 programs (a norm-sized launch).
Cases: ``triton`` (plain launches), ``triton-pdl`` (Triton's ``launch_pdl``; each kernel waits
for the one before first thing, then lets the next one launch), ``torch-add`` (torch's own
elementwise kernel), ``mm`` (a small cuBLAS GEMM, 64 x 4,096 x 1,024 bf16, chained on nothing),
``triton-after-mm`` (that GEMM then a Triton kernel, as the decode step's norms and SiLU follow
GEMMs; per pair, so the Triton kernel's share is the difference from ``mm``). The chain's final values are checked (CHAIN adds
of 1), so a PDL wait that let a kernel read early would show. One JSON row per case:
    python bench/launch_gap_bench.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from gpu_timing import _provenance, _time_events, _time_graph  # noqa: E402

CHAIN = 200
BLOCK = 1024


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def _chain(case: str, programs: int) -> dict:
    n = programs * BLOCK
    bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)

    def triton_step(src: torch.Tensor, dst: torch.Tensor, pdl: bool) -> None:
        extra = {"launch_pdl": True} if pdl else {}
        _add_one_kernel[(programs,)](src, dst, n, BLOCK=BLOCK, PDL=pdl, num_warps=4, **extra)

    def run() -> None:
        for i in range(CHAIN):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            if case == "torch-add":
                torch.add(src, 1.0, out=dst)
            elif case == "mm":
                torch.mm(a, w)
            elif case == "triton-after-mm":
                torch.mm(a, w)
                triton_step(src, dst, False)
            else:
                triton_step(src, dst, case == "triton-pdl")

    bufs[0].zero_()
    run()
    torch.cuda.synchronize()
    got = bufs[CHAIN % 2]
    if case != "mm" and not torch.equal(got, torch.full_like(got, float(CHAIN))):
        raise SystemExit(f"{case}: the chain's values are wrong (max {got.max().item()}, min {got.min().item()})")
    graph_us, graph_min = _time_graph(run, calls_per_graph=1, replays=20)
    eager_us, _ = _time_events(run, calls=1, repeats=5)
    return {**_provenance("launch_gap", f"{case}-{programs}-programs"), "chain": CHAIN, "programs": programs,
            "us_per_launch_graph": round(graph_us / CHAIN, 3), "us_per_launch_graph_min": round(graph_min / CHAIN, 3),
            "us_per_launch_eager": round(eager_us / CHAIN, 3)}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("launch_gap_bench.py needs a CUDA GPU")
    for programs in (1, 1024):
        for case in ("triton", "triton-pdl", "torch-add", "mm", "triton-after-mm"):
            print(json.dumps(_chain(case, programs)), flush=True)


if __name__ == "__main__":
    main()
