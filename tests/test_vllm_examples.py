"""vLLM's offline examples, run in-process on tiny local models.

Each test makes the calls one of vLLM's example scripts makes (the path is in its docstring, as
read from vllm-project/vllm at the commit named there; the scripts are Apache-2.0) with only the
substitutions a vLLM user makes: the import (``vllm`` -> ``tokenmill``, the paths of
docs/from-vllm.md), the model (a tiny one from tests/conftest.py), and GPU-only settings. What an
example reads back from its results is read the same way here, and checked. Where the tiny model
forces a change (its 256 positions, its random answers), a comment says so. The pooling examples are
in tests/test_vllm_pooling_examples.py.
"""

from __future__ import annotations

import argparse

import pytest

ENGINE = dict(dtype="float32", device="cpu", seed=0)
PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]  # the examples' prompts


def _example_args(*argv: str, defaults: dict | None = None, sampling: bool = False) -> dict:
    """The examples' command line: EngineArgs' options (+ the sampling ones generate.py / chat.py add)."""
    from tokenmill import EngineArgs
    from tokenmill.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(**(defaults or {}))
    if sampling:
        group = parser.add_argument_group("Sampling parameters")
        for name, kind in (("--max-tokens", int), ("--temperature", float), ("--top-p", float), ("--top-k", int)):
            group.add_argument(name, type=kind)
        parser.add_argument("--chat-template-path", type=str)
    return vars(parser.parse_args(list(argv)))


def test_basic_example(tiny_llama_dir):
    """examples/basic/offline_inference/basic.py @995b9265."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_dir))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    assert [output.prompt for output in outputs] == PROMPTS
    assert all(isinstance(output.outputs[0].text, str) and len(output.outputs[0].token_ids) <= 16 for output in outputs)


def test_generate_example(tiny_llama_dir):
    """examples/offline_inference/basic/generate.py @10b62e38: LLM(**args) from the command line, the
    default sampling params with the command line's values set on them."""
    from tokenmill import LLM

    args = _example_args("--model", str(tiny_llama_dir), "--max_tokens", "5", "--top-k", "3", sampling=True)
    max_tokens, temperature, top_p, top_k = (args.pop(k) for k in ("max_tokens", "temperature", "top_p", "top_k"))
    args.pop("chat_template_path")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value is not None:
            setattr(sampling_params, name, value)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert all(len(output.outputs[0].token_ids) <= 5 for output in outputs)


def test_chat_example(tiny_llama_dir, tmp_path):
    """examples/basic/offline_inference/chat.py @41c5903d: one conversation, ten in one call (with a
    progress bar), then the ten again under a chat template read from --chat-template-path."""
    from tokenmill import LLM

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    args = _example_args("--model", str(tiny_llama_dir), "--max-tokens", "4", "--chat-template-path", str(template),
                         sampling=True)
    max_tokens, chat_template_path = args.pop("max_tokens"), args.pop("chat_template_path")
    for name in ("temperature", "top_p", "top_k"):
        args.pop(name)
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = max_tokens
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].prompt.startswith("<|im_start|>system\nYou are a helpful assistant")
    conversations = [conversation for _ in range(10)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert len(outputs) == 10
    with open(chat_template_path) as f:
        chat_template = f.read()
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
    assert len(outputs) == 10 and outputs[0].prompt.startswith("[system] You are a helpful assistant")



# --- logits processors: examples/features/logits_processor/{custom,custom_req,custom_req_init}.py ----------
# @41c5903d (custom_req_init.py @2be24dcd): requests 0 and 2 name a target_token in extra_args,
# the processor masks every other token of their rows; requests 1 and 3 are left alone.


def _target_token_outputs(model_dir, processor) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model_dir), logits_processors=[processor], **ENGINE)
    params = [SamplingParams(temperature=0.0, extra_args={"target_token": 128}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, extra_args={"target_token": 67}), SamplingParams(temperature=0.0)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert [got[1], got[3]] == [list(plain[i].outputs[0].token_ids) for i in (1, 3)]
    return got


def _per_request_processor():
    import torch

    class DummyPerReqLogitsProcessor:
        def __init__(self, target_token: int) -> None:
            self.target_token = target_token

        def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            val_to_keep = logits[self.target_token].item()
            logits[:] = float("-inf")
            logits[self.target_token] = val_to_keep
            return logits

    return DummyPerReqLogitsProcessor


def test_custom_logits_processor_example(tiny_llama_dir):
    import torch

    from tokenmill.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

    class DummyLogitsProcessor(LogitsProcessor):
        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.req_info: dict[int, int] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None):
            process_dict_updates(self.req_info, batch_update,
                                 lambda params, _, __: params.extra_args and params.extra_args.get("target_token"))

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.req_info:
                return logits
            cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
            rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
            values_to_keep = logits[rows, cols].clone()
            logits[rows] = float("-inf")
            logits[rows, cols] = values_to_keep
            return logits

    got = _target_token_outputs(tiny_llama_dir, DummyLogitsProcessor)
    assert got[0] == [128] * 16 and got[2] == [67] * 16


