"""`tokenmill run --deterministic` killed at random moments and resumed writes exactly the lines of an
uninterrupted run: the same rows, texts and logprobs bit for bit (in completion order, which depends
on timing, so the files are compared line by line after sorting). Sampled rows (seeded per row by
the job) and greedy ones, chunked prefill, shared prefixes and small batches whose size changes from
attempt to attempt, in bf16 on the CPU.

The journal records the mode: a resume that does not repeat the flag stays deterministic, and one
that asks for --no-deterministic is refused.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_batch_resume import lines_in, wait_until

REPO = Path(__file__).resolve().parents[1]
ROWS = 64  # ~140 rows/s here: rows enough left after the SIGTERM's kill point that it lands before the end
WORDS = "a light rain fell on the quiet town while the old clock struck nine and dogs barked".split()


def command(input_path: Path, output: Path, model: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tokenmill.cli", "run", str(input_path), "-o", str(output), "--fsync-interval", "0",
        "--no-progress", "--model", str(model), "--dtype", "bfloat16", "--device", "cpu", "--max-model-len", "192",
        "--kv-cache-memory-bytes", str(16 * 2**20), "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
        "--max-tokens", "7", "--temperature", "0.8", "--logprobs", "1", "--ignore-eos", *extra,
    ]


def start(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # seven engine starts in subprocesses (without --deterministic, 61 of the 64 lines differ at 2 and 4 seqs)
def test_killed_and_resumed_deterministic_run_writes_the_uninterrupted_lines(tmp_path, tiny_qwen3_dir):
    rng = random.Random(2024)
    rows = []
    for i in range(ROWS):
        words = [WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + (i * 7) % 9)]
        if i % 4 == 0:  # every fourth row repeats an earlier row's opening: prefix-cache hits
            words = [WORDS[j % len(WORDS)] for j in range(8)] + words
        row = {"id": f"r{i}", "prompt": " ".join(words)}
        if i % 5 == 0:
            row["sampling_params"] = {"temperature": 0.0}  # greedy rows among the sampled ones
        rows.append(row)
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    whole = tmp_path / "whole.jsonl"
    proc = start(command(input_path, whole, tiny_qwen3_dir, "--deterministic"))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    expected = sorted(whole.read_bytes().splitlines())
    assert len(expected) == ROWS

    output = tmp_path / "out.jsonl"
    state = Path(str(output) + ".tokenmill") / "state.json"
    # Each kill point counts the lines its own attempt wrote: the kills land some rows late (the sleep
    # below, at ~7 rows per 50 ms), so a count from the start of the file could be passed before the next
    # attempt started, and its SIGTERM reach an interpreter with no handler yet (exit -15).
    kills = [(None, signal.SIGKILL)] + [(count, signal.SIGKILL) for count in rng.sample(range(1, 8), 3)]
    kills[-1] = (kills[-1][0], signal.SIGTERM)  # the last stop is a tidy one
    for attempt, (new_lines, sig) in enumerate(kills):
        # The second attempt resumes without the flag: the journal keeps the run deterministic.
        flags = [] if attempt == 1 else ["--deterministic"]
        flags += ["--max-num-seqs", str(2 + attempt % 3)]  # and each attempt batches its rows differently
        at_start = lines_in(output)
        proc = start(command(input_path, output, tiny_qwen3_dir, *flags))
        wait_until(proc, state.exists if new_lines is None else lambda: lines_in(output) >= at_start + new_lines,
                   timeout=180)
        time.sleep(rng.random() * 0.05)  # somewhere inside the step that follows
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (-signal.SIGKILL, 130), err
    assert json.loads(state.read_text())["settings"]["engine"]["deterministic"] is True

    proc = start(command(input_path, output, tiny_qwen3_dir, "--no-deterministic"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "deterministic" in err, err

    proc = start(command(input_path, output, tiny_qwen3_dir))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "continues in deterministic mode" in err and "resumed:" in err
    assert sorted(output.read_bytes().splitlines()) == expected


def test_keep_deterministic_reads_the_journal(tmp_path):
    """The mode a journal recorded wins over a missing flag; an explicit False matches a run that never said."""
    from tokenmill.batch.job import JobConfig, keep_deterministic

    output = tmp_path / "out.jsonl"
    fresh = JobConfig(input="in.jsonl", output=str(output), engine={"deterministic": False, "dtype": "bfloat16"})
    assert keep_deterministic(fresh).engine == {"dtype": "bfloat16"}
    state = Path(str(output) + ".tokenmill")
    state.mkdir()
    (state / "state.json").write_text(json.dumps({"settings": {"engine": {"deterministic": True}}}))
    assert keep_deterministic(JobConfig(input="in.jsonl", output=str(output))).engine == {"deterministic": True}
    assert keep_deterministic(fresh).engine == {"deterministic": False, "dtype": "bfloat16"}  # then refused as a change
    overwrite = JobConfig(input="in.jsonl", output=str(output), overwrite=True)
    assert keep_deterministic(overwrite).engine == {}
