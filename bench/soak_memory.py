"""Host memory of one long-lived engine over many requests (the soak audit, bench/results/host_memory_soak.md).

Each path pushes many small requests through one engine on the CPU (a random two-layer Llama with
the tests' byte-level tokenizer, max_tokens a few; a tiny BERT for ``embed``), warms up, then
compares two points: resident memory (VmRSS), live objects (``len(gc.get_objects())`` after a
full collection), the bytes tracemalloc traces (``--tracemalloc``; slow), and the length of every
container reachable from the LLM through tokenmill objects (the census: a dict or list that grows
with the requests served, not with the work in flight, is the suspect). Growth is reported per
request (per row for the batch job).

    python bench/soak_memory.py                                  # every path, default sizes
    python bench/soak_memory.py --paths generate,job --tracemalloc
    python bench/soak_memory.py --paths job --rows 20000 --input-format openai
    RESULTS=soak.jsonl python bench/soak_memory.py                # the rows appended there too (result_row.py)

Paths: generate (mixed SamplingParams: seeds, logprobs, penalties, stop strings, n=2, bad words,
logit bias, prompt logprobs), chat, queue (enqueue + wait_for_completion), imap, embed (a pooling
engine), job (`run_job` over a JSONL of ``--rows`` rows, plain rows or OpenAI batch lines, sampled
every ``--job-probe-rows`` rows through run_job's should_stop hook, the last probe before the
input's end).
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_row import emit  # noqa: E402  (a row a path: printed, and appended to $RESULTS if set)

PATHS = ("generate", "chat", "queue", "imap", "stream", "beam", "embed", "job")
WORDS = ("the cat sat on a warm mat while quick brown foxes jumped over lazy dogs near blue rivers and green "
         "hills under the sun wind rain night day city book tea cup").split()


# ---- measuring ------------------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def trimmed_rss_bytes() -> int:
    """VmRSS once glibc has returned its free heap pages (malloc_trim): memory in use, not memory
    the allocator keeps for later (0 where there is no glibc)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return 0
    return rss_bytes()


def census(roots: dict[str, object], max_depth: int = 8) -> dict[str, int]:
    """The length of every container reachable from the ``roots`` through tokenmill objects'
    attributes (and the first few elements of containers, where those are tokenmill objects), by path."""
    import torch

    sizes: dict[str, int] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, root, 0) for name, root in roots.items()]
    while stack:
        path, obj, depth = stack.pop()
        if id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, (dict, list, set, collections.deque, bytearray)) or type(obj).__name__ in ("WeakSet", "WeakKeyDictionary"):
            sizes[path] = len(obj)
            values = obj.values() if isinstance(obj, dict) else obj
            for i, item in enumerate(itertools.islice(iter(values), 3)):
                if _ours(item):
                    stack.append((f"{path}[{i}]", item, depth + 1))
        elif _ours(obj) and not isinstance(obj, torch.nn.Module):
            attrs = getattr(obj, "__dict__", None) or {name: getattr(obj, name, None) for name in getattr(obj, "__slots__", ())}
            for name, value in attrs.items():
                stack.append((f"{path}.{name}", value, depth + 1))
    return sizes


def _ours(obj: object) -> bool:
    return type(obj).__module__.startswith("tokenmill")


class Probe:
    """One measuring point: RSS, live objects by type, traced bytes (the snapshot dumped to
    ``folder``, so that it is not among the next probe's objects), the census. A line on stderr each."""

    def __init__(self, label: str, llm: Any, folder: Path | None, traced: bool):
        gc.collect()
        self.rss = rss_bytes()
        self.rss_trimmed = trimmed_rss_bytes()
        objects = gc.get_objects()
        self.objects = len(objects)
        self.by_type = collections.Counter(type(o).__qualname__ for o in objects)
        # A running job's loop (journal, progress, rows in flight) is reachable from no argument here.
        roots = {"llm": llm, **{"job_loop": o for o in objects if type(o).__name__ == "JobLoop"}}
        del objects
        self.traced = tracemalloc.get_traced_memory()[0] if traced else 0
        self.snapshot: Path | None = None
        if traced and folder is not None:
            self.snapshot = folder / f"{label.replace(' ', '_')}.tracemalloc"
            tracemalloc.take_snapshot().dump(str(self.snapshot))
        self.census = census(roots) if folder is not None else {}
        print(f"  {label}: RSS {self.rss / 2**20:.1f} MiB ({self.rss_trimmed / 2**20:.1f} trimmed), {self.objects:,} objects"
              + (f", {self.traced / 2**20:.2f} MiB traced" if traced else ""), file=sys.stderr, flush=True)


