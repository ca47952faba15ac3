"""The Ray Data processor's prompts, without a cluster (the replica UDF on Arrow batches): a messages
row renders as a `tokenmill run` row does (its tools, documents and chat_template_kwargs), under the
chat template stage's variables, an assistant prefill continued as Ray's stage continues it; an empty
prompt runs as `LLM.generate("")` runs it. The reference is transformers' apply_chat_template."""

from __future__ import annotations

import pytest

from test_ray_processor import ENGINE, GREEDY, _call, _replica
from tokenmill import SamplingParams
from tokenmill.ray import TokenmillProcessorConfig


def test_replica_udf_renders_a_rows_tools_and_chat_template_kwargs(tiny_llama_dir):
    """A messages row's tools, documents and chat_template_kwargs reach its chat template as the batch
    job's rows (batch/chat_options.py) and LLM.chat hand them over, so the prompt is the token ids
    transformers' apply_chat_template makes of the same arguments; a bad value is that row's error,
    naming the field, and a conversation the template refuses fails alone (it failed the batch). They
    were dropped: every row rendered as if it had none."""
    from transformers import AutoTokenizer

    from tokenmill.ray.replica import TokenmillReplica

    template = ("{% if greeting %}{{ greeting }}\n{% endif %}{% for t in tools or [] %}tool {{ t.function.name }}\n"
                "{% endfor %}{% for d in documents or [] %}doc {{ d.title }}\n{% endfor %}"
                "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    replica = TokenmillReplica(str(tiny_llama_dir), {"device": "cpu", **ENGINE}, "generate", template, True, None, None, True)
    chat = [{"role": "user", "content": "the warm mat"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    documents = [{"title": "cats", "text": "they sit"}]
    out = _call(replica, [
        {"messages": chat, "tools": tools, "documents": documents, "chat_template_kwargs": {"greeting": "hello"},
         "sampling_params": GREEDY},
        {"messages": chat, "sampling_params": GREEDY},
        {"messages": [{"role": "user", "content": "boom"}], "sampling_params": GREEDY},  # the template refuses it
    ])
    text_cells = _call(replica, [  # JSON text, as a CSV-made dataset holds them (one Arrow type per column)
        {"messages": chat, "chat_template_kwargs": '{"greeting": "hi"}', "tools": None, "sampling_params": GREEDY},
        {"messages": chat, "chat_template_kwargs": None, "tools": '"hammer"', "sampling_params": GREEDY},
    ])
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def hf_ids(**keywords):
        return tokenizer.apply_chat_template(chat, chat_template=template, add_generation_prompt=True, tokenize=True,
                                             return_dict=False, **keywords)

    assert [r["__inference_error__"] for r in out[:2] + text_cells[:1]] == ["", "", ""]
    assert "the chat template refused it" in out[2]["__inference_error__"] and "no boom" in out[2]["__inference_error__"]
    assert out[0]["prompt_token_ids"] == hf_ids(tools=tools, documents=documents, greeting="hello")
    assert out[1]["prompt_token_ids"] == hf_ids()
    assert text_cells[0]["prompt_token_ids"] == hf_ids(greeting="hi")
    assert "'tools'='hammer' is invalid: must be a non-empty list of tools" in text_cells[1]["__inference_error__"]


def test_replica_udf_continues_an_assistant_prefill_as_rays_chat_template_stage(tiny_llama_dir):
    """Ray's chat template stage adds the generation prompt only after a user message; a conversation
    ending with an assistant message (a prefill) is continued (continue_final_message), so the
    reply goes on from the prefill. Every row got a new assistant turn after it."""
    from transformers import AutoTokenizer

    replica = _replica(tiny_llama_dir, "generate", **ENGINE)
    prefill = [{"role": "user", "content": "the warm mat"}, {"role": "assistant", "content": "The cat"}]
    out = _call(replica, [{"messages": prefill, "sampling_params": GREEDY},
                          {"messages": prefill[:1], "sampling_params": GREEDY}])
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    continued = tokenizer.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True,
                                              tokenize=True, return_dict=False)
    assert out[0]["__inference_error__"] == "" and out[0]["prompt_token_ids"] == continued
    assert out[1]["prompt_token_ids"] == tokenizer.apply_chat_template(prefill[:1], add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)


def test_chat_template_stage_kwargs_reach_every_row_under_the_rows_own(tiny_llama_dir):
    """Ray's ChatTemplateStageConfig has chat_template_kwargs: variables for every row's template
    (they were accepted in chat_template_stage and dropped). A row's own chat_template_kwargs go
    over them, key by key, as vLLM's server lays a request's over its defaults."""
    from transformers import AutoTokenizer

    from tokenmill.ray.replica import TokenmillReplica

    config = TokenmillProcessorConfig(model_source="m", chat_template_stage={"chat_template_kwargs": {"greeting": "hey"}})
    assert config.chat_template_kwargs == {"greeting": "hey"}

    class StageConfig:  # stands in for Ray's ChatTemplateStageConfig, a pydantic model
        def model_dump(self):
            return {"enabled": True, "chat_template": None, "chat_template_kwargs": {"tone": "calm"}}

    assert TokenmillProcessorConfig(model_source="m", chat_template_stage=StageConfig()).chat_template_kwargs == {"tone": "calm"}
    with pytest.raises(ValueError, match=r"chat_template_stage chat_template_kwargs='x' is invalid: must be a dict"):
        TokenmillProcessorConfig(model_source="m", chat_template_stage={"chat_template_kwargs": "x"})
    template = ("{{ greeting }} {{ tone }}\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}<|im_start|>assistant\n")
    replica = TokenmillReplica(str(tiny_llama_dir), {"device": "cpu", **ENGINE}, "generate", template, True, None, None,
                               True, chat_template_kwargs={"greeting": "hey", "tone": "calm"})
    chat = [{"role": "user", "content": "the warm mat"}]
    out = _call(replica, [{"messages": chat, "sampling_params": GREEDY, "chat_template_kwargs": None},
                          {"messages": chat, "sampling_params": GREEDY, "chat_template_kwargs": {"greeting": "yo"}}])
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def hf_ids(**variables):
        return tokenizer.apply_chat_template(chat, chat_template=template, add_generation_prompt=True, tokenize=True,
                                             return_dict=False, **variables)

    assert out[0]["prompt_token_ids"] == hf_ids(greeting="hey", tone="calm")
    assert out[1]["prompt_token_ids"] == hf_ids(greeting="yo", tone="calm")


def test_replica_udf_an_empty_prompt_runs_as_generate_runs_it(tiny_llama_bos_dir, tiny_llama_dir):
    """vLLM's LLM.generate("") runs a tokenizer's BOS (Llama) and refuses a prompt with no token:
    a "" row does the same (it was refused as "'prompt' is empty" whatever the tokenizer), as the
    batch job's rows do."""
    bos = _replica(tiny_llama_bos_dir, "generate", max_model_len=64)
    out = _call(bos, [{"prompt": "", "sampling_params": GREEDY}])
    (ref,) = bos.llm.generate("", SamplingParams(**GREEDY), use_tqdm=False)
    assert out[0]["__inference_error__"] == "" and out[0]["prompt_token_ids"] == ref.prompt_token_ids == [1]
    assert out[0]["generated_tokens"] == ref.outputs[0].token_ids and out[0]["prompt"] == ""
    out = _call(_replica(tiny_llama_dir, "generate", **ENGINE), [{"prompt": "", "sampling_params": GREEDY}])
    assert "is empty: a prompt needs at least one token" in out[0]["__inference_error__"]
