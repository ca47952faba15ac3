"""`tokenmill run`'s OpenAI batch output against the shapes others document: OpenAI's chat completion
object (a message's ``refusal``), vLLM's server (a choice's ``stop_reason``: the stop string or token
id that ended it; -inf logprobs written as -9999.0), and the status of a line that failed for the
engine's reasons rather than its own (vLLM: 500 ``InternalServerError``; OpenAI: 500 ``server_error``)."""

from __future__ import annotations

import json
import math

from tokenmill import SamplingParams
from tokenmill.batch.job import JobConfig, run_job

from support.jsonl import read_jsonl, write_jsonl
from test_batch_e2e import engine_left_clean, llm  # noqa: F401 (fixtures)

TEXTS = ["the cat sat on a warm mat", "wind blew over its fur", "the sun went down", "a mat while the cat"]


def job(tmp_path, llm, lines, **overrides):
    path = write_jsonl(tmp_path / "batch.jsonl", [{"method": "POST", **line} for line in lines])
    options = dict(input=str(path), output=str(tmp_path / "out.jsonl"), model="tiny", sampling={}, progress=False)
    summary = run_job(JobConfig(**{**options, **overrides}), llm=llm)
    return summary, {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}


def completion(custom_id, text, **body):
    return {"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": text, "temperature": 0, **body}}


def chat(custom_id, text, **body):
    return {"custom_id": custom_id, "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": text}], "temperature": 0, **body}}


def test_choices_say_what_stopped_them_as_vllm_does(tmp_path, llm):
    """vLLM's server writes each choice's ``stop_reason``: the stop string or the stop token id that
    ended it, null when it ended otherwise (eos, max_tokens)."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = llm.generate([TEXTS[0], TEXTS[1]], greedy, use_tqdm=False)
    token = plain[0].outputs[0].token_ids[2]
    stop = plain[1].outputs[0].text[2:4]
    chatted = llm.chat([{"role": "user", "content": TEXTS[2]}], greedy, use_tqdm=False)[0].outputs[0].token_ids[1]
    _, out = job(tmp_path, llm, [
        completion("by-token", TEXTS[0], max_tokens=8, ignore_eos=True, stop_token_ids=[token]),
        completion("by-string", TEXTS[1], max_tokens=8, ignore_eos=True, stop=[stop]),
        completion("by-length", TEXTS[2], max_tokens=2, ignore_eos=True),
        chat("chat-by-token", TEXTS[2], max_tokens=8, ignore_eos=True, stop_token_ids=[chatted]),
    ])
    choices = {cid: line["response"]["body"]["choices"][0] for cid, line in out.items()}
    assert {cid: (c["finish_reason"], c["stop_reason"]) for cid, c in choices.items()} == {
        "by-token": ("stop", token), "by-string": ("stop", stop), "by-length": ("length", None),
        "chat-by-token": ("stop", chatted)}


def test_a_chat_message_carries_openais_refusal_field(tmp_path, llm):
    """OpenAI's chat completion message has ``role``, ``content`` and ``refusal`` (null unless the
    model refused; vLLM's server writes it null too)."""
    _, out = job(tmp_path, llm, [chat("c", TEXTS[0], max_tokens=3)])
    message = out["c"]["response"]["body"]["choices"][0]["message"]
    assert message["role"] == "assistant" and message["refusal"] is None and isinstance(message["content"], str)


# --- lines that failed for the engine's reasons ---------------------------------------------------


def assert_server_error(line, says):
    """OpenAI's shape of an HTTP 500 (vLLM's run-batch: status 500, InternalServerError)."""
    assert line["error"] is None and line["response"]["status_code"] == 500
    error = line["response"]["body"]["error"]
    assert error["type"] == "server_error" and says in error["message"]


def test_a_line_the_engine_ended_with_an_error_is_a_500(tmp_path, llm, monkeypatch):
    """A request the engine ended unfinished (finish_reason "error", with its output's ``error``)
    failed for the engine's reasons: vLLM's server answers 500, not 400."""
    engine = llm.llm_engine
    step = engine.step

    def failing_one(*args, **kwargs):
        outputs = step(*args, **kwargs)
        for out in outputs:
            if out.request_id == "row-1" and out.finished:
                out.error = "its adapter's folder was deleted"
                for c in out.outputs:
                    c.finish_reason = "error"
        return outputs

    monkeypatch.setattr(engine, "step", failing_one)
    summary, out = job(tmp_path, llm, [completion(f"c{i}", t, max_tokens=3) for i, t in enumerate(TEXTS[:3])])
    monkeypatch.undo()
    assert summary.failed == 1 and out["c0"]["response"]["status_code"] == out["c2"]["response"]["status_code"] == 200
    assert_server_error(out["c1"], "its adapter's folder was deleted")


def test_a_line_that_fails_inside_an_engine_step_is_a_500(tmp_path, llm, monkeypatch):
    executor = llm.llm_engine.executor
    execute = executor.execute_model

    def poisoned(plan, *args, **kwargs):
        if any(item.seq.request.request_id == "row-1" for item in plan.scheduled):
            raise RuntimeError("selected index k out of range")
        return execute(plan, *args, **kwargs)

    monkeypatch.setattr(executor, "execute_model", poisoned)
    summary, out = job(tmp_path, llm, [chat(f"c{i}", t, max_tokens=3) for i, t in enumerate(TEXTS)])
    monkeypatch.undo()
    assert summary.failed == 1 and [out[f"c{i}"]["response"]["status_code"] for i in (0, 2, 3)] == [200] * 3
    assert_server_error(out["c1"], "selected index k out of range")


