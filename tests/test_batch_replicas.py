"""`tokenmill run --replicas 2` on the CPU: the parent killed with SIGKILL at a random moment, stopped
with SIGTERM, one replica killed with SIGKILL; after the reruns every row is in the output exactly
once, bad rows are error rows, and the greedy text equals a single-process run's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.replicas import plan_replicas

REPO = Path(__file__).resolve().parents[1]
ROWS = 40
BAD_ROWS = {7: {"id": "bad-prompt", "prompt": 12}, 23: {"id": "bad-params", "prompt": "the cat", "sampling_params": {"top_p": 3}}}
WORDS = "the cat sat on a warm mat while wind blew over its fur".split()
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 32 * 2**20, "max_num_seqs": 1}


def write_input(path: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 9))} for i in range(ROWS)]
    for index, row in BAD_ROWS.items():
        rows[index] = row
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json at all\n")


def start(input_path: Path, output: Path, model: Path, *extra: str, hooks: Path | None = None) -> subprocess.Popen:
    path = [str(hooks)] if hooks is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO), os.environ.get("PYTHONPATH", "")])}
    flags = ["--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--model", str(model), "--dtype", "float32",
             "--device", "cpu", "--max-model-len", "128", "--kv-cache-memory-bytes", str(32 * 2**20), "--max-num-seqs", "1"]
    cmd = [sys.executable, "-m", "tokenmill.cli", "run", str(input_path), "-o", str(output), "--replicas", "2",
           "--fsync-interval", "0", "--progress-interval", "0.5", *flags, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_until(proc: subprocess.Popen, ready, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the job ended before the kill point: {proc.communicate()}"
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.005)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def replica_pids(parent: int) -> list[int]:
    """The parent's children that are replicas (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"tokenmill.batch.replica_process" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


