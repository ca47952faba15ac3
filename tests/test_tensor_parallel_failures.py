"""Tensor parallelism (two ranks over gloo on the CPU) when something goes wrong: the engine's own
start-up failing after its workers started, a worker failing a step, stopping interrupted by a
Ctrl-C. Each case must end in a clear error within seconds and leave no worker process behind.
(Killed workers and the batch job's engine restarts: test_tensor_parallel.py,
test_batch_engine_restart.py.)"""

from __future__ import annotations

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
