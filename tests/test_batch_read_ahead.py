"""Rows read ahead of the engine (`batch/rows_ahead.py`): their prompts made in batches larger than a
refill give each row the ids transformers gives it alone; a bad conversation in a large batch fails
alone, with its own error, found by halves (not every row rendered alone); the read-ahead stays
within its bounds; and a stop with rows read ahead but not submitted loses and repeats nothing."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM
from tokenmill.batch import rows_ahead
from tokenmill.batch.job import JobConfig, run_job
from tokenmill.batch.readers import RawRow
from tokenmill.inputs import render_chat_prompts, render_chat_prompts_each

from support.jsonl import read_jsonl, write_jsonl

TEMPLATE = ("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom in ' + m.role) }}"
            "{% endif %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = "the cat sat on a warm mat while wind blew over its fur and the sun went down".split()
ODD = ["café, naïve, 東京 and 🙂", "<|user|>a role tag typed as text</s>", "  two  spaces\tand a tab", "x"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
               kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8, seed=0)


@pytest.fixture(autouse=True)
def engine_left_clean(llm):
    yield
    assert not llm.llm_engine.has_unfinished_requests()


def conversations(count: int, seed: int) -> list[list[dict]]:
    """Varied conversations: one or several turns, a system turn, text a tokenizer could split oddly."""
    rng = random.Random(seed)
    made = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        turns = [{"role": "user", "content": ODD[i % len(ODD)] if i % 3 == 0 else text}]
        if i % 4 == 1:
            turns = [{"role": "system", "content": "Be brief."}, *turns, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": text[::-1]}]
        made.append(turns)
    return made


def alone(tokenizer, conversation: list[dict]) -> list[int]:
    """The reference: transformers renders and tokenizes the one conversation."""
    return tokenizer.apply_chat_template(conversation, chat_template=TEMPLATE, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def run(folder, llm, rows, should_stop=None, **overrides):
    """A job of ``rows`` in ``folder`` (sampled: each row's tokens follow its own seed), 4 rows in flight."""
    folder.mkdir(exist_ok=True)
    options = dict(input=str(write_jsonl(folder / "in.jsonl", rows)), output=str(folder / "out.jsonl"), model="tiny",
                   sampling={"max_tokens": 3, "temperature": 1.0, "ignore_eos": True}, progress=False,
                   chat_template=TEMPLATE, max_inflight=4, seed=7)
    options.update(overrides)
    return run_job(JobConfig(**options), llm=llm, should_stop=should_stop)


@pytest.fixture
def submitted(llm, monkeypatch):
    """The prompt ids each row reached the engine with, by row index."""
    engine = llm.llm_engine
    seen: dict[int, list[int]] = {}
    original = engine.add_request

    def recording(request_id, prompt, *args, **kwargs):
        seen[int(request_id.removeprefix("row-"))] = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else prompt
        return original(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    return seen


@pytest.fixture
def template_calls(llm, monkeypatch):
    """Each apply_chat_template call: how many conversations it was given."""
    tokenizer = llm.get_tokenizer()
    calls: list[int] = []
    original = type(tokenizer).apply_chat_template

    def counting(self, conversation, *args, **kwargs):
        calls.append(len(conversation) if conversation and isinstance(conversation[0], list) else 1)
        return original(self, conversation, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counting)
    return calls


def test_rows_read_ahead_get_the_ids_each_gets_alone(tmp_path, llm, submitted, template_calls):
    tokenizer = llm.get_tokenizer()
    chats = conversations(40, seed=1)
    expected = [alone(tokenizer, c) for c in chats]
    template_calls.clear()
    summary = run(tmp_path, llm, [{"messages": c} for c in chats])
    assert summary.rows_done == 40 and summary.failed == 0
    assert submitted == dict(enumerate(expected))
    # The template's check when the job starts, then batches of the read-ahead (4 x the 4 rows in
    # flight), not a refill's few rows.
    assert template_calls == [1, 16, 16, 8]


def test_text_rows_read_ahead_are_tokenized_together(tmp_path, llm, submitted):
    tokenizer = llm.get_tokenizer()
    texts = [" ".join(WORDS[i % 7 : i % 7 + 1 + i % 5]) if i % 3 else ODD[i % len(ODD)] for i in range(20)]
    rows = [{"prompt": t} if i % 2 else {"messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    summary = run(tmp_path, llm, rows)
    assert summary.rows_done == 20 and summary.failed == 0
    assert submitted == {i: tokenizer.encode(t) if i % 2 else alone(tokenizer, [{"role": "user", "content": t}])
                         for i, t in enumerate(texts)}


def test_a_bad_row_in_a_large_read_ahead_batch_fails_alone(tmp_path, llm, submitted, template_calls):
    """One conversation that breaks the template among 200 rendered together: that row alone is an
    error row, with the template's own message; the others keep their ids; the bad one is found by
    halving the batch (a few dozen calls at most), not by rendering each of the 200 alone."""
    tokenizer = llm.get_tokenizer()
    chats = conversations(200, seed=2)
    chats[137] = [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "boom"}]
    expected = {i: alone(tokenizer, c) for i, c in enumerate(chats) if i != 137}
    template_calls.clear()
    summary = run(tmp_path, llm, [{"id": f"r{i}", "messages": c} for i, c in enumerate(chats)], max_inflight=64,
                  sampling={"max_tokens": 1, "temperature": 0.0})
    assert summary.rows_done == 200 and summary.failed == 1
    failed = [r for r in read_jsonl(tmp_path / "out.jsonl") if r["error"] is not None]
    assert [(r["row"], r["id"]) for r in failed] == [(137, "r137")]
    assert failed[0]["error"].startswith("line 138") and "no boom in assistant" in failed[0]["error"]
    assert submitted == expected
    assert len(template_calls) < 30 and max(template_calls) == 200  # 200 alone would be 200 calls


def test_each_conversation_gets_its_ids_or_its_own_error(llm):
    """`render_chat_prompts_each` (the job's): bad conversations of either kind, a failed check and a
    template that raises, among good ones; `render_chat_prompts` raises the first one's error."""
    tokenizer = llm.get_tokenizer()
    chats = conversations(9, seed=3)
    chats[2] = [{"content": "no role"}]
    chats[5] = [{"role": "user", "content": "boom"}]
    chats[6] = [{"role": "user", "content": "boom"}]
    results = render_chat_prompts_each(tokenizer, chats, TEMPLATE, [f"messages[{i}]" for i in range(9)])
    assert "messages[2][0] must be a dict with a string 'role'" in str(results[2])
    assert [str(results[i]) for i in (5, 6)] == ["no boom in user"] * 2
    assert {i: r for i, r in enumerate(results) if i not in (2, 5, 6)} == \
        {i: alone(tokenizer, c) for i, c in enumerate(chats) if i not in (2, 5, 6)}
    chats[2] = [{"role": "user", "content": "fine"}]
    with pytest.raises(Exception, match="no boom in user"):
        render_chat_prompts(tokenizer, chats, TEMPLATE, True, False, None, [f"messages[{i}]" for i in range(9)])


# --- the read-ahead's bounds and stops ----------------------------------------------------------


def fake_rows(count: int, pulled: list[int]):
    for index in range(count):
        pulled.append(index)
        yield RawRow(index, {"prompt": "x"}, where=f"line {index + 1}")


def test_read_ahead_keeps_input_order_skips_done_rows_and_stays_within_its_bounds():
    pulled: list[int] = []
    batches: list[list[int]] = []

    def prepare(raws):
        batches.append([raw.index for raw in raws])
        return {raw.index: (None, {"prompt_token_ids": [1] * 100}) for raw in raws if raw.index % 5}  # every 5th: alone

    ahead = rows_ahead.RowsAhead(fake_rows(1000, pulled), lambda index: index % 7 == 0, prepare, max_inflight=10,
                                 should_stop=lambda: False, chunk=16)
    first = ahead.take(3)
    assert [raw.index for raw, _ in first] == [1, 2, 3]
    assert len(pulled) <= 40 * 7 // 6 + 2 and sum(map(len, batches)) == 40  # 4 x 10 rows ahead, no more
    assert [len(b) for b in batches] == [16, 16, 8]
    assert first[0][1] == (None, {"prompt_token_ids": [1] * 100}) and ahead.take(2)[1][1] is None  # row 5: made alone
    taken = [raw.index for raw, _ in ahead.take(10_000)]
    assert taken == [i for i in range(6, 1000) if i % 7] and ahead.finished
    # The token bound: 100-token prompts, 2,000 tokens ahead at most (plus the chunk that passed it).
    batches.clear()
    ahead = rows_ahead.RowsAhead(fake_rows(1000, []), lambda index: False, prepare, max_inflight=100,
                                 should_stop=lambda: False, chunk=8, tokens_ahead=2_000)
    ahead.take(1)
    assert sum(map(len, batches)) == 32  # the 4th chunk of 8 passes 2,000 tokens (6-7 prompts of 100 a chunk)


def test_a_stop_cuts_a_long_read_ahead_short():
    """A read-ahead that runs long asks whether the job stops after each chunk; a short one never
    asks (the loop asks once a step)."""
    calls: list[int] = []
    polls: list[int] = []

    def should_stop():
        polls.append(1)
        return len(calls) >= 3

    ahead = rows_ahead.RowsAhead(fake_rows(10_000, []), lambda index: False, lambda raws: calls.append(len(raws)) or {},
                                 max_inflight=1_000, should_stop=should_stop, chunk=8, stop_poll_s=0.0)
    assert ahead.take(500) == [] and calls == [8, 8, 8]  # cut short: nothing handed out, nothing more read
    assert len(ahead.take(500)) == 24 and calls == [8, 8, 8, 8] and not ahead.finished  # the rows ready; one chunk more
    polls.clear()
    ahead = rows_ahead.RowsAhead(fake_rows(100, []), lambda index: False, lambda raws: {}, max_inflight=1_000,
                                 should_stop=should_stop, chunk=8)
    assert len(ahead.take(500)) == 100 and ahead.finished and polls == []


def test_a_stop_with_rows_read_ahead_loses_and_repeats_nothing(tmp_path, llm, monkeypatch):
    """Stopped while the read-ahead holds rows it made but never submitted: those rows are not
    written; the resumed run writes every row once, as an uninterrupted run writes it (sampled
    rows: each row's seed is its own, whatever ran beside it)."""
    chats = conversations(48, seed=4)
    rows = [{"messages": c} for c in chats]
    run(tmp_path / "whole", llm, rows)
    whole = {r["row"]: r["text"] for r in read_jsonl(tmp_path / "whole" / "out.jsonl")}
    assert sorted(whole) == list(range(48))

    prepared: list[int] = []
    taken: list[int] = []
    original_read_ahead, original_take = rows_ahead.RowsAhead._read_ahead, rows_ahead.RowsAhead.take

    def read_ahead(self):
        before = len(self._ready)
        original_read_ahead(self)
        prepared.extend(raw.index for raw, _ in list(self._ready)[before:])

    def take(self, count):
        got = original_take(self, count)
        taken.extend(raw.index for raw, _ in got)
        return got

    monkeypatch.setattr(rows_ahead.RowsAhead, "_read_ahead", read_ahead)
    monkeypatch.setattr(rows_ahead.RowsAhead, "take", take)
    engine, steps = llm.llm_engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda *a, **k: steps.append(1) or step(*a, **k))
    first = run(tmp_path / "cut", llm, rows, should_stop=lambda: len(steps) >= 6)
    assert first.interrupted and 0 < first.rows_done < 16
    held = sorted(set(prepared) - set(taken))
    assert held and max(held) < 16  # the stop came with rows of the first read-ahead batch never submitted
    written = [r["row"] for r in read_jsonl(tmp_path / "cut" / "out.jsonl")]
    assert len(written) == len(set(written)) == first.rows_done and not set(written) & set(held)

    monkeypatch.undo()
    second = run(tmp_path / "cut", llm, rows)
    assert second.rows_done == 48 and second.resumed_rows == first.rows_done
    records = read_jsonl(tmp_path / "cut" / "out.jsonl")
    assert sorted(r["row"] for r in records) == list(range(48))  # each row once
    assert {r["row"]: r["text"] for r in records} == whole
