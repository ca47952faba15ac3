"""vLLM's assertions on its `LLM` entrypoint (tests/entrypoints/llm/ of vLLM) that make sense without
a GPU, run against tokenmill: several sampling params, priority, empty and out-of-vocabulary prompts,
max_model_len caps, chat with one BOS and several conversations, prompt logprobs (against Hugging
Face), collective_rpc, several LLMs in one process with their own stats, vLLM's per-call keywords
and import paths, and the engine arguments with an effect (hf_overrides, chunked prefill off, a fixed block count,
generation-config overrides, the LLM-level chat template)."""

from __future__ import annotations

import shutil

import pytest
import torch

from reference import hf_greedy, hf_model, hf_next_logprobs
from tokenmill import LLM, EngineArgs, SamplingParams

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=48, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=8, seed=0)
PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is", "The future of AI is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **OPTIONS)


def test_multiple_sampling_params(llm):
    params = [SamplingParams(temperature=0.01, top_p=0.95), SamplingParams(temperature=0.3, top_p=0.95),
              SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=0.99, top_p=0.95)]
    assert len(llm.generate(PROMPTS, params, use_tqdm=False)) == len(PROMPTS)
    with pytest.raises(ValueError, match="got 3 sampling_params for 4 prompts"):
        llm.generate(PROMPTS, params[:3], use_tqdm=False)
    assert len(llm.generate(PROMPTS, params[0], use_tqdm=False)) == len(PROMPTS)
    assert len(llm.generate(PROMPTS, use_tqdm=False)) == len(PROMPTS)


def test_priority_and_lora_request_as_vllm_checks_them(llm):
    assert len(llm.generate(PROMPTS, None, use_tqdm=False, priority=None, lora_request=None)) == len(PROMPTS)
    assert len(llm.generate(PROMPTS, None, use_tqdm=False, priority=[0] * len(PROMPTS))) == len(PROMPTS)
    assert len(llm.generate(PROMPTS[0], None, use_tqdm=False, priority=[0])) == 1  # one text prompt is one request
    # One int is every prompt's priority (vLLM's test_multiple_priority / test_single_prompt_priority).
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=1)) == len(PROMPTS)
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, priority=1)) == 1
    # vLLM checks only the list's length: numpy's integers (a list, an array from a DataFrame) pass.
    import numpy as np

    for numpy_priority in ([np.int64(1)] * len(PROMPTS), np.arange(len(PROMPTS)), np.int64(1)):
        assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=numpy_priority)) == len(PROMPTS)
    for wrong in ([0] * (len(PROMPTS) - 1), [], [0.5] * len(PROMPTS), True, "1", [np.float64(1)] * len(PROMPTS),
                  np.zeros((len(PROMPTS), 1), dtype=int)):
        with pytest.raises(ValueError, match=f"priority must be an integer or a list of {len(PROMPTS)} integers"):
            llm.generate(PROMPTS, None, use_tqdm=False, priority=wrong)
    assert len(llm.enqueue(PROMPTS, GREEDY, lora_request=None, priority=[3] * len(PROMPTS))) == len(PROMPTS)
    assert len(llm.wait_for_completion(use_tqdm=False)) == len(PROMPTS)
    assert len(llm.enqueue(PROMPTS, GREEDY, priority=2)) == len(PROMPTS)
    assert len(llm.wait_for_completion(use_tqdm=False)) == len(PROMPTS)


def test_empty_and_out_of_vocabulary_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [999999]}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # a refused call leaves nothing queued


def test_max_model_len_caps_prompt_plus_output(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=OPTIONS["max_model_len"] + 10, ignore_eos=True), use_tqdm=False)
    for output in outputs:
        assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == OPTIONS["max_model_len"]
        assert output.outputs[0].finish_reason == "length"


