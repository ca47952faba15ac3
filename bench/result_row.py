"""One benchmark result: printed as a JSON line and, when $RESULTS names a file, appended there
(bench/gpu_suite.sh tags those rows with the commit, date and GPU). Our own bench scripts share it;
peer_bench.py and embed_bench.py keep their own copy, being unchanged copies of the shared scripts."""

from __future__ import annotations

import json
import os
from typing import Any


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    if os.environ.get("RESULTS"):
        with open(os.environ["RESULTS"], "a") as f:
            f.write(json.dumps(row) + "\n")
