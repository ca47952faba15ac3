"""Protocol C1 on the CPU, tokenmill side by side with Hugging Face transformers.

SmolLM2-135M-Instruct (the built-in, from its Q4_1 GGUF), 32 one-line chat prompts, greedy,
64 new tokens each with eos ignored (banned until the 64th token, in both engines, so the
greedy tokens are comparable). Each engine runs in its own fresh process (so one's thread
pools or caches can't help the other), alternating, `--pairs` times; the figure is the median.
Rows go to stdout and, with --out, are appended to a JSONL file with commit, date and CPU.

    python bench/cpu_c1.py --pairs 2 --dtypes float32 bfloat16 --out bench/results/cpu_c1.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOPICS = [
    "rivers", "mountains", "the sea", "forests", "cities", "music", "bread", "coffee", "trains", "winter",
    "libraries", "gardens", "bicycles", "the moon", "bees", "volcanoes", "bridges", "rain", "chess", "deserts",
    "lighthouses", "owls", "markets", "glaciers", "kites", "islands", "clocks", "wolves", "tea", "maps",
    "thunderstorms", "autumn",
]
NEW_TOKENS = 64


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write one sentence about {topic}."}] for topic in TOPICS]


def run_tokenmill(dtype: str, calls: int = 1) -> dict:
    start = time.perf_counter()
    from tokenmill import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM("smollm2-135m-instruct", dtype=dtype, device="cpu", max_model_len=512)
    loaded = time.perf_counter()
    # min_tokens bans eos until the end, exactly like HF's min_new_tokens: same work, same tokens.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm.chat(conversations()[:2], params.clone(max_tokens=4, min_tokens=4), use_tqdm=False)  # warm-up
    call_seconds = []
    for _ in range(calls):  # the first is the protocol's figure; later ones run on a warm cache pool
        t = time.perf_counter()
        outputs = llm.chat(conversations(), params, use_tqdm=False)
        call_seconds.append(time.perf_counter() - t)
    tokens = [o.outputs[0].token_ids for o in outputs]
    return dict(engine="tokenmill", dtype=dtype, import_s=imported - start, load_s=loaded - imported,
                seconds=call_seconds[0], call_seconds=call_seconds, generated=sum(map(len, tokens)), tokens=tokens)


def run_hf(dtype: str) -> dict:
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.models.builtin import cache_dir, find_builtin, locate_gguf

    imported = time.perf_counter()
    gguf = Path(locate_gguf(find_builtin("smollm2-135m-instruct"), cache_dir()))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
    loaded = time.perf_counter()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations()]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        model.generate(**tokenizer(texts[:2], return_tensors="pt", padding=True, add_special_tokens=False), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        t = time.perf_counter()
        out = model.generate(**batch, **kwargs)
        seconds = time.perf_counter() - t
    new = out[:, batch["input_ids"].shape[1]:]
    tokens = new.tolist()
    return dict(engine="hf-transformers", dtype=dtype, import_s=imported - start, load_s=loaded - imported,
                seconds=seconds, generated=int(new.numel()), tokens=tokens)


def child(engine: str, dtype: str, calls: int) -> None:
    result = run_tokenmill(dtype, calls) if engine == "tokenmill" else run_hf(dtype)
    print("RESULT " + json.dumps(result), flush=True)


def measure(engine: str, dtype: str, calls: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", engine, dtype, "--calls", str(calls)],
                          capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{engine} {dtype} failed:\n{proc.stderr[-3000:]}")


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of greedy positions that agree, counting each sequence up to its first divergence."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "DTYPE"))
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--hf-dtype", default="float32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--calls", type=int, default=1,
                        help="tokenmill's chat call this many times in each process; rows add each call's tok/s")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.calls)
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.pairs):
        plan = [("tokenmill", d) for d in args.dtypes] + ([] if args.skip_hf else [("hf-transformers", args.hf_dtype)])
        for engine, dtype in plan:
            runs.setdefault((engine, dtype), []).append(measure(engine, dtype, args.calls))
    reference = runs.get(("hf-transformers", args.hf_dtype)) or runs.get(("tokenmill", "float32"))
    exact = runs.get(("tokenmill", "float32"))
    rows = []
    for (engine, dtype), results in runs.items():
        tok_s = [r["generated"] / r["seconds"] for r in results]
        row = dict(protocol="C1", engine=engine, dtype=dtype, runs=len(results),
                   generated_tok_s=round(statistics.median(tok_s), 1), all_tok_s=[round(x, 1) for x in tok_s],
                   load_s=round(statistics.median(r["load_s"] for r in results), 2),
                   import_s=round(statistics.median(r["import_s"] for r in results), 2),
                   generated_tokens=results[0]["generated"],
                   **({"call_tok_s": [[round(r["generated"] / c, 1) for c in r["call_seconds"]] for r in results]}
                      if args.calls > 1 and engine == "tokenmill" else {}),
                   greedy_agreement_vs_reference=(round(agreement(results[0]["tokens"], reference[0]["tokens"]), 4)
                                                  if reference else None),
                   identical_sequences_vs_reference=(sum(a == b for a, b in zip(results[0]["tokens"], reference[0]["tokens"]))
                                                     if reference else None),
                   greedy_agreement_vs_tokenmill_fp32=(round(agreement(results[0]["tokens"], exact[0]["tokens"]), 4)
                                                       if exact else None),
                   reference=(f"hf-transformers {args.hf_dtype}" if not args.skip_hf
                              else "tokenmill float32" if exact else None),
                   commit=commit, date=datetime.date.today().isoformat(), cpu=cpu, cores=2)
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