def test_prompt_logprobs_match_hugging_face(llm, tiny_llama_dir):
    output = llm.generate("the cat sat on the mat", SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = output.prompt_token_ids
    assert len(output.prompt_logprobs) == len(ids) and output.prompt_logprobs[0] is None
    reference = hf_model(str(tiny_llama_dir))
    for position in range(1, len(ids)):
        entry = output.prompt_logprobs[position]
        expected = hf_next_logprobs(reference, ids[:position])
        assert ids[position] in entry and 2 <= len(entry) <= 3
        assert abs(entry[ids[position]].logprob - float(expected[ids[position]])) < 1e-4
        assert entry[ids[position]].rank == int((expected > expected[ids[position]]).sum()) + 1


class EchoExtension:
    """A worker extension (vLLM's worker_extension_cls): its methods join the Worker."""

    def echo_rank(self) -> int:
        return self.rank

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def test_collective_rpc_and_a_worker_extension(tiny_llama_dir, llm):
    assert llm.collective_rpc(lambda worker: worker.rank) == [0]
    assert llm.get_world_size() == 1 and llm.get_world_size(include_dp=False) == 1
    extended = LLM(str(tiny_llama_dir), worker_extension_cls=EchoExtension, **OPTIONS)
    assert extended.collective_rpc("echo_rank") == [0]
    assert extended.collective_rpc("parameter_count") == [sum(p.numel() for p in hf_model(str(tiny_llama_dir)).parameters())]
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM(str(tiny_llama_dir), worker_extension_cls="no_such_module.Extension", **OPTIONS)


def test_several_llms_in_one_process(llm, tiny_llama_dir, tiny_qwen2_dir):
    prompts = [{"prompt_token_ids": [5, 70, 91, 13]}, {"prompt_token_ids": [200, 4]}]
    first = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    other = LLM(str(tiny_qwen2_dir), disable_log_stats=False, **OPTIONS)
    second = token_ids(other.generate(prompts, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == first
    assert first == [hf_greedy(hf_model(str(tiny_llama_dir)), p["prompt_token_ids"], 6)[0] for p in prompts]
    assert second == [hf_greedy(hf_model(str(tiny_qwen2_dir)), p["prompt_token_ids"], 6)[0] for p in prompts]
    with_stats = other.generate(prompts, GREEDY, use_tqdm=False)  # vLLM's test_log_stats: every output has metrics
    assert all(o.metrics is not None and o.metrics.first_token_time is not None for o in with_stats)
    for m in (o.metrics for o in with_stats):  # vLLM v1's RequestStateStats names read the same times
        assert m.num_generation_tokens == 6 and m.queued_ts == m.arrival_time and not m.is_corrupted
        assert 0.0 < m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts == m.finished_time
        assert m.first_token_latency == m.first_token_time - m.arrival_time > 0.0
    generated = {m.name: m.value for m in other.get_metrics() if m.name == "vllm:generation_tokens"}
    assert generated == {"vllm:generation_tokens": 24}  # its own registry: the other LLM's tokens are not counted
    sampled = other.generate(prompts[:1], SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=1), use_tqdm=False)
    assert sampled[0].metrics.num_generation_tokens == 12  # every completion's tokens, as vLLM counts them
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()


@pytest.fixture(scope="module")
def bos_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer that adds BOS to every encode, as Llama's does."""
    from tokenizers import processors

    from support.tiny_models import build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("bos") / "llama"
    shutil.copytree(tiny_llama_dir, folder)
    tokenizer = build_tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tokenizer.save_pretrained(folder)
    return folder


BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ marker | default('') }}")


def test_chat_has_one_bos_and_takes_template_kwargs(bos_model_dir):
    llm = LLM(str(bos_model_dir), chat_template=BOS_TEMPLATE, **OPTIONS)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id  # a naive render-then-encode would double it
    messages = [{"role": "user", "content": "the cat"}]
    output = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert output.prompt_token_ids[0] == tokenizer.bos_token_id != output.prompt_token_ids[1]
    system = [{"role": "system", "content": "be brief"}]
    both = llm.chat([system + messages, messages], GREEDY, use_tqdm=False)  # several conversations at once
    assert len(both) == 2 and both[1].prompt_token_ids == output.prompt_token_ids
    assert both[0].prompt_token_ids.count(tokenizer.bos_token_id) == 1
    marked = llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs={"marker": "sat on"})[0]
    assert marked.prompt.endswith("assistant\nsat on")
    assert marked.prompt_token_ids[: len(output.prompt_token_ids)] == output.prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_content_format='markdown' is invalid"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template_content_format="markdown")


PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% set parts = m['content'] %}"
                  "{% for p in parts %}{{ p['type'][0] }}{{ p['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _rendered_by_jinja(template: str, messages: list[dict], bos_token: str) -> str:
    """The reference render: plain jinja2, the messages given in the form the template expects."""
    import jinja2

    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos_token)


def test_chat_content_parts_reach_the_template_in_its_format(llm):
    """vLLM's chat_template_content_format: OpenAI-style content parts are joined into a string for a
    template that prints the content (most models'), and passed as parts to a template that loops over
    them ("auto" tells the two apart); image parts are refused by name."""
    tokenizer = llm.get_tokenizer()
    parts = [{"role": "system", "content": "be"},
             {"role": "user", "content": [{"type": "text", "text": "a cat"}, {"type": "input_text", "text": "sat"}]}]
    as_strings = [{"role": "system", "content": "be"}, {"role": "user", "content": "a cat\nsat"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "be"}]},
                {"role": "user", "content": [{"type": "text", "text": "a cat"}, {"type": "text", "text": "sat"}]}]
    for template, content_format, reference in ((BOS_TEMPLATE, "auto", as_strings), (PARTS_TEMPLATE, "auto", as_parts),
                                                (BOS_TEMPLATE, "string", as_strings), (PARTS_TEMPLATE, "openai", as_parts)):
        out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=template, chat_template_content_format=content_format)[0]
        assert out.prompt_token_ids == tokenizer.encode(_rendered_by_jinja(template, reference, tokenizer.bos_token),
                                                             add_special_tokens=False)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\[0\].content\[0\] has type 'image_url': tokenmill serves text-only"):
        llm.chat(image, GREEDY, use_tqdm=False, chat_template=BOS_TEMPLATE)


