"""A chaos audit of `tokenmill run`'s promise: killed at any moment and rerun, it resumes with nothing
lost or done twice (docs/batch.md, "Resume: how it works").

    python bench/chaos_resume.py --trials 300 [--seed S] [--scenario NAME ...] [--workdir DIR]

Each trial takes a scenario (`chaos_inputs.py`: an input format, an output format, generation or
embedding, one engine or `--replicas 2`, bad rows mixed in), then runs `tokenmill run` 0-4 times,
each interrupted a random way, and once more to the end:

- a signal after a random delay (start-up included), after k new output lines (the first row, mid
  file, the last few), to one replica, or to the parent and every replica at once (a scheduler's
  stop); SIGKILL mostly, SIGTERM, SIGINT or two SIGINTs sometimes;
- at an exact point, from a hook every process of the trial loads (`chaos_hooks/sitecustomize.py`):
  a data or journal write cut short, between a commit's data and journal writes, a signal landing
  inside a write call, after the cut of a torn tail on resume, around the state file's and the
  Parquet output's renames, while the Parquet file is written, before the journal's deletion, in a
  replica after a commit;
- a full disk: a file-size limit (EFBIG), or a real one (a small tmpfs, filled but for a few KB; it
  needs root to mount);
- sometimes, between attempts, the journal deleted, emptied or cut at a random byte (the output
  then says which rows are done).

The finished output is then checked against an uninterrupted run of the same scenario: every row
exactly once, each line strict JSON (or the Parquet file readable), the same records (bad rows the
same error rows; embeddings may differ by float rounding, reported as NEAR: the batch a row ran in
changes its float32 sums), the right exit codes and messages on the way, no file left in the sidecar
folder or beside the output, no replica process outliving its job. Results go to
WORKDIR/results.jsonl, one line a trial; a failed trial keeps its folder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from chaos_inputs import build_models, scenarios

REPO = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).resolve().parent / "chaos_hooks"
SIGS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
POINTS_ANY = ["in_write", "data_partial", "journal_partial", "before_journal", "after_journal", "after_truncate",
              "before_replace_state", "after_replace_state", "before_remove_journal"]
POINTS_PARQUET = ["before_replace_output", "after_replace_output", "parquet_mid"]


# --- running one attempt ----------------------------------------------------------------------------

def start(repo: Path, inp: Path, out: Path, flags: list[str], point: str | None = None, fsize: int | None = None,
          log: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CHAOS_POINT"}
    env.update(PYTHONPATH=os.pathsep.join([str(HOOKS), str(repo)]), OMP_NUM_THREADS="1")
    if point:
        env.update(CHAOS_POINT=point, CHAOS_LOG=str(log))
    cmd = [sys.executable, "-m", "tokenmill.cli", "run", str(inp), "-o", str(out), "--fsync-interval", "0",
           "--progress-interval", "0.5", *flags]

    def limit_file_size() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit_file_size,
                            start_new_session=True)


def data_file(out: Path) -> Path:
    return out if out.suffix == ".jsonl" else Path(f"{out}.tokenmill") / "staging.jsonl"


def lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def children_of(pid: int) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def fill(folder: Path, leave: int) -> None:
    """A real full disk: the tmpfs the output lives on filled but for ``leave`` bytes."""
    stat = os.statvfs(folder)
    with open(folder / "filler", "wb") as f:
        if stat.f_bavail * stat.f_frsize - leave > 0:
            os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize - leave)


class Attempt:
    def __init__(self, kind: str, detail: str = "", sig: str = "-", wait: float = 0.0, lines: int = 0):
        self.kind, self.detail, self.sig, self.wait, self.lines = kind, detail, sig, wait, lines
        self.rc: int | None = None
        self.err = ""
        self.sent = False
        self.leave = 0

    def __repr__(self) -> str:
        return f"{self.kind}({self.detail},{self.sig})->rc={self.rc}{'' if self.sent else ' (nothing sent)'}"


def plan_attempt(rng: random.Random, out: Path, replicas: bool, parquet: bool, rows: int, tmpfs: bool) -> tuple[Attempt, str | None, int | None]:
    """How this attempt is interrupted: (the attempt, its hook point, its file-size limit)."""
    mode = rng.choices(["delay", "lines", "point", "fsize", "replica", "all", "enospc"],
                       weights=[25, 35, 32, 8, 20 if replicas else 0, 12 if replicas else 0, 30 if tmpfs else 0])[0]
    sig = rng.choices(["KILL", "TERM", "INT", "INT2"], weights=[60, 18, 14, 8])[0]
    left = max(1, rows - lines_in(data_file(out)))
    if mode == "point":
        name = rng.choice(POINTS_ANY + (POINTS_PARQUET if parquet else []) + (["replica_commit"] if replicas else []))
        count = rng.choice([1, 1, 2, 3, rng.randint(1, 60)])
        if name in ("after_replace_output", "before_replace_output", "before_remove_journal"):
            count = 1
        elif name in ("before_replace_state", "after_replace_state"):
            count = rng.choice([1, 2])  # the fresh state file, or the complete one
        if name in ("data_partial", "journal_partial"):
            sig = "KILL"  # a write cut short: only a process killed mid-write leaves one
        return Attempt("point", f"{name}#{count}", sig), f"{name}:{count}:{sig}", None
    if mode == "fsize":
        size = data_file(out).stat().st_size if data_file(out).exists() else 0
        limit = size + rng.randint(0, 30000)
        return Attempt("fsize", str(limit)), None, limit
    if mode == "enospc":
        attempt = Attempt("enospc", lines=rng.choice([0, 0, 1, rng.randint(1, left)]))
        attempt.leave = rng.randint(0, 40000)
        attempt.detail = f"+{attempt.lines} lines, {attempt.leave} B free"
        if attempt.lines == 0:
            fill(out.parent, attempt.leave)
        return attempt, None, None
    if mode in ("all", "replica"):
        signals = rng.choices(["KILL", "TERM", "INT"], weights=[30, 35, 35] if mode == "all" else [70, 20, 10])[0]
        wait = rng.uniform(0.0, 4.0 if mode == "all" else 3.0)
        return Attempt(mode, f"{wait:.2f}s after the replicas start", signals, wait=wait), None, None
    if mode == "delay":
        wait = rng.uniform(0.0, 9.0 if replicas else 6.0)
        return Attempt("delay", f"{wait:.2f}s", sig, wait=wait), None, None
    lines = rng.choice([1, 1, rng.randint(1, left), max(1, left - rng.randint(0, 5))])
    return Attempt("lines", f"+{lines}", sig, lines=lines), None, None


def run_attempt(rng: random.Random, repo: Path, inp: Path, out: Path, flags: list[str], rows: int, tmpfs: bool) -> tuple[Attempt, list[str]]:
    """One interrupted attempt; returns it and the problems seen (processes left, wrong exit codes)."""
    replicas = "--replicas" in flags
    log = out.parent / "chaos.log"
    attempt, point, fsize = plan_attempt(rng, out, replicas, out.suffix == ".parquet", rows, tmpfs)
    target = lines_in(data_file(out)) + attempt.lines
    proc = start(repo, inp, out, flags, point=point, fsize=fsize, log=log)
    children: dict[int, str] = {}
    started, replicas_up, next_scan, problems = time.monotonic(), None, 0.0, []
    while proc.poll() is None:
        now = time.monotonic()
        if now >= next_scan:
            children.update(children_of(proc.pid))
            next_scan = now + 0.05
        running = [pid for pid, cmd in children.items() if "replica_process" in cmd and alive(pid)]
        if replicas_up is None and len(running) == 2:
            replicas_up = now
        if not attempt.sent:
            if attempt.kind == "delay" and now - started >= attempt.wait:
                _signal(proc, attempt, rng)
            elif attempt.kind == "lines" and lines_in(data_file(out)) >= target:
                _signal(proc, attempt, rng)
            elif attempt.kind == "enospc" and lines_in(data_file(out)) >= target:
                attempt.sent = True
                if not (out.parent / "filler").exists():
                    fill(out.parent, attempt.leave)
            elif attempt.kind in ("all", "replica") and replicas_up is not None and now - replicas_up >= attempt.wait:
                attempt.sent = True
                for pid in [proc.pid, *running] if attempt.kind == "all" else [rng.choice(running)]:
                    try:
                        os.kill(pid, SIGS[attempt.sig])
                    except OSError:
                        pass
        if now - started > 240:
            problems.append(f"attempt hung: {attempt}")
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.003)
    _, err = proc.communicate()
    attempt.rc, attempt.err = proc.returncode, err.decode(errors="replace")
    (out.parent / "filler").unlink(missing_ok=True)
    if point is not None:
        attempt.sent = log.exists() and f"fired {point.split(':')[0]}" in log.read_text()
        log.unlink(missing_ok=True)
    spawned = [pid for pid, cmd in children.items() if "replica_process" in cmd]
    deadline = time.monotonic() + 8  # a replica of a killed parent notices within a second
    while any(map(alive, spawned)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if [pid for pid in spawned if alive(pid)]:
        problems.append(f"replica processes outlived the job {attempt}")
        for pid in filter(alive, spawned):
            os.kill(pid, signal.SIGKILL)
    return attempt, problems + check_exit(attempt)


def _signal(proc: subprocess.Popen, attempt: Attempt, rng: random.Random) -> None:
    attempt.sent = True
    if attempt.sig == "INT2":  # a second Ctrl-C stops at once
        proc.send_signal(signal.SIGINT)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    else:
        proc.send_signal(SIGS[attempt.sig])


def check_exit(attempt: Attempt) -> list[str]:
    """The exit code and stderr an interrupted attempt should end with (docs/batch.md's exit codes)."""
    rc, err, kind, sig = attempt.rc, attempt.err, attempt.kind, attempt.sig
    problems = []
    finished = rc in (0, 3) and ("tokenmill run done" in err or "already complete" in err)
    # Python's own traceback of a replica that got SIGINT while it imported torch, before it set SIGINT aside
    replica_interrupted = kind in ("replica", "all") and sig == "INT" and "KeyboardInterrupt" in err
    if "Traceback" in err and not replica_interrupted:
        problems.append(f"traceback on stderr {attempt}: {err[-2500:]}")
    if kind == "delay" and sig in SIGS and rc == -SIGS[sig] and attempt.wait < 0.4 and not err.strip():
        return problems  # the interpreter was starting, the job's handlers not installed yet: the default action
    if rc == -signal.SIGINT and sig != "KILL" and "stopping now (no row has started)" in err and "Traceback" not in err:
        # Seen once (a SIGTERM while the model loaded): the job caught the stop and returned 130, and the
        # interpreter still ended by SIGINT, as it does after an interrupt it took for unhandled (a shell
        # shows 130 either way). Counted apart.
        return [*problems, "NEAR: stopped before any row ran, but the process ended by SIGINT rather than exit(130)"]
    if attempt.sent and sig in SIGS and rc == -SIGS[sig] and "tokenmill run done" in err:
        return problems  # the job had ended (its handlers restored) when the signal came: the work is done
    if kind in ("enospc", "fsize"):
        reason = "No space left on device" if kind == "enospc" else "File too large"
        if rc not in (0, 2, 3) or (rc == 2 and ("cannot write" not in err or reason not in err)):
            problems.append(f"full disk: exit {rc}, expected 2 naming the output and the cause: {err[-1500:]}")
        return problems
    if not attempt.sent:
        return problems if finished else [*problems, f"an attempt nothing stopped ended rc={rc}: {err[-1500:]}"]
    if kind == "replica" or (kind == "point" and attempt.detail.startswith("replica_commit") and sig == "KILL"):
        # a replica killed: replaced, and the job completes (one killed once its shard was done, as it
        # exited, needs no replacement); a SIGINT is the parent's to act on (ignored)
        ok = finished
    elif sig == "KILL":
        ok = rc == -signal.SIGKILL or finished
    else:
        ok = rc == 130 or finished
        if rc == 130 and "rerun" not in err:
            problems.append(f"exit 130 without saying to rerun {attempt}: {err[-800:]}")
    return problems if ok else [*problems, f"unexpected exit {attempt}: {err[-2500:]}"]


# --- checking the finished output -------------------------------------------------------------------

def _refuse_constant(value: str) -> None:
    raise ValueError(f"{value} is not JSON")


def read_output(out: Path) -> list[dict]:
    if out.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(out).to_pylist()
    records = []
    with open(out, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                raise ValueError(f"line {number} has no newline: {line[:200]!r}")
            records.append(json.loads(line, parse_constant=_refuse_constant))
    return records


def key_of(record: dict) -> tuple:
    if "custom_id" in record and "response" in record:
        return (record["id"],)  # an OpenAI line (its id derives from the job and the row)
    return (record["row"], record.get("sample_index"))


def normalized(record: dict) -> dict:
    record = json.loads(json.dumps(record))
    ((record.get("response") or {}).get("body") or {}).pop("created", None)  # the attempt's start time
    return record


def close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(close, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


def compare(records: list[dict], reference: list[dict]) -> list[str]:
    keys = [key_of(r) for r in records]
    expected = {key_of(r): normalized(r) for r in reference}
    problems = []
    twice = sorted({k for k in keys if keys.count(k) > 1})
    for what, found in (("written twice", twice), ("missing", sorted(set(expected) - set(keys))),
                        ("not in the uninterrupted run", sorted(set(keys) - set(expected)))):
        if found:
            problems.append(f"outputs {what}: {found[:10]}")
    differ = [(key_of(r), normalized(r)) for r in records if key_of(r) in expected and normalized(r) != expected[key_of(r)]]
    rounding = [(k, got) for k, got in differ if close(got, expected[k])]
    wrong = [(k, got) for k, got in differ if not close(got, expected[k])]
    if wrong:
        k, got = wrong[0]
        problems.append(f"{len(wrong)} outputs differ from the uninterrupted run, e.g. {k}: {json.dumps(got)[:600]} != "
                        f"{json.dumps(expected[k])[:600]}")
    if rounding:
        problems.append(f"NEAR: {len(rounding)} outputs differ only in float rounding, e.g. {rounding[0][0]}")
    return problems


def check_final(out: Path, reference: list[dict], summary: str, rc: int, final: Attempt) -> list[str]:
    problems = []
    if final.rc != rc or "Traceback" in final.err or (summary not in final.err and "already complete" not in final.err):
        problems.append(f"the final run: exit {final.rc} (expected {rc}, summary {summary!r}): {final.err[-2000:]}")
    try:
        problems += compare(read_output(out), reference)
    except Exception as e:  # noqa: BLE001
        return [*problems, f"output unreadable: {e!r}"]
    sidecar = Path(f"{out}.tokenmill")
    left = sorted(set(os.listdir(sidecar)) - {"state.json", "lock"}) if sidecar.exists() else ["(no sidecar folder)"]
    strays = [p.name for p in out.parent.iterdir() if p.name not in (out.name, sidecar.name)]
    if left or strays:
        problems.append(f"files left behind: in the sidecar {left}, beside the output {strays}")
    try:
        if not json.loads((sidecar / "state.json").read_text()).get("complete"):
            problems.append("state.json does not say complete")
    except (OSError, ValueError) as e:
        problems.append(f"state.json unreadable: {e!r}")
    return problems


# --- trials -----------------------------------------------------------------------------------------

def damage(rng: random.Random, journal: Path) -> Attempt:
    """The journal deleted, emptied or cut at a random byte (a torn line included)."""
    how = rng.choice(["deleted", "emptied", "cut"])
    if how == "deleted":
        journal.unlink()
    else:
        size = journal.stat().st_size
        with open(journal, "r+b") as f:
            f.truncate(0 if how == "emptied" else rng.randint(0, size))
    return Attempt("journal", how)


class Chaos:
    def __init__(self, workdir: Path, repo: Path):
        self.workdir, self.repo = workdir, repo
        build_models(workdir / "models", REPO)
        self.scenarios = scenarios(workdir / "models")

    def reference(self, name: str) -> tuple[Path, list[dict], int, str]:
        """The scenario's input and its uninterrupted run: records, exit code, "N/N rows, F failed"."""
        write, in_ext, out_ext, flags = self.scenarios[name]
        folder = self.workdir / "ref" / name
        inp, out, done = folder / f"in.{in_ext}", folder / f"whole.{out_ext}", folder / "ref.json"
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            write(inp)
            proc = start(self.repo, inp, out, flags)
            err = proc.communicate()[1].decode()
            assert proc.returncode in (0, 3), err
            summary = next(line for line in err.splitlines() if line.startswith("tokenmill run done"))
            done.write_text(json.dumps({"rc": proc.returncode, "summary": summary.split(": ", 1)[1].split(", wall")[0]}))
        meta = json.loads(done.read_text())
        return inp, read_output(out), meta["rc"], meta["summary"]

    def trial(self, rng: random.Random, name: str, number: int, tmpfs_rate: float) -> tuple[list[str], list[Attempt]]:
        folder = self.workdir / "trials" / f"{number:05d}-{name}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        tmpfs = rng.random() < tmpfs_rate
        if tmpfs:  # a small file system of its own, to fill
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(folder)], check=True)
        try:
            problems, attempts = self._attempts(rng, name, folder, tmpfs)
            if not problems:
                for entry in folder.iterdir():
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            return problems, [Attempt("tmpfs")] * tmpfs + attempts
        finally:
            if tmpfs:
                kept = Path(f"{folder}-kept")
                if any(folder.iterdir()):
                    shutil.copytree(folder, kept)
                subprocess.run(["umount", "--lazy", str(folder)], check=True)  # lazy: a run the harness left still holds it
                if kept.exists():
                    folder.rmdir()
                    kept.rename(folder)
            if folder.exists() and not any(folder.iterdir()):
                folder.rmdir()

    def _attempts(self, rng: random.Random, name: str, folder: Path, tmpfs: bool) -> tuple[list[str], list[Attempt]]:
        inp, reference, rc, summary = self.reference(name)
        flags, out = self.scenarios[name][3], folder / f"out.{self.scenarios[name][2]}"
        problems: list[str] = []
        attempts: list[Attempt] = []
        for _ in range(rng.choices([0, 1, 2, 3, 4], weights=[5, 35, 30, 18, 12])[0]):
            journal = Path(f"{out}.tokenmill") / "journal.jsonl"
            if journal.exists() and rng.random() < 0.1:  # a lost or damaged journal is rebuilt from the output
                attempts.append(damage(rng, journal))
            attempt, seen = run_attempt(rng, self.repo, inp, out, flags, len(reference), tmpfs)
            attempts.append(attempt)
            problems += seen
            if seen:
                break
        for kind in ("final", "again") if rng.random() < 0.15 else ("final",):  # again: the same command once complete
            proc = start(self.repo, inp, out, flags)
            attempt = Attempt(kind)
            attempt.err = proc.communicate()[1].decode(errors="replace")
            attempt.rc = proc.returncode
            attempts.append(attempt)
            problems += check_final(out, reference, summary, rc, attempt)
            if kind == "again" and "already complete" not in attempt.err:
                problems.append(f"a complete job's rerun did not say so: {attempt.err[-600:]}")
        return problems, attempts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--scenario", action="append", help="one scenario (repeatable); default: each in turn")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tokenmill-chaos"))
    parser.add_argument("--repo", type=Path, default=REPO, help="the tokenmill checkout to run")
    parser.add_argument("--first", type=int, default=0, help="the first trial's number (its folder's name)")
    parser.add_argument("--tmpfs-rate", type=float, default=0.3 if os.geteuid() == 0 else 0.0,
                        help="the share of trials whose output sits on a small tmpfs, to fill (mounting needs root)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # the trial's tmpfs is unmounted on the way out
    chaos = Chaos(args.workdir, args.repo)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    names = args.scenario or list(chaos.scenarios)
    rng = random.Random(seed)
    print(f"seed {seed}", flush=True)
    for number in range(args.first, args.first + args.trials):
        name, trial_seed, started = names[number % len(names)], rng.randrange(2**32), time.monotonic()
        try:
            problems, attempts = chaos.trial(random.Random(trial_seed), name, number, args.tmpfs_rate)
        except Exception:  # noqa: BLE001
            problems, attempts = [f"harness error: {traceback.format_exc()}"], []
        row = {"n": number, "scenario": name, "seed": trial_seed, "attempts": [repr(a) for a in attempts],
               "problems": problems, "secs": round(time.monotonic() - started, 1), "repo": str(args.repo)}
        with open(args.workdir / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        status = "OK" if not problems else "NEAR" if all(p.startswith("NEAR") for p in problems) else "FAIL"
        print(f"[{number}] {name} {status} {row['secs']}s {row['attempts']}", flush=True)
        for problem in problems:
            print("    " + problem[:3000], flush=True)


if __name__ == "__main__":
    main()
