"""Structured outputs on a CUDA GPU: the masks filled on xgrammar's threads while the forward runs,
copied to the device and applied to float32 logits, then the Triton draw (tokenmill/worker/
model_runner.py `_mask_grammars`, sampler.py). Every constrained output must satisfy its constraint
(the json module and the schema's rules written out, re: the GPU image has no jsonschema), beside
unconstrained requests of the same batch, which must keep their length."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from tokenmill import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # before fixtures build models

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _satisfies_schema(text: str) -> bool:
    """SCHEMA's rules, checked on json.loads' value."""
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == {"name", "age", "tags"}
            and isinstance(value["name"], str) and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"})


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, seed=0)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async-default", "sync"])
def test_constrained_rows_beside_free_rows_on_gpu(tiny_llama_dir, async_scheduling):
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, seed=0,
              async_scheduling=async_scheduling)
    prompts = [f"p{i}" for i in range(24)]
    json_params = SamplingParams(temperature=1.0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    regex = r"[A-Z][a-z]{2,5}-\d{3}"
    regex_params = SamplingParams(temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
    free = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    params = [(json_params, regex_params, free)[i % 3] for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        if i % 3 == 0:
            assert completion.finish_reason == "stop", completion.text  # the grammar completed
            assert _satisfies_schema(completion.text), completion.text
        elif i % 3 == 1:
            assert re.fullmatch(regex, completion.text), completion.text
        else:
            assert len(completion.token_ids) == 30  # no mask reached an unconstrained row


def test_choice_and_greedy_constrained_rows_on_gpu(llm):
    choices = ["red", "green apple", "blue"]
    outs = llm.generate(["x", "yy", "zzz"], SamplingParams(temperature=0.0, n=1, max_tokens=20,
                                                          structured_outputs=StructuredOutputsParams(choice=choices)),
                        use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    sampled = llm.generate(["x"] * 12, SamplingParams(temperature=1.5, max_tokens=20, seed=3,
                                                      structured_outputs=StructuredOutputsParams(choice=choices)),
                           use_tqdm=False)
    assert {o.outputs[0].text for o in sampled} <= set(choices)


def test_a_padded_vocabulary_under_grammars_on_gpu(tiny_models_root):
    """An lm_head wider than the tokenizer (300 padding ids a random model samples freely): the
    constrained rows never get one (xgrammar sees the tokenizer's ids; the masks, filled in the
    pinned buffer reused across steps and grown with the batch, clear the rest), the free rows do."""
    from transformers import LlamaConfig

    from support.tiny_models import TINY_VOCAB, save_tiny_model, tiny_config_kwargs

    config = LlamaConfig(**tiny_config_kwargs(vocab_size=TINY_VOCAB + 300), architectures=["LlamaForCausalLM"])
    llm = LLM(str(save_tiny_model(tiny_models_root, "llama_padded_vocab", config, seed=5)), dtype="bfloat16",
              max_model_len=256, gpu_memory_utilization=0.3, seed=0)
    json_params = SamplingParams(temperature=1.0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    for rows in (3, 24):  # the staging buffer grows between the calls
        outputs = llm.generate([f"p{i}" for i in range(rows)], [(json_params, free)[i % 2] for i in range(rows)],
                               use_tqdm=False)
        constrained = [o.outputs[0] for i, o in enumerate(outputs) if i % 2 == 0]
        for completion in constrained:
            assert max(completion.token_ids) < TINY_VOCAB, completion.token_ids
            assert completion.finish_reason == "stop" and _satisfies_schema(completion.text), completion.text
        free_ids = [t for i, o in enumerate(outputs) if i % 2 == 1 for t in o.outputs[0].token_ids]
        assert max(free_ids) >= TINY_VOCAB  # padding ids are drawn where nothing masks them
