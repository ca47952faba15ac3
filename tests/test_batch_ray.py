"""`tokenmill run --ray ADDRESS`: the batch job on Ray actors of the session's local cluster writes
the records a single-process run writes (Parquet here), bad rows included, and resumes after a stop
with every row exactly once; it reads its input as batches go out (not the whole file first), and a
replica killed mid-run is replaced without losing or repeating a row."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tokenmill.batch import job as job_module
from tokenmill.batch import ray_job
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.journal import Journal

WORDS = "the cat sat on a warm mat while wind blew over its fur".split()
SAMPLING = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 16 * 2**20}
ROWS = 30


@pytest.mark.slow
def test_ray_job_matches_a_single_process_run_and_resumes(ray_cluster, tmp_path, tiny_llama_dir):
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 7))} for i in range(ROWS)]
    rows[4] = {"id": "bad", "prompt": "the cat", "sampling_params": {"temperature": -2}}
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{truncated\n")

    def job(output, **extra) -> JobConfig:
        return JobConfig(input=str(input_path), output=str(output), model=str(tiny_llama_dir), sampling=SAMPLING,
                         engine=ENGINE, progress=False, **extra)

    whole = run_job(job(tmp_path / "whole.jsonl"))
    expected = {r["row"]: r for r in map(json.loads, open(tmp_path / "whole.jsonl"))}
    assert whole.failed == 2 and len(expected) == ROWS + 1

    output = tmp_path / "out.parquet"
    journal = tmp_path / "out.parquet.tokenmill" / "journal.jsonl"
    first = run_job(job(output, ray_address="auto", replicas=2),
                    should_stop=lambda: journal.exists() and journal.stat().st_size > 0)  # stop after one batch
    assert first.interrupted and 0 < first.rows_done < ROWS + 1
    second = run_job(job(output, ray_address="auto", replicas=2))
    assert second.complete and second.resumed_rows == first.rows_done and second.rows_done == ROWS + 1
    assert second.failed == 2 and second.exit_code == 3

    records = pq.read_table(output).to_pylist()
    assert sorted(r["row"] for r in records) == list(range(ROWS + 1)), "not every row exactly once"
    for record in records:
        want = expected[record["row"]]
        assert (record["text"], record["error"], record["id"]) == (want["text"], want["error"], str(want["id"]))
    assert "temperature" in next(r for r in records if r["row"] == 4)["error"]


def _replica_pids() -> list[int]:
    """The processes of the job's Ray actors (Ray names them after the actor's class)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ray::JobReplica" in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_ray_job_streams_its_input_and_survives_a_killed_replica(ray_cluster, tmp_path, tiny_llama_dir, monkeypatch):
    """When the first batch is written the driver has read only the batches sent out (two a replica,
    and the next one), not the file: what the driver and Ray's object store hold does not grow with
    the input. Then the replica is killed: Ray starts another, its batches run again, and every row
    is written once."""
    monkeypatch.setattr(ray_job, "_BATCH_ROWS", 4)
    count = 120
    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 5))} for i in range(count)]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read: list[int] = []
    real_read_rows, real_commit = job_module.read_rows, Journal.commit

    def counted_rows(path, fmt, size=None):
        for raw in real_read_rows(path, fmt, size):
            read.append(raw.index)
            yield raw

    read_at_first_commit: list[int] = []
    killed: list[int] = []

    def commit(self, data, done, *args):
        if done and not read_at_first_commit:
            read_at_first_commit.append(len(read))
            for pid in _replica_pids():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return real_commit(self, data, done, *args)

    monkeypatch.setattr(job_module, "read_rows", counted_rows)
    monkeypatch.setattr(Journal, "commit", commit)
    config = JobConfig(input=str(input_path), output=str(tmp_path / "out.jsonl"), model=str(tiny_llama_dir),
                       sampling=SAMPLING, engine=ENGINE, progress=False, ray_address="auto", replicas=1)
    summary = run_job(config)
    assert read_at_first_commit and read_at_first_commit[0] <= 3 * 4, f"read {read_at_first_commit} rows before the first commit"
    assert killed and summary.complete and summary.rows_done == count and summary.failed == 0
    records = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert sorted(r["row"] for r in records) == list(range(count)), "not every row exactly once"


def test_no_cluster_to_join_is_a_usage_error_about_ray(tmp_path, monkeypatch, capsys):
    """`--ray auto` with no Ray cluster running: Ray's ConnectionError is an OSError, which the job took
    for a failed write of its output ("cannot write out.jsonl: ... the `--address` flag")."""
    pytest.importorskip("ray")
    import ray

    from tokenmill.cli import main

    def no_cluster(*args, **kwargs):  # what ray.init raises with no cluster to join (ray 2.60)
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--ray", "auto", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot write" not in err
    assert "--ray auto: found no Ray cluster to join" in err and "--ray local" in err