def report(name: str, a: Probe, b: Probe, units: int, unit: str) -> dict[str, Any]:
    """Per-``unit`` growth between ``a`` and ``b``, emitted and returned as a row."""
    row = {"bench": "soak_memory", "path": name, "units": units, "unit": unit,
           "rss_bytes_per_unit": (b.rss - a.rss) / units, "trimmed_rss_bytes_per_unit": (b.rss_trimmed - a.rss_trimmed) / units,
           "objects_per_unit": (b.objects - a.objects) / units,
           "rss_mib_at_a": round(a.rss / 2**20, 1), "rss_mib_at_b": round(b.rss / 2**20, 1),
           "objects_at_a": a.objects, "objects_at_b": b.objects}
    if a.snapshot is not None and b.snapshot is not None:
        row["traced_bytes_per_unit"] = (b.traced - a.traced) / units
        first, last = (tracemalloc.Snapshot.load(str(p)).filter_traces(_FILTERS) for p in (a.snapshot, b.snapshot))
        stats = last.compare_to(first, "lineno")
        row["top_sites"] = [f"{s.size_diff:+,} B {s.count_diff:+,} blocks {s.traceback[0].filename.split('site-packages/')[-1]}:"
                            f"{s.traceback[0].lineno}" for s in stats[:10]]
    row["grown_types"] = [f"{t} {b.by_type[t] - a.by_type[t]:+,}" for t, _ in
                          sorted(((t, b.by_type[t] - a.by_type[t]) for t in b.by_type), key=lambda x: -x[1])[:8]
                          if b.by_type[t] - a.by_type[t] > 0]
    row["grown_containers"] = {p: f"{a.census.get(p, 0)} -> {n}" for p, n in sorted(b.census.items())
                               if n > a.census.get(p, 0) + 1 and p in a.census}
    emit(row)
    return row


_FILTERS = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
            tracemalloc.Filter(False, __file__)]


def soak(name: str, llm: Any, step: Callable[[int], int], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """``step(i)`` (it returns its requests) for ``--warmup`` calls, a probe, the rest of the
    ``--calls``, a probe; RSS and objects printed every ``--probe-every`` calls between them, to
    tell a plateau from a slope."""
    start = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    a = Probe(f"{name} call {args.warmup}", llm, folder, args.tracemalloc)
    requests = 0
    for i in range(args.warmup, args.calls):
        requests += step(i)
        if (i + 1 - args.warmup) % args.probe_every == 0 and i + 1 < args.calls:
            Probe(f"{name} call {i + 1}", llm, None, False)
    b = Probe(f"{name} call {args.calls}", llm, folder, args.tracemalloc)
    print(f"{name}: {args.calls} calls in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return report(name, a, b, requests, "request")


# ---- the workloads --------------------------------------------------------------------------

class Sentences:
    """Random prompts of WORDS, each ending with one of ``numbers`` numbers. Each number is a word
    the tokenizer keeps in its BPE cache (10,000 words); a stream of ever new words measures that
    cache filling (~10 MB, bench/results/host_memory_soak.md) before anything else."""

    def __init__(self, seed: int, numbers: int):
        self.rng = random.Random(seed)
        self.numbers = numbers

    def __call__(self, low: int = 3, high: int = 12) -> str:
        rng = self.rng
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + f" {rng.randrange(self.numbers)}"


def mixed_params(rng: random.Random, i: int, max_tokens: int) -> Any:
    """A request's SamplingParams, cycling through the features that keep per-request state (a
    grammar matcher per sequence where xgrammar is installed)."""
    import importlib.util

    from tokenmill import SamplingParams, StructuredOutputsParams

    grammar = [dict(structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]))] \
        if importlib.util.find_spec("xgrammar") is not None else []
    kinds = (*grammar,
        dict(temperature=0.0),
        dict(temperature=0.8, seed=rng.randrange(2**31)),
        dict(temperature=0.8, logprobs=3),
        dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
        dict(temperature=0.8, stop=["e", " a"], include_stop_str_in_output=bool(i % 2)),
        dict(temperature=0.8, n=2),
        dict(temperature=0.8, bad_words=["the"], logit_bias={5: 2.0}),
        dict(temperature=0.0, prompt_logprobs=1),
        dict(temperature=0.8, allowed_token_ids=list(range(3, 200))),
    )
    return SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)])


