"""`tokenmill run` end to end on a tiny random Llama: every input format round-trips, results match
`LLM.generate`/`LLM.chat`, memory stays bounded, bad rows fail alone, and interrupted jobs resume."""

from __future__ import annotations

import csv
import io
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.journal import ResumeError
from tokenmill.batch.requests import PromptSettings

from support.jsonl import read_jsonl, write_jsonl

MAX_TOKENS = 6
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
WORDS = "the cat sat on a warm mat while wind blew over its fur and the sun went down".split()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
               kv_cache_memory_bytes=32 * 2**20, max_num_seqs=4, seed=0)


@pytest.fixture(autouse=True)
def engine_left_clean(request):
    yield
    if "llm" in request.fixturenames:
        assert not request.getfixturevalue("llm").llm_engine.has_unfinished_requests()


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(count)]


def reference(llm, texts, chat=False, **sampling):
    params = SamplingParams(**{**GREEDY, **sampling})
    if chat:
        outs = llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)
    else:
        outs = llm.generate(texts, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def job(tmp_path, llm, input_path, output="out.jsonl", **overrides):
    options = dict(input=str(input_path), output=str(tmp_path / output), model="tiny", sampling=dict(GREEDY),
                   progress=False)
    options.update(overrides)
    return run_job(JobConfig(**options), llm=llm)


def by_row(records):
    rows = {}
    for r in records:
        assert (r["row"], r["sample_index"]) not in rows, f"row {r['row']} written twice"
        rows[(r["row"], r["sample_index"])] = r
    return rows


# --- formats -----------------------------------------------------------------------------------


def test_jsonl_prompts_match_generate(tmp_path, llm):
    texts = prompts(10)
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": t} for i, t in enumerate(texts)])
    summary = job(tmp_path, llm, path)
    assert summary.exit_code == 0 and summary.rows_done == 10 and summary.failed == 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(records) == [(i, 0) for i in range(10)]
    expected = reference(llm, texts)
    for i in range(10):
        r = records[(i, 0)]
        assert (r["id"], r["text"], r["finish_reason"], r["completion_tokens"]) == (f"r{i}", expected[i], "length", MAX_TOKENS)
        assert r["prompt_tokens"] == len(llm.get_tokenizer().encode(texts[i]))
    assert summary.prompt_tokens == sum(r["prompt_tokens"] for r in records.values())


def test_rows_submitted_together_get_the_prompts_each_gets_alone(tmp_path, llm, monkeypatch):
    """A refill's text rows are tokenized in one tokenizer call and its chat rows rendered in one
    (batch/row_prompts.py); each row gets the ids transformers gives it alone, and a row that
    breaks the chat batch (its template raises) fails alone while the others run."""
    tokenizer = llm.get_tokenizer()
    calls = []
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__",
                        lambda self, text=None, *a, **k: calls.append(len(text) if isinstance(text, list) else 1)
                        or original(self, text, *a, **k))
    template = ("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
                "<|user|>{{ m.content }}\n{% endfor %}<|assistant|>")
    texts = prompts(7, seed=9)
    rows = [{"prompt": t} if i % 2 else {"messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    alone = [tokenizer.encode(t) if i % 2 else tokenizer.apply_chat_template(
        r["messages"], chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False)
        for i, (t, r) in enumerate(zip(texts, rows))]
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": ids} for ids in alone],
                                                        SamplingParams(**GREEDY), use_tqdm=False)]
    for broken in (None, 4):
        if broken is not None:
            rows[broken] = {"messages": [{"role": "user", "content": "boom"}]}
        calls.clear()
        job(tmp_path, llm, write_jsonl(tmp_path / "in.jsonl", rows), max_inflight=16, overwrite=True,
            chat_template=template)
        records = by_row(read_jsonl(tmp_path / "out.jsonl"))
        assert 3 in calls and (broken is not None or 4 in calls)  # the 3 texts together; the 4 chats too
        for i in range(7):
            if i == broken:
                assert "no boom" in records[(i, None)]["error"]
            else:
                assert (records[(i, 0)]["text"], records[(i, 0)]["prompt_tokens"]) == (expected[i], len(alone[i]))


def test_jsonl_messages_and_chat_flag(tmp_path, llm):
    texts = prompts(4, seed=1)
    rows = [{"messages": [{"role": "user", "content": t}]} for t in texts[:2]] + [{"prompt": t} for t in texts[2:]]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    job(tmp_path, llm, path, prompt=PromptSettings(chat=True))
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert [records[(i, 0)]["text"] for i in range(4)] == reference(llm, texts, chat=True)


