"""Tensor parallelism (two ranks over gloo on the CPU) when something goes wrong: the engine's own
start-up failing after its workers started, a worker failing or hanging in a step, a Ctrl-C
inside a step, SIGTERM to a tensor-parallel batch job. Each case must end in a clear error within
a bounded time and leave no worker process behind.
(Killed workers and the batch job's engine restarts: test_tensor_parallel.py,
test_batch_engine_restart.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from support.processes import child_pids
from tokenmill import LLM, SamplingParams

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=8 * 2**20, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_an_engine_failing_after_its_workers_started_stops_them(tiny_llama_dir, monkeypatch):
    """LLMEngine.__init__ raising after the Executor started the workers (here its metrics) must stop
    them before the error leaves: the error's traceback holds the half-built engine, so waiting for
    it to be collected leaves the workers running as long as the caller keeps the error."""
    from tokenmill.engine import engine

    def broken_metrics(config):
        raise RuntimeError("metrics could not start")

    monkeypatch.setattr(engine, "_start_metrics", broken_metrics)
    before = child_pids()
    with pytest.raises(RuntimeError, match="metrics could not start") as raised:
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    assert raised.value.__traceback__ is not None  # still held, as a notebook's last error is
    assert child_pids() - before == set()


# In every fresh interpreter of the test (only the worker here): joining the process group fails,
# after the worker told rank 0 it was about to join (as a GPU that cannot take one more CUDA context would).
JOIN_FAILS = """
import tokenmill.distributed.process_group as process_group

def create_group(*args, **kwargs):
    raise RuntimeError("CUDA error: out of memory (the worker's own error)")

process_group.create_group = create_group
"""


def test_a_worker_failing_to_join_the_group_is_named_with_its_error(tiny_llama_dir, tmp_path, monkeypatch):
    """Rank 0 is then inside its own join, which waits out the collective timeout (5 minutes; 2 s
    here) for the missing rank; the error that follows must be the worker's, which it reported on
    its pipe, not only the store's "wait timeout" that says nothing of why."""
    from datetime import timedelta

    from tokenmill.distributed import process_group

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(JOIN_FAILS)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    monkeypatch.setattr(process_group, "COLLECTIVE_TIMEOUT", timedelta(seconds=2))
    before = child_pids()
    with pytest.raises(RuntimeError, match=r"(?s)start-up failed on tensor-parallel rank 1:.*the worker's own error"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    assert child_pids() - before == set()


def _explode_on_rank1(worker) -> None:
    """A layer of rank 1 that raises: the worker fails the mirrored forward and exits."""
    if worker.rank == 1:
        def explode(*args, **kwargs):
            raise ValueError("layer 0 exploded on rank 1")

        worker.model.model.layers[0].mlp.forward = explode


def test_a_worker_failing_a_step_is_named_with_its_error(tiny_llama_dir):
    """The error names the rank and what failed there (the worker's exception, not only its exit
    code: its traceback is on the worker's stderr, far from the error in a long job's log), arrives
    within seconds and leaves no process. (A new engine after a dead one, in the same process:
    test_batch_engine_restart.py.)"""
    from tokenmill.distributed.worker_processes import WorkerDiedError

    before = child_pids()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    llm.collective_rpc(_explode_on_rank1)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*exit code 1.*ValueError: layer 0 exploded on rank 1"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 5.0
    assert child_pids() - before == set()


def _hang_on_rank1(worker) -> None:
    """A layer of rank 1 that sleeps for a minute: rank 0 waits for it inside the forward's all-reduce."""
    if worker.rank == 1:
        def hang(*args, **kwargs):
            time.sleep(60)

        worker.model.model.layers[0].mlp.forward = hang


def test_a_worker_hung_inside_a_step_fails_it_after_the_collective_timeout(tiny_llama_dir, monkeypatch):
    """A rank alive but stuck (here for a minute; a wedged driver, a deadlock) is not waited for
    forever: rank 0's collective gives up after COLLECTIVE_TIMEOUT (5 minutes; 2 s here), the step
    fails with an error saying so, and the stuck worker is stopped, not left behind."""
    from datetime import timedelta

    from tokenmill.distributed import process_group
    from tokenmill.distributed.worker_processes import WorkerDiedError

    monkeypatch.setattr(process_group, "COLLECTIVE_TIMEOUT", timedelta(seconds=2))  # rank 0's, which waits
    before = child_pids()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    llm.collective_rpc(_hang_on_rank1)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?i)tensor-parallel step failed on rank 0: .*timed out"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 15.0
    assert child_pids() - before == set()