TOOL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "{% for call in m.get('tool_calls') or [] %}<call>{{ call['function']['name'] }} "
                 "{{ call['function']['arguments'] | tojson }}</call>{% endfor %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_call_histories_reach_the_template_as_vllm_prepares_them(llm):
    """An assistant turn with content None and OpenAI-form tool calls (arguments a JSON string): the
    content renders empty and the arguments as the object (vLLM's chat_utils does both), against a
    plain-jinja2 render of the conversation in that form."""
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}},
                                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    prepared = [messages[0], {**messages[1], "content": "",
                              "tool_calls": [{**messages[1]["tool_calls"][0], "function": {"name": "get", "arguments": {"city": "Paris"}}},
                                             {**messages[1]["tool_calls"][1], "function": {"name": "now", "arguments": {}}}]},
                messages[2]]
    from tokenmill.inputs import render_chat_prompt  # what chat() sends (this conversation outgrows the tiny model)

    ids = render_chat_prompt(tokenizer, messages, chat_template=TOOL_TEMPLATE)
    assert ids == tokenizer.encode(_rendered_by_jinja(TOOL_TEMPLATE, prepared, tokenizer.bos_token), add_special_tokens=False)
    assert messages[1]["content"] is None and isinstance(messages[1]["tool_calls"][0]["function"]["arguments"], str)  # not mutated
    bad = [messages[0], {"role": "assistant", "content": None,
                         "tool_calls": [{"function": {"name": "get", "arguments": "{city: Paris"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\[1\].tool_calls\[0\].function.arguments must be JSON"):
        llm.chat(bad, GREEDY, use_tqdm=False, chat_template=TOOL_TEMPLATE)
    assert llm.chat([{"role": "user", "content": None}], GREEDY, use_tqdm=False, chat_template=TOOL_TEMPLATE)[0].outputs


def test_chat_template_given_as_long_text_or_a_path(llm, tmp_path):
    """A template's text longer than a file name may be (OSError from the file check in vLLM too,
    which it takes as the template), a pathlib.Path, and template kwargs that repeat an argument."""
    from pathlib import Path

    messages = [{"role": "user", "content": "the cat"}]
    long = BOS_TEMPLATE + "{# " + "x" * 400 + " #}"
    want = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=BOS_TEMPLATE)[0].prompt_token_ids
    assert llm.chat(messages, GREEDY, use_tqdm=False, chat_template=long)[0].prompt_token_ids == want
    (tmp_path / "t.jinja").write_text(BOS_TEMPLATE)
    assert llm.chat(messages, GREEDY, use_tqdm=False, chat_template=Path(tmp_path / "t.jinja"))[0].prompt_token_ids == want
    # vLLM merges chat_template_kwargs under the call's own arguments: the explicit one wins, no TypeError.
    merged = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=BOS_TEMPLATE,
                      chat_template_kwargs={"add_generation_prompt": False, "tools": None})[0]
    assert merged.prompt_token_ids == want
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=BOS_TEMPLATE, chat_template_kwargs={"tokenize": False})


def test_chat_arguments_of_the_wrong_kind_are_refused_by_name(llm):
    """Each was blamed on the conversation (the template's TypeError), ran as True, or raised a bare
    TypeError; a tuple of messages is one conversation, as in vLLM."""
    messages = [{"role": "user", "content": "the cat"}]
    want = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=BOS_TEMPLATE)[0].prompt_token_ids
    assert llm.chat(tuple(messages), GREEDY, use_tqdm=False, chat_template=BOS_TEMPLATE)[0].prompt_token_ids == want
    wrong = [
        (dict(chat_template_kwargs={1: True}), r"chat_template_kwargs keys must be strings .*got \[1\]"),
        (dict(chat_template_kwargs={"messages": []}), r"chat_template_kwargs may not set \['messages'\]"),
        (dict(tools="get_weather"), r"tools='get_weather' is invalid: must be None or a list of tools"),
        (dict(add_generation_prompt="no"), r"add_generation_prompt='no' is invalid: must be True or False"),
        (dict(continue_final_message=1), r"continue_final_message=1 is invalid: must be True or False"),
        (dict(chat_template=5), r"chat_template=5 is invalid: must be a Jinja template or the path"),
    ]
    for kwargs, message in wrong:
        with pytest.raises(ValueError, match=message):
            llm.chat(messages, GREEDY, use_tqdm=False, **{"chat_template": BOS_TEMPLATE, **kwargs})


def test_generate_keywords_of_vllm(llm):
    tokenizer = llm.get_tokenizer()
    text = "the weather is fine today"
    out = llm.generate([text], GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 3},
                       priority=[0])[0]
    assert out.prompt_token_ids == tokenizer(text, truncation=True, max_length=3)["input_ids"]
    assert len(out.prompt_token_ids) == 3
    with pytest.raises(ValueError, match="priority must be an integer or a list of 2 integers"):
        llm.generate([text, text], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="lora_request=.* needs an engine started with enable_lora=True"):
        llm.generate([text], GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="mm_processor_kwargs is not supported"):
        llm.generate([text], GREEDY, use_tqdm=False, mm_processor_kwargs={"num_crops": 4})
    from tqdm import tqdm

    bars = []

    def factory(**kwargs):
        bars.append(tqdm(disable=True, **kwargs))
        return bars[-1]

    extra = GREEDY.clone(extra_args={"my_plugin": {"alpha": 1}})
    assert token_ids(llm.generate([text], extra, use_tqdm=factory)) == token_ids(llm.generate([text], GREEDY, use_tqdm=False))
    assert bars and bars[0].total == 1
    with pytest.raises(ValueError, match=r"SamplingParams.extra_args=5 is invalid"):
        SamplingParams(extra_args=5)


