"""`tokenmill run --ray ADDRESS`: the batch job through Ray Data on the session's local cluster writes
the records a single-process run writes (Parquet here), bad rows included, and resumes after a stop
with every row exactly once."""

from __future__ import annotations

import json

import pytest

from tokenmill.batch.job import JobConfig, run_job

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
    first = run_job(job(output, ray_address="auto", replicas=2), should_stop=lambda: True)  # stop after one batch
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
