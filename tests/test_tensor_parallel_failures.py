"""Tensor parallelism (two ranks over gloo on the CPU) when something goes wrong: the engine's own
start-up failing after its workers started, a worker failing a step, a Ctrl-C inside a step.
Each case must end in a clear error within seconds and leave no worker process behind.
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