def test_custom_req_logits_processor_examples(tiny_llama_dir):
    """custom_req.py, then custom_req_init.py, whose wrapper applies on CUDA devices only (here: never)."""
    from tokenmill.logits_processor import AdapterLogitsProcessor, RequestLogitsProcessor

    per_request = _per_request_processor()
    optional = RequestLogitsProcessor | None  # the examples' return annotation, evaluated at class definition

    class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params) -> optional:
            target_token = params.extra_args and params.extra_args.get("target_token")
            return None if target_token is None else per_request(target_token)

    class CudaOnlyPerReqLogitsProcessor(WrappedPerReqLogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory: bool):
            super().__init__(vllm_config, device, is_pin_memory)
            self.is_cuda = device.type == "cuda"

        def new_req_logits_processor(self, params) -> optional:
            return super().new_req_logits_processor(params) if self.is_cuda else None

    got = _target_token_outputs(tiny_llama_dir, WrappedPerReqLogitsProcessor)
    assert got[0] == [128] * 16 and got[2] == [67] * 16
    got = _target_token_outputs(tiny_llama_dir, CudaOnlyPerReqLogitsProcessor)
    assert len(set(got[0])) > 1 and len(set(got[2])) > 1  # on the CPU the wrapper leaves every row alone


def test_reproducibility_example(tiny_llama_dir):
    """examples/features/batch_invariance/reproducibility_offline.py @93e5a576: sampled outputs are the
    same on every run, and so are the script's own random, numpy and torch draws after the LLM is made
    (vLLM seeds the global generators with the engine's seed, 0 by default; docs/from-vllm.md)."""
    import random

    import numpy
    import torch

    from tokenmill import LLM, SamplingParams

    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_llama_dir), **{k: v for k, v in ENGINE.items() if k != "seed"})
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95), use_tqdm=False)
        runs.append(([o.outputs[0].text for o in outputs], random.randint(0, 100), float(numpy.random.rand()),
                     float(torch.rand(()))))
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    assert runs[0] == runs[1] and runs[0][1:] == (random.randint(0, 100), float(numpy.random.rand()), float(torch.rand(())))


def test_skip_loading_weights_in_engine_init_example(tiny_llama_dir):
    """examples/offline_inference/skip_loading_weights_in_engine_init.py @0313ba1f (tensor_parallel_size
    4 -> 1): start on dummy weights, switch the load format, reload the real ones in place."""
    from tokenmill import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    real = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), **ENGINE).generate(PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(str(tiny_llama_dir), load_format="dummy", enforce_eager=True, tensor_parallel_size=1, **ENGINE)
    dummy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},))
    llm.collective_rpc("reload_weights")
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert after == real != dummy
    for overrides, named in [({"model_config": {"max_model_len": 8}}, "model_config"),
                             ({"load_config": {"download_dir": "/x"}}, "download_dir"),
                             ({"load_config": {"load_format": "sharded_state"}}, "'sharded_state' is invalid")]:
        with pytest.raises(ValueError, match=named):
            llm.collective_rpc("update_config", args=(overrides,))


