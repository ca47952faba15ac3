"""`tokenmill run --stall-timeout`: a job whose engine stops returning steps (a hung device or
collective) ends with exit code 1 and a message saying so, keeps every row it finished, and a rerun
completes the rest, every row exactly once. The watchdog's rule (the limit, or ten times the
longest step; only steps timed) is checked on a fake clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import by_row, prompts
from tokenmill.batch.stall_watchdog import EXIT_STALLED, StallWatchdog

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watchdog(timeout_s: float) -> tuple[StallWatchdog, FakeClock, list[int]]:
    clock, exits = FakeClock(), []
    return StallWatchdog(timeout_s, stream=open(os.devnull, "w"), exit=exits.append, clock=clock), clock, exits


def test_a_step_past_the_limit_ends_the_process():
    dog, clock, exits = watchdog(60)
    for _ in range(5):
        with dog.step():
            clock.now += 2.0
            dog.check()
    with dog.step():
        clock.now += 59.9
        dog.check()
        assert exits == []
        clock.now += 0.2
        dog.check()
    assert exits == [EXIT_STALLED]


def test_work_between_steps_is_not_timed():
    """Skipping a million finished rows on a resume, or a slow write, is not a hung engine."""
    dog, clock, exits = watchdog(60)
    with dog.step():
        clock.now += 1.0
    clock.now += 10_000.0
    dog.check()
    with dog.step():
        clock.now += 1.0
        dog.check()
    assert exits == []


def test_slow_steps_raise_the_limit():
    dog, clock, exits = watchdog(60)
    with dog.step():  # a 30 s step (a large model on a CPU): the limit becomes 300 s
        clock.now += 30.0
    with dog.step():
        clock.now += 299.0
        dog.check()
        assert exits == [] and dog.limit_s == 300.0
        clock.now += 2.0
        dog.check()
    assert exits == [EXIT_STALLED]


def test_a_job_whose_engine_hangs_exits_1_and_a_rerun_completes_it(tmp_path, tiny_llama_dir):
    """The engine hangs in its 6th step (as a wedged kernel would): the job must end on its own within
    the limit, with the rows of the first steps written, and a rerun must finish every row once."""
    rows = 16
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts(rows, seed=11)])
    output = tmp_path / "out.jsonl"
    script = textwrap.dedent(f"""
        import sys, time
        from tokenmill import LLM
        from tokenmill.batch.job import JobConfig, run_job

        llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", device="cpu", max_model_len=128,
                  kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2, seed=0)
        hang = sys.argv[1] == "hang"
        step, steps = llm.llm_engine.step, []

        def step_that_hangs(*args, **kwargs):
            steps.append(1)
            if hang and len(steps) == 6:
                time.sleep(3600)
            return step(*args, **kwargs)

        llm.llm_engine.step = step_that_hangs
        config = JobConfig(input={str(input_path)!r}, output={str(output)!r}, model="tiny", progress=False,
                           sampling={{"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}},
                           max_inflight=2, fsync_interval=0, stall_timeout=2.0)
        print(run_job(config, llm=llm, stderr=sys.stderr).report(), file=sys.stderr)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.monotonic()
    hung = subprocess.run([sys.executable, "-c", script, "hang"], env=env, capture_output=True, text=True, timeout=300)
    assert hung.returncode == 1, hung.stderr[-2000:]
    assert "an engine step has not returned for" in hung.stderr and "rerun the same command to continue" in hung.stderr
    assert time.monotonic() - started < 120  # ended by the watchdog, not by the test's timeout
    written = read_jsonl(output)
    assert 0 < len(written) < rows and all(r["error"] is None for r in written)
    again = subprocess.run([sys.executable, "-c", script, "run"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    records = by_row(read_jsonl(output))  # each row once
    assert sorted(row for row, _ in records) == list(range(rows))
    assert json.loads((tmp_path / "out.jsonl.tokenmill" / "state.json").read_text())["complete"]


@pytest.mark.slow  # a parent and three replica processes, each loading a model
def test_a_replica_whose_engine_hangs_is_restarted_and_the_job_completes(tmp_path, tiny_llama_dir):
    """With --replicas 2, the first replica to reach its 4th step hangs there (once: a marker file
    says it happened): its watchdog ends it, the parent restarts it like a replica that died, and
    the job finishes with every row once."""
    rows = 16
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts(rows, seed=12)])
    output, marker, hooks = tmp_path / "out.jsonl", tmp_path / "hung-once", tmp_path / "hooks"
    hooks.mkdir()
    # Loaded by every Python process of the job (sitecustomize); only replicas run JobLoop._step.
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import contextlib, os, time
        import tokenmill.batch.loop as loop

        step, calls = loop.JobLoop._step, []

        def step_that_hangs_once(self):
            calls.append(1)
            if len(calls) == 4:
                try:
                    os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    # The engine's step never returns (timed like one when the job has a watchdog).
                    with self.watchdog.step() if self.watchdog is not None else contextlib.nullcontext():
                        time.sleep(3600)
            return step(self)

        loop.JobLoop._step = step_that_hangs_once
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tokenmill.cli", "run", str(input_path), "-o", str(output), "--replicas", "2",
           "--stall-timeout", "2", "--fsync-interval", "0", "--no-progress", "--model", str(tiny_llama_dir),
           "--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--kv-cache-memory-bytes",
           str(8 * 2**20), "--max-num-seqs", "1", "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists() and "an engine step has not returned for" in done.stderr
    assert "died: exit code 1; starting a replacement" in done.stderr
    records = by_row(read_jsonl(output))  # each row once
    assert sorted(row for row, _ in records) == list(range(rows))