def test_a_line_whose_request_is_refused_stays_a_400(tmp_path, llm):
    _, out = job(tmp_path, llm, [completion("long", "cat " * 400, max_tokens=3), completion("bad", TEXTS[0], top_p=2)])
    for line in out.values():
        assert line["response"]["status_code"] == 400 and line["response"]["body"]["error"]["type"] == "invalid_request_error"


# --- logprobs JSON can hold ---------------------------------------------------------------------


def test_logprobs_of_cut_tokens_are_written_as_vllms_minus_9999(tmp_path, tiny_llama_dir):
    """An engine reporting processed logprobs gives the tokens top_k cut -inf, which JSON cannot
    hold (json.dumps writes ``-Infinity``, which strict readers refuse): vLLM's server writes
    max(logprob, -9999.0) for chat and completion logprobs alike."""
    from tokenmill import LLM

    processed = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=8 * 2**20,
                    max_num_seqs=2, seed=0, logprobs_mode="processed_logprobs")
    sampled = {"max_tokens": 3, "temperature": 1.0, "top_k": 2, "seed": 1}
    _, out = job(tmp_path, processed, [completion("cmpl", TEXTS[0], **sampled, logprobs=4),
                                       chat("chat", TEXTS[1], **sampled, logprobs=True, top_logprobs=4)])
    raw = (tmp_path / "out.jsonl").read_text()
    assert "Infinity" not in raw and "NaN" not in raw
    cmpl = out["cmpl"]["response"]["body"]["choices"][0]["logprobs"]
    tops = [value for position in cmpl["top_logprobs"] for value in position.values()]
    assert -9999.0 in tops and all(math.isfinite(v) and v >= -9999.0 for v in tops + cmpl["token_logprobs"])
    content = out["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    tops = [entry["logprob"] for token in content for entry in token["top_logprobs"]]
    assert -9999.0 in tops and all(math.isfinite(v) and v >= -9999.0 for v in tops)


# --- a bad request against a line that is no request --------------------------------------------


def test_a_line_whose_body_is_refused_is_a_400_like_a_value_the_engine_refuses(tmp_path, llm):
    """OpenAI answers a request with a bad or unsupported parameter with HTTP 400 and an
    invalid_request_error body, whichever check finds it; only a line that is not a request at all
    (no custom_id, not JSON, a url not served) goes to the error file's shape (response null)."""
    lines = [chat("unknown", TEXTS[0], logprob_token_ids=[5]),
             chat("top", TEXTS[0], logprobs=True, top_logprobs=30),
             chat("stream", TEXTS[0], stream=True),
             chat("no-messages", TEXTS[0]),
             completion("prompt", 5),
             completion("top-p", TEXTS[0], top_p=2),  # refused by SamplingParams
             {"custom_id": "url", "url": "/v1/images", "body": {}},
             {"url": "/v1/completions", "body": {"prompt": "x"}}]
    del lines[3]["body"]["messages"]
    summary, out = job(tmp_path, llm, lines)
    assert summary.failed == len(lines)
    says = {"unknown": "['logprob_token_ids']", "top": "top_logprobs=30", "stream": "body.stream=True", "no-messages": "body.messages",
            "prompt": "body.prompt", "top-p": "top_p=2"}
    for custom_id, words in says.items():
        line = out[custom_id]
        assert line["error"] is None and line["response"]["status_code"] == 400, custom_id
        error = line["response"]["body"]["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], custom_id
    for custom_id in ("url", None):
        assert out[custom_id]["response"] is None and out[custom_id]["error"]["code"] == "invalid_request"


def test_a_nan_logprob_is_written_null_as_vllms_json_holds_it():
    """A NaN logprob (a model whose logits overflowed) has no JSON spelling either: vLLM's server
    dumps its response with pydantic, which writes NaN as null; json.dumps wrote NaN, which strict
    readers refuse, and so the whole line was lost to them."""
    from tokenmill.batch.openai_batch import build_openai_request, openai_record
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.results import RowResult, SampleResult
    from tokenmill.batch.writers import encode_lines
    from tokenmill.outputs import Logprob

    nan = float("nan")
    lines = {"chat": chat("chat", "x", logprobs=True, top_logprobs=1), "cmpl": completion("cmpl", "x", logprobs=1,
                                                                                           prompt_logprobs=0)}
    for custom_id, line in lines.items():
        meta = build_openai_request(RawRow(0, {"method": "POST", **line}, None, "line 1")).openai
        sample = SampleResult(0, "He", [5], "length", nan, [{5: Logprob(nan, 1, "He")}])
        result = RowResult(0, custom_id, 2, [sample], openai=meta, prompt_logprobs=[None, {7: Logprob(nan, 1, "x")}])
        text = encode_lines([openai_record(result, "m", 0, "j")]).decode()
        assert "NaN" not in text
        choice = json.loads(text)["response"]["body"]["choices"][0]
        if custom_id == "chat":
            assert choice["logprobs"]["content"][0]["logprob"] is None
        else:
            assert choice["logprobs"]["token_logprobs"] == [None] and choice["logprobs"]["top_logprobs"] == [{"He": None}]
            assert choice["prompt_logprobs"] == [None, {"7": {"logprob": None, "rank": 1, "decoded_token": "x"}}]
