"""`tokenmill run` on a tensor-parallel engine (two ranks over gloo on the CPU) that stops for good
mid-job: a worker killed from outside, or a row whose step fails on rank 0 (which stops the workers).
No row may be written as failed because the engine died; an engine the job loaded is replaced and
the job finishes with the text an uninterrupted single-rank run gives; an engine passed in by the
caller ends the job (finished rows kept) and a rerun completes it, every row exactly once."""

from __future__ import annotations

import os
import signal

import pytest

from support.jsonl import read_jsonl, write_jsonl
from support.processes import child_pids
from test_batch_e2e import GREEDY, by_row, prompts, reference
from tokenmill import LLM
from tokenmill.batch.job import EngineFailure, JobConfig, run_job

ROWS = 12
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2)
SAMPLING = {**GREEDY, "max_tokens": 12}


@pytest.fixture(scope="module")
def texts():
    return prompts(ROWS, seed=7)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, texts):
    """What one rank writes for each row: the reference the two-rank runs must reproduce."""
    return reference(LLM(str(tiny_llama_dir), seed=0, **ENGINE), texts, **SAMPLING)


def config(tmp_path, model, texts, **engine):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in texts])
    return JobConfig(input=str(path), output=str(tmp_path / "out.jsonl"), model=str(model), seed=0,
                     engine=engine, sampling=dict(SAMPLING), progress=False)


def kill_workers_at(call: int, before: set[int]):
    """A ``should_stop`` that SIGKILLs the job's worker processes at its ``call``-th poll (once per step)."""
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        if len(polls) == call:
            for pid in child_pids() - before:
                os.kill(pid, signal.SIGKILL)
        return False

    return should_stop


def test_a_killed_worker_of_the_jobs_own_engine_is_replaced_and_no_row_fails(tmp_path, tiny_llama_dir, texts, expected,
                                                                               capsys, monkeypatch):
    import weakref

    from tokenmill.batch import job, job_engine

    loaded, alive_at_load = [], []

    def load_llm(config):  # the job's loader, noting which engines still exist when a new one loads
        alive_at_load.append(sum(ref() is not None for ref in loaded))
        llm = job_engine.load_llm(config)
        loaded.append(weakref.ref(llm.llm_engine.executor.runner))  # it holds the weights and the KV cache
        return llm

    monkeypatch.setattr(job, "load_llm", load_llm)
    before = child_pids()
    summary = run_job(config(tmp_path, tiny_llama_dir, texts, tensor_parallel_size=2, **ENGINE),
                      should_stop=kill_workers_at(3, before))
    assert summary.exit_code == 0 and summary.rows_done == ROWS and summary.failed == 0
    # The dead engine is gone (on a GPU: its weights and KV cache freed) before its replacement loads.
    assert alive_at_load == [0, 0]
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))  # each row once
    assert [records[(i, 0)]["text"] for i in range(ROWS)] == expected
    assert "the engine stopped (WorkerDiedError" in capsys.readouterr().err
    assert child_pids() - before == set()


def test_a_killed_worker_of_a_passed_engine_ends_the_job_without_failing_rows(tmp_path, tiny_llama_dir, texts,
                                                                             expected):
    before = child_pids()
    llm = LLM(str(tiny_llama_dir), seed=0, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(EngineFailure, match=r"engine stopped: WorkerDiedError: .*rank 1 .*SIGKILL"):
        run_job(config(tmp_path, tiny_llama_dir, texts), llm=llm, should_stop=kill_workers_at(3, before))
    # A first attempt that ended before any result was written leaves no output behind (journal.py).
    written = read_jsonl(tmp_path / "out.jsonl") if (tmp_path / "out.jsonl").exists() else []
    assert all(r["error"] is None for r in written)  # the rows in flight were not blamed for the dead engine
    assert child_pids() - before == set()
    # The caller's new engine (one rank: a throughput setting, so the job resumes) finishes the rest.
    summary = run_job(config(tmp_path, tiny_llama_dir, texts), llm=LLM(str(tiny_llama_dir), seed=0, **ENGINE))
    assert summary.exit_code == 0 and summary.resumed_rows == len(written) and summary.rows_done == ROWS
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert [records[(i, 0)]["text"] for i in range(ROWS)] == expected


@pytest.mark.slow  # the bad row is found by halving, and every failed half stops the engine: five two-rank loads
def test_a_row_that_breaks_every_step_fails_alone_on_a_tensor_parallel_engine(tmp_path, tiny_llama_dir, texts, expected,
                                                                              monkeypatch, capsys):
    """On two ranks a model call that fails on rank 0 stops the workers (the ranks are out of step),
    so the row behind it can only be found across engines: each failing half gets a new engine, and
    only that row fails."""
    from tokenmill.models.llama import LlamaModel
    from tokenmill.worker.model_runner import ModelRunner

    execute, forward = ModelRunner.execute, LlamaModel.forward
    poisoned_step = []

    def execute_noting_the_row(self, plan, *args, **kwargs):
        poisoned_step[:] = [any(item.seq.request.request_id == "row-5" for item in plan.scheduled)]
        return execute(self, plan, *args, **kwargs)

    def forward_failing_on_the_row(self, *args, **kwargs):  # inside the mirrored call: the workers are in it too
        if poisoned_step == [True]:
            raise RuntimeError("selected index k out of range")
        return forward(self, *args, **kwargs)

    # Rank 0 only: the workers are other processes.
    monkeypatch.setattr(ModelRunner, "execute", execute_noting_the_row)
    monkeypatch.setattr(LlamaModel, "forward", forward_failing_on_the_row)
    before = child_pids()
    summary = run_job(config(tmp_path, tiny_llama_dir, texts[:8], tensor_parallel_size=2, **ENGINE))
    assert summary.exit_code == 3 and summary.rows_done == 8 and summary.failed == 1
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert "selected index k out of range" in records[(5, None)]["error"]
    assert [records[(i, 0)]["text"] for i in range(8) if i != 5] == [expected[i] for i in range(8) if i != 5]
    assert capsys.readouterr().err.count("the engine stopped (WorkerDiedError") >= 3  # halving 8 rows down to 1
    assert child_pids() - before == set()