@pytest.mark.slow
def test_replicas_killed_and_resumed_exactly_once(tmp_path, tiny_llama_dir):
    input_path = tmp_path / "in.jsonl"
    write_input(input_path)
    output = tmp_path / "out.jsonl"
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    note = f"(random kill point seed {seed})"

    # The reference: one process, same settings.
    whole = run_job(JobConfig(input=str(input_path), output=str(tmp_path / "whole.jsonl"), model=str(tiny_llama_dir),
                              sampling=SAMPLING, engine=ENGINE, progress=False))
    assert whole.exit_code == 3 and whole.failed == len(BAD_ROWS) + 1
    expected = {r["row"]: r for r in map(json.loads, open(tmp_path / "whole.jsonl"))}

    # 1. SIGKILL of the parent at a random moment; its replicas must not outlive it.
    proc = start(input_path, output, tiny_llama_dir)
    # The replicas are found before the kill point, so the kill follows the threshold at once: the
    # reruns below need rows left to be interrupted in (a slow /proc scan here let a fast machine
    # finish most of the file first).
    wait_until(proc, lambda: len(replica_pids(proc.pid)) == 2)
    replicas = replica_pids(proc.pid)
    threshold = rng.randint(1, ROWS // 3)
    wait_until(proc, lambda: lines_in(output) >= threshold)
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(map(alive, replicas)):
        assert time.monotonic() < deadline, f"replicas {replicas} outlived their killed parent"
        time.sleep(0.1)
    after_kill = lines_in(output)

    # 2. SIGTERM: a tidy stop (the replicas commit what finished), exit code 130.
    proc = start(input_path, output, tiny_llama_dir)
    wait_until(proc, lambda: lines_in(output) >= after_kill + 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "rerun the same command" in err

    # 3. SIGKILL of one replica: a replacement takes its unfinished rows; the job completes. The victim
    # is the first replica to commit rows: a hook (sitecustomize, loaded by every process of this run;
    # only replicas run JobLoop) makes it write its pid to a marker after that commit and wait there,
    # with a row in flight and before it could send Finished, until it is killed. Waiting for output
    # lines instead raced: the parent writes them as it reads the replicas' commits, so on a loaded
    # machine a replica could finish its whole shard before the first line appeared (CI failed so).
    marker, hooks = tmp_path / "victim.pid", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, time
        import tokenmill.batch.loop as loop

        commit = loop.JobLoop._commit

        def commit_then_wait_to_be_killed(self):
            had_rows = bool(self.pending)
            commit(self)
            if not had_rows or os.path.exists({str(marker)!r}):
                return
            mine = {str(marker)!r} + f".{{os.getpid()}}"
            with open(mine, "w") as f:
                f.write(str(os.getpid()))
            try:
                os.link(mine, {str(marker)!r})  # the marker appears with its pid in it, for one replica only
            except FileExistsError:
                return
            time.sleep(3600)

        loop.JobLoop._commit = commit_then_wait_to_be_killed
    """))
    proc = start(input_path, output, tiny_llama_dir, hooks=hooks)
    wait_until(proc, marker.exists)
    victim = int(marker.read_text())
    assert victim in replica_pids(proc.pid)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 3, err  # done, with the bad rows failed
    assert f"(pid {victim}) died: killed by SIGKILL; starting a replacement" in err, err
    assert f"{ROWS + 1}/{ROWS + 1} rows, {len(BAD_ROWS) + 1} failed" in err, err

    records = [json.loads(line) for line in open(output)]
    rows = [r["row"] for r in records]
    assert sorted(rows) == list(range(ROWS + 1)), f"not every row exactly once {note}"
    got = {r["row"]: r for r in records}
    assert {i: r["text"] for i, r in got.items()} == {i: r["text"] for i, r in expected.items()}, note
    for index in (*BAD_ROWS, ROWS):
        assert got[index]["error"] == expected[index]["error"] and got[index]["error"]
    assert "top_p" in got[23]["error"] and "line 41" in got[ROWS]["error"]

    # Complete: the same command only reports.
    proc = start(input_path, output, tiny_llama_dir)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "already complete" in err and lines_in(output) == ROWS + 1


def test_replica_that_cannot_load_its_model_is_a_usage_error(tmp_path):
    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"prompt": "hi"}\n')
    proc = start(input_path, tmp_path / "out.jsonl", tmp_path / "no-such-model")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "no-such-model" in err and "Traceback" not in err


def test_plan_replicas_splits_cores_and_gpus(monkeypatch):
    # The process's own CPUs (a container's or taskset's share), not the host's count.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    plans = plan_replicas({"device": "cpu", "max_num_seqs": 4}, 3)
    assert [p.num_threads for p in plans] == [2, 2, 2] and all(p.engine["device"] == "cpu" for p in plans)
    assert plans[0].engine["max_num_seqs"] == 4

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    plans = plan_replicas({"device": "cuda", "tensor_parallel_size": 2}, 2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["3,5", "6,7"] and plans[0].num_threads is None
    with pytest.raises(ValueError, match="--replicas 3 with tensor_parallel_size 2 needs 6 GPUs, but 4 are visible"):
        plan_replicas({"device": "cuda", "tensor_parallel_size": 2}, 3)
    with pytest.raises(ValueError, match="--device cuda:1 cannot apply"):
        plan_replicas({"device": "cuda:1"}, 2)
    with pytest.raises(ValueError, match="--replicas=0 is invalid"):
        plan_replicas({"device": "cpu"}, 0)


class _NoJournal:
    """The journal a ReplicaPool asks for at a replica's start: nothing done yet."""

    def done_bitmap(self) -> bytes:
        return b""


class _NoProgress:
    """A ReplicaPool's progress line, drawing nothing."""

    rows: dict = {}

    def maybe_draw(self) -> None:
        pass


def test_a_stop_while_replicas_load_their_models_stops_them_at_once(tmp_path, monkeypatch):
    """A replica that has not said Ready has run no row, so a stop request ends it at once instead of
    waiting for a model load that can take minutes (before, the pool waited for every load)."""
    import socket
    import subprocess
    import sys
    import threading
    import time
    from multiprocessing.connection import Connection

    from tokenmill.batch import replicas as replicas_module
    from tokenmill.batch.config import JobConfig

    started, kept = [], []

    def loading_forever(module, env=None):  # a replica stuck loading a large model
        mine, theirs = socket.socketpair()
        kept.append(theirs)  # its end stays open, as a live replica's does
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        started.append(proc)
        return proc, Connection(mine.detach())

    monkeypatch.setattr(replicas_module, "start_module", loading_forever)
    config = JobConfig(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out.jsonl"), replicas=2,
                       engine={"device": "cpu"})
    polls = []
    pool = replicas_module.ReplicaPool(config, _NoJournal(), _NoProgress(), "jsonl", "generic", "key",
                                       should_stop=lambda: bool(polls.append(1)) or len(polls) > 1)
    result = []
    runner = threading.Thread(target=lambda: result.append(pool.run()), daemon=True)
    began = time.monotonic()
    runner.start()
    runner.join(timeout=20)
    try:
        assert result == [False], "the pool still waits for its replicas' loads"
        assert time.monotonic() - began < 10
        assert len(started) == 2 and all(proc.poll() is not None for proc in started)
    finally:
        for proc in started:
            proc.kill()
        for sock in kept:
            sock.close()


def test_replicas_killed_by_the_stop_signal_are_not_replaced(tmp_path, monkeypatch):
    """A batch scheduler's stop reaches every process of the job at once (Slurm signals them all):
    the replicas die of the SIGTERM as the parent is told to stop. Their deaths are the stop, not
    crashes to recover from: no replacement is started (before, each was, then stopped again)."""
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time
    from multiprocessing.connection import Connection

    from tokenmill.batch import replicas as replicas_module
    from tokenmill.batch.config import JobConfig

    started = []

    def running(module, env=None):  # a replica at work: its end of the pipe closes when it dies
        mine, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=(theirs.fileno(),))
        started.append(proc)
        return proc, Connection(mine.detach())

    monkeypatch.setattr(replicas_module, "start_module", running)
    monkeypatch.setattr(replicas_module, "send", lambda conn, message: None)  # no replica reads its set-up here
    config = JobConfig(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out.jsonl"), replicas=2,
                       engine={"device": "cpu"})
    stop = []
    pool = replicas_module.ReplicaPool(config, _NoJournal(), _NoProgress(), "jsonl", "generic", "key",
                                       should_stop=lambda: bool(stop))
    result = []
    runner = threading.Thread(target=lambda: result.append(pool.run()), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the pool waits on their pipes
        stop.append(True)  # the parent's handler ran...
        for proc in started[:2]:
            proc.send_signal(signal.SIGTERM)  # ...and the replicas got theirs
        runner.join(timeout=20)
        assert result == [False] and len(started) == 2, f"{len(started) - 2} replacement(s) started"
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def ignores_sigint(pid: int) -> bool:
    """From /proc: whether the process has SIGINT set to be ignored (the SigIgn mask's bit for signal 2)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def test_a_replica_leaves_a_sigint_to_its_parent():
    """A SIGINT sent to every process of a `--replicas` job (a scheduler's stop signal to them all)
    raised KeyboardInterrupt inside each replica's step, which reported it as a failure: the job ended
    with exit code 1 ("replica 1 failed while running: KeyboardInterrupt" and a traceback) instead of
    stopping tidily with 130, the replicas' finished rows dropped. Found by the crash-resume chaos
    harness. A replica ignores SIGINT (the parent, which got it too, stops the replicas after their
    step) and goes on until then."""
    from tokenmill.distributed.child_process import start_module, stop_children

    proc, conn = start_module("tokenmill.batch.replica_process")
    try:
        deadline = time.monotonic() + 30
        while not ignores_sigint(proc.pid):  # until it has started (it then waits for its set-up)
            assert proc.poll() is None, "the replica died before its set-up came"
            assert time.monotonic() < deadline, "the replica does not ignore SIGINT"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        conn.close()  # no set-up comes: it ends by itself, with its own exit code, not killed by SIGINT
        assert proc.wait(timeout=30) == 1
    finally:
        stop_children([proc], [])


def test_a_tensor_parallel_size_the_model_cannot_be_split_over_is_refused_before_any_replica_starts(
        tmp_path, monkeypatch, tiny_llama_dir):
    import tokenmill.batch.replicas as replicas_module

    def no_replica(*args, **kwargs):
        raise AssertionError("a replica started")

    monkeypatch.setattr(replicas_module, "start_module", no_replica)
    input_path = tmp_path / "in.jsonl"
    input_path.write_text('{"prompt": "hi"}\n')
    config = JobConfig(input=str(input_path), output=str(tmp_path / "out.jsonl"), model=str(tiny_llama_dir),
                       engine={**ENGINE, "tensor_parallel_size": 3}, sampling=dict(SAMPLING), replicas=2, progress=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3\) does not fit this model: num_attention_heads=4 .*"
                                         r"allowed: tensor_parallel_size in \[1, 2, 4\]"):
        run_job(config)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
