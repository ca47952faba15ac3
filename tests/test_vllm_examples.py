"""vLLM's offline examples, run in-process on tiny local models.

Each test makes the calls one of vLLM's example scripts makes (the path is in its docstring, as
read from vllm-project/vllm at the commit named there; the scripts are Apache-2.0) with only the
substitutions a vLLM user makes: the import (``vllm`` -> ``tokenmill``, the paths of
docs/from-vllm.md), the model (a tiny one from tests/conftest.py), and GPU-only settings. What an
example reads back from its results is read the same way here, and checked.
"""

from __future__ import annotations

import pytest

ENGINE = dict(dtype="float32", device="cpu", seed=0)


def test_flexible_argument_parser_and_print_embeddings(capsys):
    """examples/basic/offline_inference/*.py @41c5903d: the argument parser every example builds,
    an option the script adds taken with underscores as with dashes, and the embeddings printout."""
    from tokenmill import EngineArgs
    from tokenmill.utils.argparse_utils import FlexibleArgumentParser
    from tokenmill.utils.print_utils import print_embeddings

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="m", runner="pooling", enforce_eager=True)
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    args = vars(parser.parse_args(["--max_tokens", "5", "--max_model_len=64"]))
    assert (args["max_tokens"], args["max_model_len"], args["runner"], args["model"]) == (5, 64, "pooling", "m")
    with pytest.raises(SystemExit):  # an unknown option stays an error, as in argparse
        parser.parse_args(["--no_such_option", "1"])
    print_embeddings([0.5, 0.25, 0.125, 1.0, 2.0])
    print_embeddings([1.0], prefix="Reward")
    assert capsys.readouterr().out.splitlines()[-2:] == ["Embeddings: [0.5, 0.25, 0.125, 1.0, ...] (size=5)",
                                                         "Reward: [1.0] (size=1)"]


# --- logits processors: examples/features/logits_processor/{custom,custom_req,custom_req_init}.py ----------
# @41c5903d (custom_req_init.py @2be24dcd): requests 0 and 2 name a target_token in extra_args,
# the processor masks every other token of their rows; requests 1 and 3 are left alone.

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]


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
    same on every run, and so is the script's own random.randint after the LLM is made (vLLM seeds
    the global generators with the engine's seed, 0 by default)."""
    import random

    import numpy

    from tokenmill import LLM, SamplingParams

    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_llama_dir), **{k: v for k, v in ENGINE.items() if k != "seed"})
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95), use_tqdm=False)
        runs.append(([o.outputs[0].text for o in outputs], random.randint(0, 100), float(numpy.random.rand())))
    random.seed(0)
    numpy.random.seed(0)
    assert runs[0] == runs[1] and runs[0][1:] == (random.randint(0, 100), float(numpy.random.rand()))


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


# --- rerankers: examples/pooling/score/qwen3_reranker_offline.py @06d0369d -------------------------------
# The original Qwen3-Reranker (a causal LM) served as a classifier from its "no" / "yes" logits, scoring
# query-document pairs rendered by a score template (the example's template/qwen3_reranker.jinja, here an
# equivalent shorter one: the pair is given to it as messages of roles "query" and "document").

SCORE_TEMPLATE = (
    "<|im_start|>user\n<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tiny_reranker_dir(tmp_path_factory):
    """A tiny Qwen3 causal LM whose vocabulary has the tokens "no" and "yes" (as Qwen3's has)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from support.tiny_models import build_tiny_tokenizer, randomize_weights, tiny_config_kwargs

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["no", "yes"])
    config = Qwen3Config(**tiny_config_kwargs(vocab_size=len(tokenizer), tie_word_embeddings=True, head_dim=32),
                         architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, 21)
    out = tmp_path_factory.mktemp("reranker") / "qwen3_reranker"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _yes_probability(model_dir, ids: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    no_yes = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).logits
    return float(logits[0, -1, no_yes].softmax(-1)[1])


def test_qwen3_reranker_example_with_its_score_template(tiny_reranker_dir):
    from tokenmill import LLM

    llm = LLM(model=str(tiny_reranker_dir), runner="pooling", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True}, **ENGINE)
    queries = ["What is the capital of China?", "Explain gravity"]
    documents = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other."]
    outputs = llm.score(queries, documents, chat_template=SCORE_TEMPLATE, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for query, document, output in zip(queries, documents, outputs):
        # (Jinja drops a template's one trailing newline, in vLLM as here.)
        rendered = f"<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant"
        assert output.prompt_token_ids == tokenizer(rendered)["input_ids"]
        assert output.outputs.score == pytest.approx(_yes_probability(tiny_reranker_dir, output.prompt_token_ids), abs=1e-5)
    # Without a template vLLM reads such a model's pair as one text, query + document (use_sep_token off).
    plain = llm.score(queries[0], documents[0], use_tqdm=False)[0]
    assert plain.prompt_token_ids == tokenizer(queries[0] + documents[0])["input_ids"]


def test_score_templates_apply_to_cross_encoders_only(minilm_dir, tiny_reranker_dir):
    from tokenmill import LLM

    with pytest.raises(ValueError, match="applies to cross-encoders"):
        LLM(str(minilm_dir), **ENGINE).score("a", "b", chat_template=SCORE_TEMPLATE, use_tqdm=False)
    llm = LLM(str(tiny_reranker_dir), runner="pooling", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
        "method": "from_2_way_softmax"}, **ENGINE)
    with pytest.raises(ValueError, match="does not render the pair"):
        llm.score("a", "b", chat_template="{{ messages[5]['content'] }}", use_tqdm=False)
