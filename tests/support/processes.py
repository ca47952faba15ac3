"""Which processes a test left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any


def child_pids() -> set[int]:
    """This process's live or unreaped children (read from /proc: zombies count too)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.add(int(entry.name))
    return found


def check_worker_killed_during_generate(llm: Any, greedy: Any, before: set[int]) -> None:
    """SIGKILL rank 1 of a two-rank ``llm`` on rank 0 between two steps (from a logits processor):
    the generate call must raise a RuntimeError naming the rank and the signal within 5 s, later
    calls must fail at once, and no child process beyond ``before`` may be left."""
    import pytest

    (worker,) = [proc.pid for proc in llm.llm_engine.executor.workers.procs]
    calls, started = [], []

    def kill_on_fourth_token(token_ids, logits):
        calls.append(1)
        if len(calls) == 4:
            started.append(time.monotonic())
            os.kill(worker, signal.SIGKILL)
        return logits

    params = greedy.clone(max_tokens=64, logits_processors=[kill_on_fourth_token])
    with pytest.raises(RuntimeError, match=r"rank 1 .*SIGKILL"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert time.monotonic() - started[0] < 5.0
    with pytest.raises(RuntimeError, match="cannot run more steps"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)
    assert child_pids() - before == set()
