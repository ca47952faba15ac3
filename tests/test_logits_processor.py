"""LLM(logits_processors=[...]), vLLM V1's batch-level interface, on a tiny random Llama: vLLM's own
example processor (mask all but extra_args["target_token"]), a processor that reads each row's live
output list (checked against transformers' generate with the same rule as a LogitsProcessor), the
per-request adapter, "module:Class" names, and refusals."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from reference import hf_greedy, hf_model
from test_generate import make_llm, random_prompts
from tokenmill import SamplingParams
from tokenmill.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, process_dict_updates

MAX_TOKENS = 12


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's example: rows whose extra_args name a target_token may produce only that token."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: params.extra_args and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class NoRepeatProcessor(LogitsProcessor):
    """Bans each row's previous output token (rows whose extra_args ask for it): needs every row's
    live output list, so any mistake in which request sits on which row shows in the tokens."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        if (sampling_params.extra_args or {}).get("no_repeat") not in (None, True):
            raise ValueError("extra_args['no_repeat'] must be True when given")

    def __init__(self, vllm_config, device, is_pin_memory):
        self.outputs: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.outputs, batch_update,
                             lambda params, _, output_ids: output_ids if (params.extra_args or {}).get("no_repeat") else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, output_ids in self.outputs.items():
            if output_ids:
                logits[row, output_ids[-1]] = float("-inf")
        return logits


class EvenTokensAdapter(AdapterLogitsProcessor):
    """A per-request function wrapped by vLLM's adapter: rows with extra_args['even'] take even ids only."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("even"):
            return None

        def even_only(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            row[1::2] = float("-inf")
            return row

        return even_only


@torch.no_grad()
def hf_greedy_with(model, prompt: list[int], ban) -> list[int]:
    """transformers' greedy loop with a rule applied to each next-token logits row (ban(row, outputs))."""
    ids, out = list(prompt), []
    for _ in range(MAX_TOKENS):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        ban(logits, out)
        token = int(torch.argmax(logits))
        out.append(token)
        ids.append(token)
    return out


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # Few rows a step, prompts of different lengths and limits: rows join, leave and shift often.
    return make_llm(tiny_llama_dir, max_num_seqs=3, async_scheduling=True, logits_processors=[TargetTokenProcessor, NoRepeatProcessor,
                                                                      EvenTokensAdapter])


def test_processors_see_the_right_rows_and_live_outputs(llm, tiny_llama_dir):
    vocab = llm.llm_engine.config.vocab_size
    prompts = random_prompts(vocab, [4, 9, 17, 6, 11, 3, 8], seed=7)
    kinds = [{"no_repeat": True}, None, {"target_token": 77}, {"no_repeat": True}, {"even": True}, None, {"no_repeat": True}]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - i % 3, ignore_eos=True, extra_args=kind)
              for i, kind in enumerate(kinds)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = hf_model(str(tiny_llama_dir))

    def no_repeat(row, out):
        if out:
            row[out[-1]] = float("-inf")

    def even(row, out):
        row[1::2] = float("-inf")

    for prompt, kind, sp, output in zip(prompts, kinds, params, outputs):
        got = output.outputs[0].token_ids
        assert len(got) == sp.max_tokens
        if kind is None:
            assert got == hf_greedy(model, prompt, sp.max_tokens)[0]
        elif "target_token" in kind:
            assert got == [77] * sp.max_tokens
        else:
            rule = no_repeat if "no_repeat" in kind else even
            assert got == hf_greedy_with(model, prompt, rule)[: sp.max_tokens]


def test_validate_params_refuses_a_request_by_name(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: NoRepeatProcessor refuses its SamplingParams: .*must be True"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}],
                     [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, extra_args={"no_repeat": 3})], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_processor_named_by_module_and_class(tiny_llama_dir, monkeypatch):
    module = types.ModuleType("my_processors")
    module.TargetTokenProcessor = TargetTokenProcessor
    monkeypatch.setitem(sys.modules, "my_processors", module)
    named = make_llm(tiny_llama_dir, logits_processors=["my_processors:TargetTokenProcessor"])
    out = named.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3,
                         ignore_eos=True, extra_args={"target_token": 9}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [9, 9, 9]


@pytest.mark.parametrize("spec, message", [
    ("my_processors.TargetTokenProcessor", "give a class, or its name as 'module:Class'"),
    ("no_such_module_here:Thing", "cannot be loaded"),
    (int, "is not a logits processor class"),
])
def test_bad_processor_specs_are_refused(tiny_llama_dir, spec, message):
    with pytest.raises(ValueError, match=rf"logits_processors\[0\].*{message}"):
        make_llm(tiny_llama_dir, logits_processors=[spec])


def test_pooling_models_refuse_logits_processors(tiny_bert_embedder_dir):
    from tokenmill import LLM

    with pytest.raises(ValueError, match="logits_processors=...\\) is for generative models"):
        LLM(str(tiny_bert_embedder_dir), dtype="float32", device="cpu", logits_processors=[TargetTokenProcessor])