# --- LLMEngine driven by hand: examples/offline_inference/llm_engine_example.py (vLLM's loop, the
# form its later versions share), examples/features/reset_kv/reset_kv_offline.py @7be59d76 and
# examples/features/lora/multilora_offline.py @10efe946.

def _process_requests(engine, test_prompts: list[tuple], reset_at_step: int | None = None) -> dict[str, object]:
    """The examples' loop: one request added per step, engine.step() until nothing is unfinished."""
    finished, request_id, step_id = {}, 0, 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params, *lora = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params, **({"lora_request": lora[0]} if lora else {}))
            request_id += 1
        if step_id == reset_at_step:
            engine.reset_prefix_cache(reset_running_requests=True)
        for request_output in engine.step():
            if request_output.finished:
                finished[request_output.request_id] = request_output
        step_id += 1
    return finished


def _cli_namespace(model: str) -> argparse.Namespace:  # what the examples' parse_args() returns
    return argparse.Namespace(**_example_args("--model", model))


def test_llm_engine_and_reset_kv_examples(tiny_llama_dir):
    from tokenmill import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(_cli_namespace(str(tiny_llama_dir))))
    test_prompts = [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]
    finished = _process_requests(engine, list(test_prompts))
    assert sorted(finished) == ["0", "1", "2"] and len(finished["2"].outputs) == 2
    assert finished["0"].prompt_logprobs[0] is None and len(finished["0"].outputs[0].logprobs) == len(finished["0"].outputs[0].token_ids)
    assert "RequestOutput(request_id='0'" in str(finished["0"])  # the examples print each finished output

    long = "A robot may not injure a human being " * 6  # * 50 there: 1450 tokens here, past the tiny model's 256
    greedy = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)
    test_prompts = [(long, greedy), (long, greedy),
                    ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=128)),
                    ("What is the meaning of life?",
                     SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1, max_tokens=128))]
    finished = _process_requests(engine, test_prompts, reset_at_step=10)
    assert sorted(finished) == ["0", "1", "2", "3"]
    assert finished["0"].outputs[0].token_ids == finished["1"].outputs[0].token_ids  # greedy, same prompt


def test_multilora_example(tiny_llama_dir, tmp_path):
    from support.lora_adapters import save_adapter
    from tokenmill import EngineArgs, LLMEngine, SamplingParams
    from tokenmill.lora.request import LoRARequest

    lora_path = str(save_adapter(tiny_llama_dir, tmp_path / "sql-lora", seed=5, r=8))  # snapshot_download(...) there
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), enable_lora=True, max_loras=1,
                                                   max_lora_rank=8, max_cpu_loras=2, max_num_seqs=256))
    sql = "[user] Write a SQL query to answer the question based on the table schema. [/user] [assistant]"
    greedy = SamplingParams(temperature=0.0, logprobs=1, max_tokens=16)
    test_prompts = [
        ("A robot may not injure a human being", greedy, None),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=16), None),
        (sql, greedy, LoRARequest("sql-lora", 1, lora_path)),
        (sql, greedy, LoRARequest("sql-lora2", 2, lora_path)),
        (sql, greedy, None),  # not in the example: the base model on the same prompt
    ]
    finished = _process_requests(engine, test_prompts)
    tokens = [finished[i].outputs[0].token_ids for i in ("2", "3", "4")]
    assert tokens[0] == tokens[1] != tokens[2]  # both adapters are the same one; the base model differs
    assert finished["2"].lora_request.lora_name == "sql-lora"