def test_a_chat_template_no_row_can_use_is_a_usage_error_before_any_row(tmp_path, llm, monkeypatch):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(3)])
    with pytest.raises(ValueError, match=r"--chat-template is not a valid Jinja template: .* \(line 1\)"):
        job(tmp_path, llm, path, chat_template="{{ messages[0]['content'] ")
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="--chat and --system need a chat template, and the model tiny has none"):
        job(tmp_path, llm, path, prompt=PromptSettings(system="be brief"))
    assert not (tmp_path / "out.jsonl").exists()  # no row was written as failed, and a refused run leaves no file


def test_csv_with_prompt_template(tmp_path, llm):
    path = tmp_path / "in.csv"
    names = ["cat", "mat", "sun"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sku", "name", "where"])
        for i, n in enumerate(names):
            w.writerow([f"s{i}", n, "on the mat"])
    job(tmp_path, llm, path, prompt=PromptSettings(prompt_template="the {name} sat {where}", id_field="sku"))
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert [records[(i, 0)]["id"] for i in range(3)] == ["s0", "s1", "s2"]
    assert [records[(i, 0)]["text"] for i in range(3)] == reference(llm, [f"the {n} sat on the mat" for n in names])


def test_tsv_text_field(tmp_path, llm):
    texts = prompts(3, seed=2)
    path = tmp_path / "in.tsv"
    path.write_text("body\tn\n" + "".join(f"{t}\t{i}\n" for i, t in enumerate(texts)))
    job(tmp_path, llm, path, prompt=PromptSettings(text_field="body"))
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert [records[(i, 0)]["text"] for i in range(3)] == reference(llm, texts)


def test_parquet_in_parquet_out(tmp_path, llm):
    texts = prompts(6, seed=3)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(100, 106)), "prompt": texts}), path, row_group_size=4)
    summary = job(tmp_path, llm, path, output="out.parquet")
    assert summary.exit_code == 0
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sorted(r["row"] for r in table) == list(range(6))
    expected = reference(llm, texts)
    for r in table:
        assert r["id"] == str(100 + r["row"]) and r["text"] == expected[r["row"]] and r["error"] is None
    side = str(tmp_path / "out.parquet") + ".tokenmill"
    assert sorted(os.listdir(side)) == ["lock", "state.json"]  # staging and journal cleaned up


