"""The README's first command, `tokenmill run examples/products.jsonl -o results.jsonl`, on the built-in
default model (a few rows, a few tokens, to stay fast on CI's CPU)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.batch.job import DEFAULT_MODEL, JobConfig, run_job
from tokenmill.batch.requests import PromptSettings

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "products.jsonl"
ROWS = 2
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, max_model_len=256, max_num_seqs=4, seed=0)


@pytest.fixture(scope="module")
def example_rows():
    with open(EXAMPLE, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def rows(example_rows):
    """The example rows without their own sampling_params, so the job-level settings below apply."""
    return [{k: v for k, v in r.items() if k != "sampling_params"} for r in example_rows]


def test_example_file_is_realistic(example_rows):
    rows = example_rows
    assert 20 <= len(rows) <= 30
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert {"id", "product", "features", "audience", "messages"} <= set(r)
        assert r["messages"][0]["role"] == "user" and r["product"] in r["messages"][0]["content"]
        assert r["sampling_params"]["max_tokens"] >= 32  # room for a whole line on the first run
        # Settings that suit a 135M model: mild penalties against loops, and one line only.
        params = r["sampling_params"]
        assert 1.0 < params["repetition_penalty"] <= 1.2 and 0.0 < params["frequency_penalty"] <= 1.0
        assert params["stop"] == ["\n"]


def test_products_example_on_default_model(tmp_path, llm, rows):
    subset = tmp_path / "products.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in rows[:ROWS]))
    summary = run_job(JobConfig(input=str(subset), output=str(tmp_path / "results.jsonl"),
                                sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0}, progress=False), llm=llm)
    assert summary.exit_code == 0 and summary.rows_done == ROWS
    out = {r["id"]: r for r in map(json.loads, open(tmp_path / "results.jsonl"))}
    expected = llm.chat([r["messages"] for r in rows[:ROWS]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                        use_tqdm=False)
    for r, e in zip(rows[:ROWS], expected):
        assert out[r["id"]]["text"] == e.outputs[0].text and out[r["id"]]["text"].strip()
        assert out[r["id"]]["prompt_tokens"] == len(e.prompt_token_ids)


def test_products_with_prompt_template_and_system(tmp_path, llm, rows):
    subset = tmp_path / "products.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    template = "Slogan for {product}, with {features}, for {audience}:"
    system = "You write short, upbeat marketing copy."
    run_job(JobConfig(input=str(subset), output=str(tmp_path / "lines.jsonl"),
                      prompt=PromptSettings(chat=True, system=system, prompt_template=template),
                      sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0}, progress=False), llm=llm)
    out = {r["id"]: r["text"] for r in map(json.loads, open(tmp_path / "lines.jsonl"))}
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": template.format(product=r["product"], features=", ".join(r["features"]),
                                                                   audience=r["audience"])}] for r in rows[:1]]
    expected = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert out == {r["id"]: e.outputs[0].text for r, e in zip(rows[:1], expected)}


def loops(text: str) -> bool:
    """Whether a word comes back three times in one short line ("Warm-to-Cool, Warm-to-Cool, ...")."""
    words = [w.strip(".,:;!?\"'*()#").lower() for w in text.split()]
    return any(count >= 3 for count in Counter(w for w in words if len(w) >= 5).values())


@pytest.mark.slow
def test_readme_job_lines_are_lines_not_loops(tmp_path, llm, example_rows):
    """The first thing a new user sees: the README job, every row with its own settings."""
    summary = run_job(JobConfig(input=str(EXAMPLE), output=str(tmp_path / "results.jsonl"), progress=False), llm=llm)
    assert summary.exit_code == 0 and summary.rows_done == len(example_rows)
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert not [r["text"] for r in records if loops(r["text"])]
    assert sum(r["finish_reason"] == "stop" for r in records) >= 0.75 * len(records)
    assert all(r["text"].strip() for r in records)