def _interrupt_rank0_inside_its_forward(llm: LLM, interrupts: int) -> None:
    """Rank 0's next forward sends this process ``interrupts`` SIGINTs (Ctrl-C) from inside the
    mirrored call, where rank 1 is in the same forward, between the two ranks' collectives."""
    layer = llm.llm_engine.executor.driver.model.model.layers[0].mlp
    forward = layer.forward

    def interrupted(*args, **kwargs):
        del layer.forward  # once
        for _ in range(interrupts):
            os.kill(os.getpid(), signal.SIGINT)
        return forward(*args, **kwargs)

    layer.forward = interrupted


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (SIG_IGN under `cmd &`), put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_step_keeps_the_llm_usable(tiny_llama_dir, default_sigint):
    """Ctrl-C lands while rank 0 is inside a mirrored forward (most of a step's time): it stops the
    call as on one rank, and the same LLM then generates as Hugging Face does (the interrupt waited
    for the ranks to finish the forward together, instead of leaving rank 1 in a collective and
    the workers stopped for good)."""
    from reference import hf_greedy, hf_model

    before = child_pids()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    try:
        _interrupt_rank0_inside_its_forward(llm, interrupts=1)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        tokens = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.executor.shutdown()
    assert tokens == hf_greedy(hf_model(str(tiny_llama_dir)), [5, 6, 7], GREEDY.max_tokens)[0]
    assert child_pids() - before == set()


def test_a_second_ctrl_c_inside_a_step_stops_it_at_once(tiny_llama_dir, default_sigint):
    """A step whose collective hangs stays interruptible: the second Ctrl-C is not held. The ranks
    are then out of step, so the workers are stopped and the LLM says it cannot go on."""
    from tokenmill.distributed.worker_processes import WorkerDiedError

    before = child_pids()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **OPTIONS)
    _interrupt_rank0_inside_its_forward(llm, interrupts=2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert child_pids() - before == set()
    with pytest.raises(WorkerDiedError, match="a tensor-parallel step was interrupted.*cannot run more steps"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)


@pytest.mark.slow  # a fresh interpreter loading two ranks, then a first committed row: ~15 s on 2 cores
def test_sigterm_to_a_tensor_parallel_job_keeps_its_rows_and_leaves_no_worker(tmp_path, tiny_llama_dir):
    """`tokenmill run --tensor-parallel-size 2` in its own process (a hang fails on the timeouts
    here rather than hanging the suite): SIGTERM once a row is committed stops it after the step,
    with exit code 130, the committed rows whole and each once, and its worker process gone."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from support.jsonl import write_jsonl

    rows = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"the cat sat on mat {i}"} for i in range(200)])
    output = tmp_path / "out.jsonl"
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "tokenmill.cli", "run", str(rows), "-o", str(output), "--model", str(tiny_llama_dir),
           "--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--kv-cache-memory-bytes", str(8 * 2**20),
           "--max-num-seqs", "2", "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "--no-progress",
           "--fsync-interval", "0", "--tensor-parallel-size", "2"]
    job = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(repo)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and output.read_bytes().endswith(b"\n")):
            assert job.poll() is None and time.monotonic() < deadline, "the job committed no row"
            time.sleep(0.02)
        workers = _children(job.pid)
        assert len(workers) == 1
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 130, err
    assert "interrupted" in err and "rerun the same command" in err
    deadline = time.monotonic() + 10
    while any(_state(pid) not in "ZX" for pid in workers):  # reparented once the job exited: watched by pid
        assert time.monotonic() < deadline, f"worker {workers} outlived its job"
        time.sleep(0.05)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert written and len({r["row"] for r in written}) == len(written) < 200
    assert all(r["error"] is None and r["completion_tokens"] == 8 for r in written)


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _state(int(entry), parent=pid) not in "ZX":
            found.append(int(entry))
    return found


def _state(pid: int, parent: int | None = None) -> str:
    """The process's state letter; "X" when it is gone (or, with ``parent``, not that parent's child)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return "X"
    return fields[0] if parent is None or int(fields[1]) == parent else "X"
