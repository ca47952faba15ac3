"""How the GPU benchmarks time a call and label a result row (kernels_bench.py and the others
import these): CUDA-graph replays for capturable calls, CUDA events around eager calls for the rest,
and the provenance fields (bench, case, GPU, versions, commit, date) that lead every JSON row.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch


def _commit() -> str:
    if os.environ.get("TOKENMILL_COMMIT"):
        return os.environ["TOKENMILL_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _provenance(bench: str, label: str) -> dict[str, Any]:
    """The leading fields of every JSON row: what was measured, where, and at which commit."""
    return {
        "bench": bench,
        "case": label,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "commit": _commit(),
        "date": datetime.date.today().isoformat(),
    }


def _time_graph(fn: Any, calls_per_graph: int = 10, replays: int = 30) -> tuple[float, float]:
    """Median and min microseconds per call, from CUDA-graph replays of ``calls_per_graph`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    return statistics.median(times), min(times)


def _time_events(fn: Any, calls: int = 10, repeats: int = 10) -> tuple[float, float]:
    """Median and min microseconds per call, from CUDA events around ``calls`` eager calls (for code
    that syncs or allocates per call and so cannot be captured in a graph)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), min(times)