def test_rows_carry_repetition_detection(tmp_path, llm):
    """A Parquet struct column of sampling values, one row forced into a one-token loop (a logit
    bias) with detection on: it ends early with finish_reason "repetition", as LLM.generate does.
    Arrow fills the keys a row left out with nulls (min_pattern_size in row 2): not set."""
    texts = prompts(3, seed=6)
    loop = {"repetition_detection": {"max_pattern_size": 1, "min_pattern_size": 1, "min_count": 3}, "logit_bias": {"33": 100.0}}
    sampling = [loop, None, {"repetition_detection": {"max_pattern_size": 3, "min_count": 3}}]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": t, "sampling_params": sp} for t, sp in zip(texts, sampling)]), path)
    summary = job(tmp_path, llm, path, output="out.parquet")
    assert summary.exit_code == 0
    rows = {r["row"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    for i, text in enumerate(texts):
        given = {k: v for k, v in (sampling[i] or {}).items()}
        want = llm.generate([text], SamplingParams(**{**GREEDY, **given}), use_tqdm=False)[0].outputs[0]
        assert (rows[i]["text"], rows[i]["finish_reason"], rows[i]["completion_tokens"]) == \
            (want.text, want.finish_reason, len(want.token_ids))
    assert (rows[0]["finish_reason"], rows[0]["completion_tokens"]) == ("repetition", 3)
    assert rows[1]["finish_reason"] == "length"


def test_n_samples_one_record_each(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(3, seed=4)])
    job(tmp_path, llm, path, sampling={"max_tokens": 4, "temperature": 1.0, "n": 3})
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(records) == [(r, s) for r in range(3) for s in range(3)]


def test_prompt_logprobs_are_written_and_match_transformers(tmp_path, llm, tiny_llama_dir, hf_reference):
    """A scoring job: rows asking for prompt logprobs (a row's own, one in the flat form; or the
    whole job) get each prompt token's logprob and their sum, as HF transformers scores the same
    token ids (teacher-forced log-softmax in fp32); a row asking for none, and an error row, get
    nulls; the Parquet output of a job-wide ask holds every row's values."""
    import torch

    texts = prompts(4, seed=9)
    rows = [{"prompt": texts[0], "sampling_params": {"prompt_logprobs": 0}},
            {"prompt": texts[1], "sampling_params": {"prompt_logprobs": 3, "flat_logprobs": True}},
            {"prompt": texts[2]}, {"prompt": texts[3], "sampling_params": {"prompt_logprobs": 1}}, {"prompt": ""}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = job(tmp_path, llm, path)
    assert summary.failed == 1
    records = {r["row"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    model = hf_reference(tiny_llama_dir)
    tokenizer = llm.get_tokenizer()
    wanted = {}
    for row, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            table = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        wanted[row] = [table[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert records[row]["prompt_tokens"] == len(ids)

    def check(record, want):
        got = record["prompt_token_logprobs"]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4, record["row"]
        assert record["prompt_logprob"] == pytest.approx(sum(want), abs=1e-3)

    for row in (0, 1, 3):
        check(records[row], wanted[row])
    assert records[2]["prompt_logprob"] is None and records[2]["prompt_token_logprobs"] is None  # it asked for none
    assert records[4]["error"] and records[4]["prompt_logprob"] is None and records[4]["prompt_token_logprobs"] is None

    job(tmp_path, llm, path, output="out.parquet", sampling={**GREEDY, "prompt_logprobs": 0})
    table = {r["row"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    for row, want in wanted.items():
        check(table[row], want)
    assert table[4]["error"] and table[4]["prompt_token_logprobs"] is None


def test_openai_batch_round_trip(tmp_path, llm):
    texts = prompts(4, seed=5)
    lines = [
        {"custom_id": "chat-0", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "messages": [{"role": "user", "content": texts[0]}], "max_tokens": 3, "temperature": 0,
                  "prompt_logprobs": 1}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-x", "prompt": texts[1], "max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2,
                  "prompt_logprobs": 0}},
        {"custom_id": "cmpl-2", "method": "POST", "url": "/v1/completions", "body": {"prompt": texts[2], "max_tokens": 2}},
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-x", "prompt": "cat " * 400, "max_tokens": 4}},
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    path = tmp_path / "batch.jsonl"
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write('{"custom_id": "broken", "body": \n')
    summary = job(tmp_path, llm, path, sampling={"ignore_eos": True})
    assert summary.exit_code == 3 and summary.failed == 3
    out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert set(out) == {"chat-0", "cmpl-1", "cmpl-2", "too-long", "embed", None}

    chat = out["chat-0"]["response"]
    assert chat["status_code"] == 200 and out["chat-0"]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reference(llm, [texts[0]], chat=True, max_tokens=3)[0],
                                             "refusal": None}
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    # vLLM's extension: the prompt's logprobs, on the chat response's body (null first, then per position
    # {token id: logprob, rank, decoded_token}), as LLM.chat scores the same conversation
    want = llm.chat([{"role": "user", "content": texts[0]}], SamplingParams(**{**GREEDY, "max_tokens": 3}, prompt_logprobs=1),
                    use_tqdm=False)[0].prompt_logprobs
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(want) == body["usage"]["prompt_tokens"]
    assert body["prompt_logprobs"][1:] == [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                           for t, lp in position.items()} for position in want[1:]]

    cmpl = out["cmpl-1"]["response"]["body"]
    assert cmpl["object"] == "text_completion" and [c["index"] for c in cmpl["choices"]] == [0, 1]
    # (n=2 samples: vLLM refuses n > 1 with greedy sampling, so no greedy reference for this row)
    assert cmpl["usage"]["completion_tokens"] == 8
    positions = cmpl["choices"][0]["prompt_logprobs"]  # each choice carries them, as vLLM's completions do
    assert cmpl["choices"][1]["prompt_logprobs"] == positions and positions[0] is None
    assert len(positions) == cmpl["usage"]["prompt_tokens"] and all(len(p) == 1 for p in positions[1:])  # k = 0: the token
    plain = out["cmpl-2"]["response"]["body"]
    assert "prompt_logprobs" not in plain and "prompt_logprobs" not in plain["choices"][0]  # not asked for

    too_long = out["too-long"]["response"]
    assert too_long["status_code"] == 400 and "max_model_len=128" in too_long["body"]["error"]["message"]
    assert out["embed"]["response"] is None and "/v1/embeddings" in out["embed"]["error"]["message"]
    assert "not valid JSON" in out[None]["error"]["message"]


# --- streaming, bounded memory -----------------------------------------------------------------


class SpyEngine:
    """Delegates to the real engine; records in-flight counts and output size at every step."""

    def __init__(self, engine, output, interrupt_after=None):
        self._engine, self._output, self._interrupt_after = engine, output, interrupt_after
        self.unfinished, self.lines_at_step, self.finished_only = [], [], set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, *args, **kwargs):
        if self._interrupt_after is not None and len(self.unfinished) >= self._interrupt_after:
            raise KeyboardInterrupt
        self.unfinished.append(self._engine.get_num_unfinished_requests())
        self.finished_only.add(kwargs.get("finished_only", args[0] if args else False))
        with open(self._output, "rb") as f:
            self.lines_at_step.append(f.read().count(b"\n"))
        return self._engine.step(*args, **kwargs)


class SpyLLM:
    def __init__(self, llm, output, interrupt_after=None):
        self._llm = llm
        self.llm_engine = SpyEngine(llm.llm_engine, output, interrupt_after)

    def __getattr__(self, name):
        return getattr(self._llm, name)


def test_bounded_inflight_and_results_written_as_they_finish(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(20, seed=6)])
    spy = SpyLLM(llm, tmp_path / "out.jsonl")
    job(tmp_path, spy, path, max_inflight=3)
    assert max(spy.llm_engine.unfinished) == 3
    lines = spy.llm_engine.lines_at_step
    # Rows reach the file while later rows are still running, not at the end.
    assert lines[len(lines) // 2] >= 5 and lines == sorted(lines)
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 20


def test_progress_counts_running_rows_without_their_outputs(tmp_path, llm):
    """The job asks the engine for finished outputs only (an output for every running row every
    step doubled the host's work per token); the progress line still counts the running rows'
    tokens, read from the engine when a line is drawn, so it shows generation before any row ends."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(6, seed=8)])
    spy, stream = SpyLLM(llm, tmp_path / "out.jsonl"), io.StringIO()
    config = JobConfig(input=str(path), output=str(tmp_path / "out.jsonl"), model="tiny",
                       sampling=dict(GREEDY, max_tokens=24), log_interval=0.0)  # a line after every step
    run_job(config, llm=spy, stderr=stream)
    assert spy.llm_engine.finished_only == {True}
    before_any_row = [line for line in stream.getvalue().splitlines() if line.startswith("rows 0/6")]
    generating = [float(line.split("| gen ")[1].split()[0].replace(",", "")) for line in before_any_row]
    assert len(generating) >= 10 and max(generating) > 0
    assert sum(r["completion_tokens"] for r in read_jsonl(tmp_path / "out.jsonl")) == 6 * 24


# --- malformed input ---------------------------------------------------------------------------


def test_fuzz_malformed_rows_fail_alone(tmp_path, llm):
    rng = random.Random(1234)
    good = prompts(12, seed=7)
    bad_lines = [
        b'{"prompt": "the cat sat',  # truncated JSON
        b'{"prompt": 17}',  # wrong type
        b'{"prompt": ["a", "b"]}',
        b'["prompt", "x"]',  # not an object
        b'"just a string"',
        b'{"prompt": "' + b"the cat " * 300 + b'"}',  # longer than max_model_len
        b'{"prompt": "bad \xc3\x28 utf8"}',
        b'\xff\xfe\xfd',
        b'{"prompt": ""}',  # no token: this tokenizer adds no BOS (the engine refuses it, as vLLM does)
        b'{"messages": [{"role": "user"}, 3]}',
        b'{"messages": "hello"}',
        b'{"prompt_token_ids": [1, 2, 999999]}',  # outside the vocabulary
        b'{"prompt": "ok", "sampling_params": {"temperature": -1}}',
        b'{"prompt": "ok", "sampling_params": {"max_tokens": "8"}}',
        b'{"prompt": "ok", "sampling_params": {"top_p": 2}}',
        b'{"prompt": "ok", "sampling_params": {"best_of": 0}}',  # fewer than n
        b'{"text": "no prompt field"}',
        b'{"prompt": "x", "id": {"nested": true}, "sampling_params": 5}',
        b'{' * 100_000,  # deeply nested garbage
    ]
    bad_lines += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))).replace(b"\n", b"") for _ in range(6)]
    bad_lines = [b for b in bad_lines if b.strip()]
    lines = [json.dumps({"id": f"good-{i}", "prompt": t}).encode() for i, t in enumerate(good)] + bad_lines
    rng.shuffle(lines)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n\n".join(lines) + b"\n   \n")  # blank lines in between and at the end

    summary = job(tmp_path, llm, path)
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(r for r, _ in records) == list(range(len(lines)))
    errors = [r for r in records.values() if r["error"] is not None]
    goods = {r["id"]: r for r in records.values() if r["error"] is None}
    assert len(errors) == len(bad_lines) == summary.failed
    assert summary.exit_code == 3 and summary.rows_done == len(lines)
    expected = reference(llm, good)
    assert {k: v["text"] for k, v in goods.items()} == {f"good-{i}": expected[i] for i in range(len(good))}
    messages = " | ".join(r["error"] for r in errors)
    for needle in ["not valid JSON", "must be a JSON object", "not valid UTF-8", "'prompt' must be a string",
                   "max_model_len=128", "is empty: a prompt needs at least one token", "SamplingParams.temperature=-1", "SamplingParams.top_p=2",
                   "SamplingParams.best_of=0", "has no prompt", "outside the vocabulary",
                   "SamplingParams.max_tokens='8'", "'sampling_params' must be an object"]:
        assert needle in messages, needle
    assert all(len(r["error"]) < 400 for r in errors)


# --- resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True}],
                         ids=["greedy", "sampled"])
def test_interrupt_and_resume_matches_uninterrupted(tmp_path, llm, sampling):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(14, seed=8)])
    whole = job(tmp_path, llm, path, output="whole.jsonl", sampling=sampling)
    assert whole.exit_code == 0

    spy = SpyLLM(llm, tmp_path / "part.jsonl", interrupt_after=8)
    first = job(tmp_path, spy, path, output="part.jsonl", sampling=sampling)
    assert first.interrupted and first.exit_code == 130 and 0 < first.rows_done < 14
    with open(tmp_path / "part.jsonl", "ab") as f:
        f.write(b'{"row": 13, "sample_index": 0, "te')  # as if killed halfway through a write

    second = job(tmp_path, llm, path, output="part.jsonl", sampling=sampling)
    assert second.exit_code == 0 and second.resumed_rows == first.rows_done and second.repaired_bytes > 0
    assert second.rows_done == 14
    part, full = by_row(read_jsonl(tmp_path / "part.jsonl")), by_row(read_jsonl(tmp_path / "whole.jsonl"))
    assert {k: v["text"] for k, v in part.items()} == {k: v["text"] for k, v in full.items()}

    third = job(tmp_path, None, path, output="part.jsonl", sampling=sampling)  # no model needed
    assert third.already_complete and third.rows_done == 14 and third.exit_code == 0


def test_interrupt_inside_a_commit_writes_no_row_twice(tmp_path, llm, monkeypatch):
    from tokenmill.batch import journal as journal_module

    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(8, seed=10)])
    real_commit, calls = journal_module.Journal.commit, []

    def commit_then_interrupt(self, *args, **kwargs):
        real_commit(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # after the journal line, before the loop clears its pending rows

    monkeypatch.setattr(journal_module.Journal, "commit", commit_then_interrupt)
    first = job(tmp_path, llm, path, max_inflight=2)
    monkeypatch.setattr(journal_module.Journal, "commit", real_commit)
    assert first.interrupted
    second = job(tmp_path, llm, path)
    assert second.exit_code == 0 and second.resumed_rows == first.rows_done > 0
    records = by_row(read_jsonl(tmp_path / "out.jsonl"))
    assert sorted(records) == [(i, 0) for i in range(8)]


def test_should_stop_stops_between_steps(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(8, seed=11)])
    polls = []
    summary = run_job(JobConfig(input=str(path), output=str(tmp_path / "out.jsonl"), sampling=dict(GREEDY),
                                progress=False, max_inflight=2),
                      llm=llm, should_stop=lambda: polls.append(1) or len(polls) > 10)
    assert summary.interrupted and summary.exit_code == 130 and 0 < summary.rows_done < 8
    assert len(read_jsonl(tmp_path / "out.jsonl")) == summary.rows_done


def test_changed_settings_refuse_then_overwrite(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in prompts(3, seed=9)])
    job(tmp_path, llm, path)
    with pytest.raises(ResumeError, match="max_tokens"):
        job(tmp_path, llm, path, sampling={**GREEDY, "max_tokens": 2})
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "a new row"}) + "\n")
    with pytest.raises(ResumeError, match=r"the input file is not the one the earlier attempt read \(\d+ -> \d+ bytes") as refused:
        job(tmp_path, llm, path)
    assert "input_digest" not in str(refused.value)
    summary = job(tmp_path, llm, path, sampling={**GREEDY, "max_tokens": 2}, overwrite=True)
    assert summary.rows_done == 4 and summary.resumed_rows == 0
    assert {r["completion_tokens"] for r in read_jsonl(tmp_path / "out.jsonl")} == {2}


def test_output_must_not_be_input(tmp_path, llm):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="must not be the input"):
        run_job(JobConfig(input=str(path), output=str(path), sampling=dict(GREEDY), progress=False), llm=llm)