def test_llm_engine_add_request_keywords_of_vllm(llm, caplog):
    """vLLM's LLMEngine.add_request(request_id, prompt, params, arrival_time, lora_request,
    tokenization_kwargs, trace_headers, priority, prompt_text) -> request_id, and its small controls."""
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    text = "the weather is fine today"
    ids = tokenizer(text)["input_ids"]
    import time

    assert engine.add_request("kw-1", text, GREEDY, time.time() - 30.0, None, {"truncation": True, "max_length": 3},
                              {"traceparent": "00-1-2-01"}, 7) == "kw-1"
    assert engine.add_request("kw-2", {"prompt_token_ids": ids}, GREEDY, prompt_text=text) == "kw-2"
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    metrics = outputs["kw-1"].metrics  # arrived 30 s ago by the wall clock (vLLM's), on the engine's clock here
    # vLLM loads a generation model's tokenizer with truncation_side="left": the last 3 tokens.
    assert outputs["kw-1"].prompt_token_ids == ids[-3:] and 30.0 <= metrics.first_token_time - metrics.arrival_time < 60.0
    assert outputs["kw-2"].prompt == text
    assert token_ids([outputs["kw-2"]]) == token_ids(llm.generate([text], GREEDY, use_tqdm=False))
    with pytest.raises(TypeError, match="request_id must be a string, got int"):
        engine.add_request(5, text, GREEDY)
    with pytest.raises(ValueError, match="priority=1.5 is invalid"):
        engine.add_request("kw-3", text, GREEDY, priority=1.5)
    with pytest.raises(ValueError, match="lora_request=.* needs an engine started with enable_lora=True"):
        engine.add_request("kw-3", text, GREEDY, lora_request=object())
    for arrival in ("abc", float("nan"), True):  # float("abc") failed without the keyword named
        with pytest.raises(ValueError, match=r"arrival_time=.* is invalid: must be None or a finite number"):
            engine.add_request("kw-3", text, GREEDY, arrival_time=arrival)
    engine.abort_request("no-such-request")  # as vLLM: an unknown id is no error
    for ids in (None, 5):  # iterating them failed with a bare "'NoneType' object is not iterable"
        with pytest.raises(TypeError, match="request_ids must be a request id .* or a list of them, got"):
            engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    assert engine.get_supported_tasks() == ("generate",)
    assert engine.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
    assert engine.list_loras() == set() and engine.remove_lora(1) is False and engine.reset_encoder_cache() is None
    with pytest.raises(ValueError, match="add_lora needs an engine started with enable_lora=True"):
        engine.add_lora(object())


def test_reset_prefix_cache_with_running_requests(llm):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 33)]
    expected = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
    llm.enqueue(prompts, GREEDY)
    llm.llm_engine.step()
    assert not llm.reset_prefix_cache()  # running requests hold blocks
    assert llm.reset_prefix_cache(reset_running_requests=True)  # preempted, then recomputed
    assert token_ids(llm.wait_for_completion(use_tqdm=False)) == expected
    assert llm.reset_mm_cache() is None
    assert llm.reset_prefix_cache(reset_connector=True)  # no KV connector: nothing more to reset


def test_import_paths_of_vllm_scripts():
    import tokenmill
    from tokenmill import distributed, structured_outputs
    from tokenmill.distributed import cleanup_dist_env_and_memory
    from tokenmill.metrics.reader import Counter, Gauge, Histogram, Metric, Vector
    from tokenmill.sampling_params import GuidedDecodingParams, RepetitionDetectionParams, StructuredOutputsParams

    assert StructuredOutputsParams is structured_outputs.StructuredOutputsParams
    assert RepetitionDetectionParams is tokenmill.RepetitionDetectionParams  # vllm.sampling_params' name
    assert GuidedDecodingParams is structured_outputs.GuidedDecodingParams
    assert all(issubclass(kind, Metric) for kind in (Counter, Gauge, Histogram, Vector))
    assert cleanup_dist_env_and_memory is distributed.cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory(shutdown_ray=False)
    from tokenmill import EngineArgs as TopEngineArgs
    from tokenmill import LLMEngine

    assert callable(LLMEngine.from_engine_args) and TopEngineArgs is EngineArgs
    from tokenmill.lora.request import LoRARequest  # vllm.lora.request's path

    assert LoRARequest is tokenmill.LoRARequest
    assert callable(EngineArgs.add_cli_args) and callable(EngineArgs.from_cli_args)  # used in test_engine_args_table