def test_metrics_example(tiny_llama_dir):
    """examples/offline_inference/metrics.py @26063889: every metric read as its vLLM class."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.metrics.reader import Counter, Gauge, Histogram, Vector

    llm = LLM(model=str(tiny_llama_dir), disable_log_stats=False)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    seen = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Gauge):
            seen[metric.name] = metric.value
        elif isinstance(metric, Counter):
            seen[metric.name] = metric.value
        elif isinstance(metric, Vector):
            seen[metric.name] = metric.values
        elif isinstance(metric, Histogram):
            seen[metric.name] = (metric.sum, metric.count, dict(metric.buckets.items()))
    assert seen["vllm:generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert seen["vllm:request_prompt_tokens"][:2] == (sum(len(o.prompt_token_ids) for o in outputs), len(PROMPTS))


def test_simple_profiling_example(tiny_llama_dir, tmp_path):
    """examples/features/profiling/simple_profiling_offline.py @41c5903d (a trace folder of the test's)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_dir), tensor_parallel_size=1,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "vllm_profile")})
    llm.start_profile()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4))
    llm.stop_profile()
    assert len(outputs) == 4 and list((tmp_path / "vllm_profile").glob("*.pt.trace.json*"))


def test_structured_outputs_example(tiny_llama_dir):
    """examples/features/structured_outputs/structured_outputs_offline.py @030ea52e (choice, regex,
    a pydantic model's JSON schema, a grammar); on a random model the constraint does all the work."""
    import json
    import re
    from enum import Enum

    from pydantic import BaseModel

    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import StructuredOutputsParams

    class CarType(str, Enum):
        sedan = "sedan"
        suv = "SUV"
        truck = "Truck"
        coupe = "Coupe"

    class CarDescription(BaseModel):
        brand: str
        model: str
        car_type: CarType

    grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=100)

    def generate_output(prompt: str, sampling_params: SamplingParams) -> str:
        outputs = llm.generate(prompt, sampling_params=sampling_params)
        return outputs[0].outputs[0].text

    choice = generate_output("Classify this sentiment: vLLM is wonderful!",
                             SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"])))
    assert choice in ("Positive", "Negative")
    regex = generate_output("Generate an email address for Alan Turing, who works in Enigma.",
                            SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"],
                                           max_tokens=50))
    assert re.fullmatch(r"\w+@\w+\.com|\w*(@\w*)?", regex)  # complete, or cut at max_tokens
    car = generate_output("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
                          SamplingParams(structured_outputs=StructuredOutputsParams(json=CarDescription.model_json_schema()),
                                         max_tokens=50))
    assert car.startswith('{"brand": ')  # the schema's first property first (and the rest in order, when complete)
    if car.endswith("}"):
        assert list(json.loads(car)) == ["brand", "model", "car_type"]
    sql = generate_output("Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
                          SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar), max_tokens=50))
    sentences = [f"SELECT col_{a}  from table_{b}  where col_{c} = {d} " for a in "12" for b in "12" for c in "12" for d in "12"]
    assert any(s.startswith(sql) for s in sentences) and sql  # whole, or cut at max_model_len=100 (long prompts here)


def test_prefix_caching_example(tiny_llama_dir):
    """examples/features/automatic_prefix_caching/prefix_caching_offline.py @2ede65f0: the same greedy
    answers with and without the prefix cache, the second engine after cleanup_dist_env_and_memory."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.distributed import cleanup_dist_env_and_memory

    prefix = "You are an expert school principal, skilled in effectively managing faculty and staff. "
    generating_prompts = [prefix + prompt for prompt in PROMPTS]
    sampling_params = SamplingParams(temperature=0.0)
    regular_llm = LLM(model=str(tiny_llama_dir), enable_prefix_caching=False, gpu_memory_utilization=0.4)
    regular = [o.outputs[0].text for o in regular_llm.generate(generating_prompts, sampling_params)]
    del regular_llm
    cleanup_dist_env_and_memory()
    prefix_cached_llm = LLM(model=str(tiny_llama_dir), enable_prefix_caching=True, gpu_memory_utilization=0.4)
    prefix_cached_llm.generate(generating_prompts[0], sampling_params)
    outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
    assert [o.outputs[0].text for o in outputs] == regular
    assert all(o.num_cached_tokens > 0 for o in outputs)


def test_sleep_mode_docs_example(tiny_llama_dir):
    """vLLM's docs/features/sleep_mode.md, offline: sleep levels 1 and 2, waking weights and cache apart."""
    from tokenmill import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(str(tiny_llama_dir), enable_sleep_mode=True)
    before = llm.generate(PROMPTS, greedy, use_tqdm=False)
    llm.sleep(level=1)
    llm.wake_up()
    after_1 = llm.generate(PROMPTS, greedy, use_tqdm=False)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    after_2 = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in before] == [o.outputs[0].token_ids for o in after_1] \
        == [o.outputs[0].token_ids for o in after_2]


