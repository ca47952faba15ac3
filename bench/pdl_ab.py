"""One peer_bench run with programmatic dependent launch off or on (docs/perf.md 39), for an A/B in
one lease: ``python bench/pdl_ab.py off|on ENGINE SHAPE WORKLOAD`` (ENGINE: tokenmill or
tokenmill_fp8). The row peer_bench appends to $RESULTS gets ``"variant": "pdl-off"|"pdl-on"``."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from tokenmill.kernels.triton import dependent_launch


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode not in ("off", "on"):
        raise SystemExit(f"first argument must be off or on, got {mode!r}")
    dependent_launch.ENABLED = mode == "on"
    results = Path(os.environ["RESULTS"])
    before = results.read_text().count("\n") if results.exists() else 0
    sys.argv = ["peer_bench.py", *args]
    runpy.run_path(str(Path(__file__).with_name("peer_bench.py")), run_name="__main__")
    lines = results.read_text().splitlines()
    rows = [json.loads(line) | {"variant": f"pdl-{mode}"} if i >= before and line.startswith("{") else line
            for i, line in enumerate(lines)]
    results.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
