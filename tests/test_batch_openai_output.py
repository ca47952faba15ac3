"""`tokenmill run`'s OpenAI batch output against the shapes others document: OpenAI's chat completion
object (a message's ``refusal``), vLLM's server (a choice's ``stop_reason``: the stop string or token
id that ended it; -inf logprobs written as -9999.0), and the status of a line that failed for the
engine's reasons rather than its own (vLLM: 500 ``InternalServerError``; OpenAI: 500 ``server_error``)."""

from __future__ import annotations

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
