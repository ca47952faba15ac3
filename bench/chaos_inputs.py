"""The chaos harness's inputs (`bench/chaos_resume.py`): one scenario a job, its input file written
with bad rows mixed in (rows that fail alone: bad JSON, a bad field, no prompt, a bad sampling value,
a duplicate custom_id, a CSV quote that never closes...), in every input format, for generation
(text, chat and seeded sampled rows; n = 2) and embedding jobs, one engine or two replicas."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

N_ROWS = 160
WORDS = "the cat sat on a warm mat while wind blew over its fur and the dog read a blue book".split()


def text(rng: random.Random, lo: int = 2, hi: int = 14) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def gen_rows(seed: int, chat: bool) -> list[dict]:
    """Generic generation rows: text, chat (optional), greedy and seeded-sampled rows, some bad."""
    rng = random.Random(seed)
    rows = []
    for i in range(N_ROWS):
        row: dict = {"id": f"r{i}"}
        if chat and i % 3 == 1:
            row["messages"] = [{"role": "user", "content": text(rng)}]
        else:
            row["prompt"] = text(rng)
        sp = {"max_tokens": rng.randint(1, 12)}
        if i % 4 == 2:
            sp["temperature"] = 0.9  # sampled: the job derives a per-row seed
        row["sampling_params"] = sp
        rows.append(row)
    return rows


BAD_GENERIC = {
    5: {"id": "bad-type", "prompt": 12},
    17: {"id": "bad-top-p", "prompt": "the cat", "sampling_params": {"top_p": 3}},
    40: {"id": "no-prompt"},
    77: {"id": "bad-temp", "prompt": "the dog", "sampling_params": {"temperature": -1}},
    120: {"id": "bad-messages", "messages": "not a list"},
}


def write_jsonl_gen(path: Path, seed: int, chat: bool) -> None:
    rows = gen_rows(seed, chat)
    for i, bad in BAD_GENERIC.items():
        rows[i] = bad
    lines = [json.dumps(r).encode() for r in rows]
    lines.insert(60, b"not json at all")
    lines.insert(100, b'{"id": "bad-utf8", "prompt": "\xff\xfe"}')
    path.write_bytes(b"\n".join(lines) + b"\n")


def write_csv_gen(path: Path, seed: int) -> None:
    import csv
    import io

    rows = gen_rows(seed, chat=False)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["id", "prompt", "sampling_params"])
    for i, r in enumerate(rows):
        if i == 9:
            w.writerow([r["id"], r["prompt"], "{not json"])
        elif i == 31:
            w.writerow([r["id"], "", json.dumps(r["sampling_params"])])  # empty cell: no prompt
        elif i == 88:
            w.writerow([r["id"], r["prompt"], json.dumps({"top_p": 7})])
        elif i == 130:
            buf.write(f"{r['id']},too,many,fields,here\n")
        else:
            w.writerow([r["id"], r["prompt"], json.dumps(r["sampling_params"])])
    path.write_text(buf.getvalue())


def write_parquet_gen(path: Path, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gen_rows(seed, chat=True)
    recs = []
    for i, r in enumerate(rows):
        rec = {"id": r["id"], "prompt": r.get("prompt"), "messages": r.get("messages"),
               "sampling_params": {"max_tokens": r["sampling_params"]["max_tokens"],
                                   "temperature": r["sampling_params"].get("temperature")}}
        if i in (13, 99):
            rec["prompt"], rec["messages"] = None, None
        if i == 57:
            rec["sampling_params"]["temperature"] = -2.0
        recs.append(rec)
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("sampling_params", pa.struct([("max_tokens", pa.int64()), ("temperature", pa.float64())]))])
    pq.write_table(pa.Table.from_pylist(recs, schema=schema), path, row_group_size=37)


def write_openai_gen(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    lines = []
    for i in range(N_ROWS):
        body: dict = {"model": "any", "max_tokens": rng.randint(1, 12)}
        if i % 4 == 2:
            body["temperature"] = 0.9
        else:
            body["temperature"] = 0
        if i % 2:
            url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text(rng)}]
        else:
            url, body["prompt"] = "/v1/completions", text(rng)
        line = {"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}
        if i == 11:
            line["body"]["suffix"] = "x"
        if i == 44:
            line["url"] = "/v1/nothing"
        if i == 70:
            line["custom_id"] = "c3"  # duplicate
        if i == 101:
            line["body"]["temperature"] = "hot"
        lines.append(json.dumps(line))
    lines.insert(50, "{torn json")
    path.write_text("\n".join(lines) + "\n")


def write_jsonl_embed(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    lines = [json.dumps({"id": f"e{i}", "prompt": text(rng, 1, 30)}) for i in range(N_ROWS)]
    lines[7] = json.dumps({"id": "bad", "prompt": 12})
    lines[66] = json.dumps({"id": "none"})
    lines.insert(90, "garbage")
    path.write_text("\n".join(lines) + "\n")


def write_csv_embed(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    lines = ["id,prompt"] + [f"e{i},{text(rng, 1, 30)}" for i in range(N_ROWS)]
    lines[20] = "e19,"  # empty prompt cell
    lines[50] = 'e49,"unclosed'
    path.write_text("\n".join(lines) + "\n")


def write_openai_embed(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    lines = []
    for i in range(N_ROWS):
        inp = text(rng, 1, 30) if i % 3 else [text(rng, 1, 10), text(rng, 1, 10)]
        lines.append(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": inp}}))
    lines[15] = json.dumps({"custom_id": "e15", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}})
    lines[80] = json.dumps({"custom_id": "e80", "method": "POST", "url": "/v1/embeddings", "body": {"input": 3.5}})
    path.write_text("\n".join(lines) + "\n")


def scenarios(models: Path) -> dict[str, tuple[Callable[[Path], None], str, str, list[str]]]:
    """name -> (input writer, input extension, output extension, `tokenmill run` flags)."""
    gen = ["--model", str(models / "llama"), "--dtype", "float32", "--device", "cpu", "--max-model-len", "128",
           "--kv-cache-memory-bytes", str(32 << 20), "--temperature", "0", "--max-tokens", "8"]
    embed = ["--task", "embed", "--model", str(models / "bert_embedder"), "--dtype", "float32", "--device", "cpu"]
    return {
        "gen-jsonl-jsonl": (lambda p: write_jsonl_gen(p, 1, chat=True), "jsonl", "jsonl", [*gen, "--max-num-seqs", "4"]),
        "gen-jsonl-parquet": (lambda p: write_jsonl_gen(p, 2, chat=True), "jsonl", "parquet", [*gen, "--max-num-seqs", "3"]),
        "gen-jsonl-n2": (lambda p: write_jsonl_gen(p, 3, chat=False), "jsonl", "jsonl",
                         [*gen, "--max-num-seqs", "4", "--n", "2", "--temperature", "0.8", "--seed", "3"]),
        "gen-csv-jsonl": (lambda p: write_csv_gen(p, 4), "csv", "jsonl", [*gen, "--max-num-seqs", "2"]),
        "gen-parquet-parquet": (lambda p: write_parquet_gen(p, 5), "parquet", "parquet", [*gen, "--max-num-seqs", "4"]),
        "gen-openai-jsonl": (lambda p: write_openai_gen(p, 6), "jsonl", "jsonl", [*gen, "--max-num-seqs", "4"]),
        "gen-openai-parquet": (lambda p: write_openai_gen(p, 7), "jsonl", "parquet", [*gen, "--max-num-seqs", "4"]),
        "gen-jsonl-det": (lambda p: write_jsonl_gen(p, 8, chat=True), "jsonl", "jsonl",
                          [*gen, "--max-num-seqs", "4", "--deterministic"]),
        "gen-jsonl-r2": (lambda p: write_jsonl_gen(p, 9, chat=True), "jsonl", "jsonl", [*gen, "--max-num-seqs", "4", "--replicas", "2"]),
        "gen-openai-r2": (lambda p: write_openai_gen(p, 10), "jsonl", "jsonl", [*gen, "--max-num-seqs", "4", "--replicas", "2"]),
        "gen-csv-parquet-r2": (lambda p: write_csv_gen(p, 11), "csv", "parquet", [*gen, "--max-num-seqs", "2", "--replicas", "2"]),
        "embed-jsonl-jsonl": (lambda p: write_jsonl_embed(p, 12), "jsonl", "jsonl", [*embed, "--max-num-seqs", "4"]),
        "embed-csv-parquet": (lambda p: write_csv_embed(p, 13), "csv", "parquet", [*embed, "--max-num-seqs", "4"]),
        "embed-openai-jsonl": (lambda p: write_openai_embed(p, 14), "jsonl", "jsonl", [*embed, "--max-num-seqs", "4"]),
        "embed-jsonl-r2": (lambda p: write_jsonl_embed(p, 15), "jsonl", "jsonl", [*embed, "--max-num-seqs", "4", "--replicas", "2"]),
    }


def build_models(models: Path, repo: Path) -> None:
    """The tests' tiny random Llama (with a chat template) and tiny BERT embedder, saved once."""
    if (models / "llama").exists() and (models / "bert_embedder").exists():
        return
    import sys

    sys.path.insert(0, str(repo / "tests"))
    from support.tiny_models import save_tiny_bert_embedder, save_tiny_model, tiny_config_kwargs
    from transformers import LlamaConfig

    models.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**tiny_config_kwargs(tie_word_embeddings=False), architectures=["LlamaForCausalLM"])
    save_tiny_model(models, "llama", config, seed=1)
    save_tiny_bert_embedder(models, "bert_embedder", seed=13)