def test_pooling_output_equality():
    from tokenmill import PoolingOutput, PoolingRequestOutput

    data = torch.tensor([0.25, -1.0, 3.0])
    assert PoolingOutput(data) == PoolingOutput(data.clone())
    assert PoolingOutput(data) != PoolingOutput(data + 1)
    assert PoolingOutput(data) != PoolingOutput(data[:2])
    assert PoolingOutput(data) != data
    assert PoolingRequestOutput("0", PoolingOutput(data), [1, 2], 0, True) == PoolingRequestOutput("0", PoolingOutput(data.clone()), [1, 2], 0, True)


def test_engine_arguments_with_an_effect(tiny_llama_dir):
    base = {**OPTIONS, "max_model_len": None}
    overridden = LLM(str(tiny_llama_dir), hf_overrides={"max_position_embeddings": 96}, **base)
    assert overridden.llm_engine.config.max_model_len == 96
    by_function = LLM(str(tiny_llama_dir), hf_overrides=lambda c: setattr(c, "max_position_embeddings", 80) or c, **base)
    assert by_function.llm_engine.config.max_model_len == 80

    defaults = LLM(str(tiny_llama_dir), override_generation_config={"temperature": 0.0, "max_new_tokens": 5},
                   num_gpu_blocks_override=12, **OPTIONS)
    assert (defaults.get_default_sampling_params().temperature, defaults.get_default_sampling_params().max_tokens) == (0.0, 5)
    assert defaults.llm_engine.kv.pool.num_blocks == 12

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (30, 7, 41)]
    chunked = LLM(str(tiny_llama_dir), max_num_batched_tokens=16, **OPTIONS)
    whole = LLM(str(tiny_llama_dir), enable_chunked_prefill=False, **OPTIONS)
    assert whole.llm_engine.scheduler.chunked_prefill is False
    assert whole.llm_engine.config.max_num_batched_tokens >= OPTIONS["max_model_len"]
    assert token_ids(whole.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match="max_num_batched_tokens=16.*enable_chunked_prefill=False"):
        LLM(str(tiny_llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=16, **OPTIONS)


def test_llm_from_engine_args(tiny_llama_dir, llm):
    engine_args = EngineArgs(model=str(tiny_llama_dir), **OPTIONS)
    again = LLM.from_engine_args(engine_args)
    prompts = [{"prompt_token_ids": [9, 8, 7]}]
    assert token_ids(again.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("method, args", [("sleep", ()), ("get_metrics", ()), ("start_profile", ()),
                                          ("update_weights", ({"update_info": {}},)), ("get_weight_version", ())])
def test_engine_controls_of_a_pooling_model_are_clear_errors(bert_embedder_llm, method, args):
    with pytest.raises(ValueError, match=f"LLM.{method}\\(\\) is available for generative models"):
        getattr(bert_embedder_llm, method)(*args)
    assert bert_embedder_llm.get_world_size() == 1



def test_model_config_is_the_engines(llm):
    """vLLM's LLM.model_config (its scripts read max_model_len from it)."""
    assert llm.model_config is llm.llm_engine.model_config
    assert llm.model_config.max_model_len == llm.llm_engine.config.max_model_len
    # vLLM's test_all_logprobs sizes logprobs=-1 with model_config.get_vocab_size().
    assert llm.llm_engine.model_config.get_vocab_size() == 289


def test_outputs_take_vllms_positional_order():
    """vLLM 0.26's RequestOutput.__init__ and CompletionOutput fields, in order (vllm/outputs.py)."""
    from tokenmill import CompletionOutput, RequestOutput

    completion = CompletionOutput(0, "t", [5], -0.5, None, None, "stop", 5, None)
    assert (completion.routed_experts, completion.finish_reason, completion.stop_reason) == (None, "stop", 5)
    adapter = object()
    output = RequestOutput("r", "p", [1], None, [completion], True, None, adapter, None, None, 3, 1)
    assert (output.lora_request, output.encoder_prompt, output.num_cached_tokens, output.num_cache_creation_tokens) == (adapter, None, 3, 1)