def test_beam_search_docs_example(tiny_llama_dir):
    """vLLM's docs/models/generative_models.md, LLM.beam_search: the best sequence's text (prompt included)."""
    from tokenmill import LLM
    from tokenmill.sampling_params import BeamSearchParams

    llm = LLM(model=str(tiny_llama_dir))
    outputs = llm.beam_search([{"prompt": "Hello, my name is "}], BeamSearchParams(beam_width=5, max_tokens=50))
    assert outputs[0].sequences[0].text.startswith("Hello, my name is ")
    assert len(outputs[0].sequences) == 5


def test_chat_with_tools_example(tiny_llama_dir):
    """examples/offline_inference/chat_with_tools.py @015c74e6 with a Hugging Face folder (the example's
    Mistral-format flags are refused by name): tools passed to chat, then the tool's answer as a
    "tool" message with its tool_call_id. A random model writes no tool call, so the call is made here."""
    from tokenmill import LLM
    from tokenmill.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="load_format='mistral'"):
        LLM(model=str(tiny_llama_dir), tokenizer_mode="mistral", config_format="mistral", load_format="mistral")
    llm = LLM(model=str(tiny_llama_dir))
    sampling_params = SamplingParams(max_tokens=16, temperature=0.0)  # 8192 there
    tools = [{"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "state", "unit"]}}}]
    messages = [{"role": "user", "content": "Can you tell me what the temperate will be in Dallas, in fahrenheit?"}]
    outputs = llm.chat(messages, sampling_params=sampling_params, tools=tools)
    output = outputs[0].outputs[0].text.strip().removeprefix("[TOOL_CALLS]")
    messages.append({"role": "assistant", "content": output})
    answer = "The weather in Dallas, TX is 85 degrees fahrenheit. It is partly cloudly, with highs in the 90's."
    messages.append({"role": "tool", "content": answer, "tool_call_id": "a1b2c3d4e"})
    outputs = llm.chat(messages, sampling_params, tools=tools)
    assert answer in outputs[0].prompt and isinstance(outputs[0].outputs[0].text, str)


def test_context_extension_example_runs_with_yarn(tiny_llama_dir):
    """examples/features/context_extension/context_extension_offline.py @41c5903d: YaRN through
    hf_overrides and max_model_len = the pretraining length x the factor (scaled down: 128 x 4
    positions on the tiny model, whose own config stops at 256)."""
    from tokenmill import LLM, SamplingParams

    rope = {"rope_theta": 1000000, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    llm = LLM(model=str(tiny_llama_dir), hf_overrides={"rope_parameters": rope, "max_model_len": 512},
              dtype="float32", device="cpu", kv_cache_memory_bytes=8 * 2**20)
    assert llm.llm_engine.config.max_model_len == 512
    prompt = {"prompt_token_ids": [5 + i % 200 for i in range(300)]}  # past the model's own 256 positions
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_examples_of_what_tokenmill_refuses(tiny_llama_dir):
    """examples/features/sharded_state/load_sharded_state_offline.py @41c5903d: refused by name, as
    docs/from-vllm.md says."""
    from tokenmill import LLM

    with pytest.raises(ValueError, match="load_format='sharded_state'"):
        LLM(model=str(tiny_llama_dir), load_format="sharded_state")
