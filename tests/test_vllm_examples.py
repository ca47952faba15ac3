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