def generate_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    def step(call: int) -> int:
        prompts = [text() for _ in range(args.prompts)]
        return len(llm.generate(prompts, [mixed_params(text.rng, call + i, args.max_tokens) for i in range(len(prompts))],
                                use_tqdm=False))
    return step


def chat_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8)

    def step(call: int) -> int:
        chats = [[{"role": "system", "content": text()}, {"role": "user", "content": text()}]
                 for _ in range(args.prompts)]
        return len(llm.chat(chats, params, use_tqdm=False))
    return step


def queue_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    def step(call: int) -> int:
        llm.enqueue([text() for _ in range(args.prompts)],
                    [mixed_params(text.rng, call + i, args.max_tokens) for i in range(args.prompts)], use_tqdm=False)
        return len(llm.wait_for_completion(use_tqdm=False))
    return step


def imap_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8)

    def step(call: int) -> int:
        return sum(1 for _ in llm.imap((text() for _ in range(args.prompts)), params))
    return step


def stream_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    def step(call: int) -> int:
        prompts = [text() for _ in range(args.prompts)]
        outputs = llm.stream(prompts, [mixed_params(text.rng, call + i, args.max_tokens) for i in range(len(prompts))])
        return sum(output.finished for output in outputs)
    return step


def beam_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    from tokenmill import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=args.max_tokens)

    def step(call: int) -> int:
        return len(llm.beam_search([{"prompt": text()} for _ in range(args.prompts // 4)], params))
    return step


def embed_path(llm: Any, args: argparse.Namespace, text: Sentences) -> Callable[[int], int]:
    from support.tiny_models import BERT_WORDS  # the tiny BERT's whole words: sentences fit its 48 positions

    def step(call: int) -> int:
        rng = text.rng
        return len(llm.embed([" ".join(rng.choice(BERT_WORDS) for _ in range(rng.randint(1, 20))) for _ in range(args.prompts)],
                             use_tqdm=False))
    return step


def write_job_input(path: Path, rows: int, fmt: str, max_tokens: int, text: Sentences) -> None:
    """Rows with their own sampling values (some seeded, some with logprobs), and a few error rows:
    a line that is not JSON, values the engine refuses, an OpenAI line reusing an earlier custom_id."""
    with open(path, "w") as f:
        for i in range(rows):
            if i % 97 == 96:
                f.write('{"prompt": "cut short\n')
                continue
            own: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.8}
            if i % 3 == 1:
                own["seed"] = text.rng.randrange(2**31)
            if i % 5 == 2:
                own["logprobs"] = 2
            if i % 89 == 88:
                own["logprobs"] = 10**6
            if fmt == "openai":
                custom_id = f"request-{i - 50 if i % 101 == 100 else i}"
                line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                        "body": {"model": "m", "prompt": text(), **own}}
            else:
                line = {"id": f"row-{i}", "prompt": text(), "sampling_params": own}
            f.write(json.dumps(line) + "\n")


_READ_AHEAD = 2048  # rows the job reads ahead of those finished (max_inflight, twice max_num_seqs), and then some


def job_path(llm: Any, args: argparse.Namespace, text: Sentences, folder: Path) -> dict[str, Any]:
    """`run_job` over ``--rows`` rows; probes every ``--job-probe-rows`` finished rows (counted from
    the output's lines, read as they are written), from the should_stop hook run_job polls each step."""
    from tokenmill.batch.config import JobConfig
    from tokenmill.batch.job import run_job

    source, output = folder / "rows.jsonl", folder / "out.jsonl"
    write_job_input(source, args.rows, args.input_format, args.max_tokens, text)
    config = JobConfig(input=str(source), output=str(output), progress=False, overwrite=True,
                       input_format="openai" if args.input_format == "openai" else "auto")
    done, probed, reader = [0], [0], [None]
    probes: dict[str, tuple[int, Probe]] = {}  # the first and the latest

    def should_stop() -> bool:
        if reader[0] is None and output.exists():
            reader[0] = open(output, "rb")
        if reader[0] is not None:
            done[0] += reader[0].read().count(b"\n")
        # Not near the end: the input's last rows read, the reader's own state is gone.
        if done[0] >= (probed[0] + 1) * args.job_probe_rows and done[0] + min(_READ_AHEAD, args.rows // 4) < args.rows:
            probed[0] += 1
            probes["first" if "first" not in probes else "last"] = (done[0], Probe(f"job row {done[0]}", llm, folder,
                                                                                   args.tracemalloc))
        return False

    start = time.perf_counter()
    run_job(config, llm=llm, should_stop=should_stop)
    print(f"job: {args.rows} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if "last" not in probes:
        raise SystemExit(f"job: fewer than two probes; give more --rows than 2 x --job-probe-rows ({args.job_probe_rows})")
    (rows_a, a), (rows_b, b) = probes["first"], probes["last"]
    return report("job", a, b, rows_b - rows_a, "row")


# ---- main -----------------------------------------------------------------------------------

def make_models(root: Path) -> tuple[Path, Path]:
    from transformers import LlamaConfig

    from support.tiny_models import save_tiny_bert_embedder, save_tiny_model, tiny_config_kwargs

    llama = save_tiny_model(root, "llama", LlamaConfig(**tiny_config_kwargs(), architectures=["LlamaForCausalLM"]), seed=1)
    return llama, save_tiny_bert_embedder(root, "bert_embedder", seed=13)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    parser.add_argument("--calls", type=int, default=50, help="calls per path (all but job)")
    parser.add_argument("--warmup", type=int, default=10, help="calls before the first probe")
    parser.add_argument("--prompts", type=int, default=200, help="prompts per call")
    parser.add_argument("--probe-every", type=int, default=10, help="calls between two RSS lines")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--numbers", type=int, default=1000,
                        help="distinct numbers prompts end with (more than ~10,000 measures the tokenizer's cache filling)")
    parser.add_argument("--rows", type=int, default=20000, help="rows of the batch job")
    parser.add_argument("--job-probe-rows", type=int, default=4000, help="the job is probed every this many rows")
    parser.add_argument("--input-format", choices=("jsonl", "openai"), default="jsonl", help="the job's input lines")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=8 * 2**20,
                        help="small, so that warm-up writes the whole pool and the prefix cache is full by the first probe")
    parser.add_argument("--metrics", action="store_true", help="the generation engine records metrics (disable_log_stats=False)")
    parser.add_argument("--tracemalloc", action="store_true", help="trace allocations (top sites by growth; ~3x slower)")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {PATHS}")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from tokenmill import LLM

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.tracemalloc:
        tracemalloc.start(1)
    with tempfile.TemporaryDirectory() as tmp:
        llama, bert = make_models(Path(tmp))
        engine = dict(dtype="float32", device="cpu", seed=0, max_model_len=256, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      disable_log_stats=not args.metrics)
        text = Sentences(0, args.numbers)
        if set(paths) - {"embed"}:
            llm = LLM(str(llama), **engine)
            for name, make in (("generate", generate_path), ("chat", chat_path), ("queue", queue_path), ("imap", imap_path),
                               ("stream", stream_path), ("beam", beam_path)):
                if name in paths:
                    soak(name, llm, make(llm, args, text), args, Path(tmp))
            if "job" in paths:
                job_path(llm, args, text, Path(tmp))
            del llm
        if "embed" in paths:
            pooling = LLM(str(bert), dtype="float32", device="cpu", seed=0)
            soak("embed", pooling, embed_path(pooling, args, text), args, Path(tmp))


if __name__ == "__main__":
    main()
