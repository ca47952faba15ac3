"""Every vLLM `LLM(...)` / `EngineArgs` argument is accepted at its default or refused on purpose.

The table (tokenmill/engine_args_table.py) is walked: each argument's vLLM default is accepted,
each implemented one is an EngineArgs field of ours, each default-only one refuses another value
with a ValueError naming the argument and the value, each no-effect one takes any value. Every
argument of vLLM 0.26 (a snapshot read from its source, tests/support/vllm_0_26_arguments.json)
must be in the table and accepted at vLLM's own default; an argument vLLM has and the table lacks
fails the test. When vLLM's source is at hand (an installed vllm, $TOKENMILL_VLLM_SOURCE or
/tmp/vllm-site/vllm) it is read the same way and checked too. Then the whole set at
vLLM's defaults goes through LLM(...) at once, and through vLLM's argument-parser helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from support.vllm_arguments import UNKNOWN, load_snapshot, read_arguments
from tokenmill.config import EngineArgs
from tokenmill.engine_args_table import TOKENMILL_ONLY, VLLM_ARGUMENTS, Handling

OURS = {f.name for f in dataclasses.fields(EngineArgs) if f.name in EngineArgs.__annotations__}
SMALL = dict(dtype="float32", kv_cache_memory_bytes=4 * 2**20, max_num_seqs=4, max_model_len=64)


def _vllm_source() -> Path | None:
    given = os.environ.get("TOKENMILL_VLLM_SOURCE")
    candidates = [Path(given)] if given else []
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent)
    candidates.append(Path("/tmp/vllm-site/vllm"))
    return next((c for c in candidates if (c / "engine/arg_utils.py").is_file()), None)


def _refused_value(default):
    return (not default) if isinstance(default, bool) else "<a value tokenmill does not implement>"


def test_vllm_0_26s_arguments_are_all_in_the_table_and_their_defaults_accepted():
    """Against the snapshot read from vLLM 0.26's source (tests/support/vllm_arguments.py)."""
    vllm_arguments = load_snapshot()
    missing = sorted(set(vllm_arguments) - set(VLLM_ARGUMENTS))
    assert not missing, f"vLLM arguments neither accepted nor refused in engine_args_table.py: {missing}"
    refused = {}
    for name, default in vllm_arguments.items():
        if name != "model" and default != UNKNOWN:
            try:
                EngineArgs.from_kwargs("some-model", **{name: default})
            except (TypeError, ValueError) as error:
                refused[name] = str(error)
    assert not refused, f"vLLM's own defaults refused: {refused}"


def test_the_vllm_source_at_hand_has_no_argument_missing_from_the_table():
    root = _vllm_source()
    if root is None:
        pytest.skip("no vLLM source at hand (install vllm or set TOKENMILL_VLLM_SOURCE); the 0.26 snapshot is checked above")
    missing = sorted(set(read_arguments(root)) - set(VLLM_ARGUMENTS))
    assert not missing, f"vLLM arguments neither accepted nor refused in engine_args_table.py: {missing}"


def test_every_engine_args_field_is_a_vllm_argument_or_named_ours():
    assert OURS - set(VLLM_ARGUMENTS) == set(TOKENMILL_ONLY)
    for name, argument in VLLM_ARGUMENTS.items():
        if argument.handling is Handling.IMPLEMENTED:
            assert name in OURS, f"{name} is marked implemented but EngineArgs has no field of its own for it"
        else:
            assert name not in OURS, f"{name} is an EngineArgs field but marked {argument.handling.value}"
            assert argument.note, f"{name} needs a note saying why it changes nothing, or what tokenmill supports"


@pytest.mark.parametrize("name", sorted(VLLM_ARGUMENTS))
def test_each_argument_at_vllms_default_is_accepted_and_others_as_handled(name):
    argument = VLLM_ARGUMENTS[name]
    if name != "model":
        EngineArgs.from_kwargs("some-model", **{name: argument.default})
    if argument.handling is Handling.DEFAULT_ONLY:
        value = _refused_value(argument.default)
        with pytest.raises(ValueError) as info:
            EngineArgs.from_kwargs("some-model", **{name: value})
        assert f"LLM({name}={value!r}) is not supported by tokenmill" in str(info.value)
        assert f"supported: {name}={argument.default!r}" in str(info.value)
    elif argument.handling is Handling.NO_EFFECT:
        EngineArgs.from_kwargs("some-model", **{name: _refused_value(argument.default)})


def test_unknown_keyword_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match=r"unknown keyword argument 'swap_spaces'; did you mean 'swap_space'"):
        EngineArgs.from_kwargs("some-model", swap_spaces=4)


@pytest.mark.parametrize("kwargs, named", [
    (dict(enable_prompt_embeds=True), "enable_prompt_embeds=True"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config="),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
    (dict(scheduling_policy="lifo"), "scheduling_policy='lifo'"),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode='mistral'"),
    (dict(structured_outputs_config={"backend": "guidance"}), "'backend': 'guidance'"),
    (dict(weight_transfer_config={"backend": "ipc"}), "'backend': 'ipc'"),
    (dict(profiler_config={"profiler": "cuda"}), "'profiler': 'cuda'"),
    (dict(profiler_config={"profiler": "torch"}), "torch_profiler_dir"),
    (dict(profiler_config={"profiler": "torch", "torch_profiler_dir": "/tmp/x", "max_iterations": 3}), "max_iterations"),
    (dict(cpu_offload_gb=-1), "cpu_offload_gb=-1"),
    (dict(override_generation_config={"temprature": 0.5}), "override_generation_config"),
    (dict(block_size=24), "block_size=24"),
    (dict(seed=None), "seed=None"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(seed="abc"), "seed='abc'"),
])
def test_unimplemented_values_are_value_errors_naming_argument_and_value(kwargs, named):
    with pytest.raises(ValueError, match="LLM\\(") as info:
        EngineArgs.from_kwargs("some-model", **kwargs)
    assert named in str(info.value)


def test_llm_takes_every_vllm_argument_at_its_default_at_once(tiny_llama_dir):
    from tokenmill import LLM, SamplingParams

    defaults = {name: a.default for name, a in VLLM_ARGUMENTS.items() if name != "model"}
    llm = LLM(str(tiny_llama_dir), **{**defaults, **SMALL})
    out = llm.generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_vllm_argument_parser_helpers_round_trip(tiny_llama_dir):
    """vLLM's offline examples: EngineArgs.add_cli_args, then LLM(**vars(args)) or
    EngineArgs.from_cli_args + LLMEngine.from_engine_args with add_request/step."""
    from tokenmill import LLM, LLMEngine, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=4)  # a script's own option
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "64",
                              "--kv_cache_memory_bytes", str(4 * 2**20), "--max-num-seqs", "4", "--no-enable-prefix-caching",
                              "--hf-overrides", '{"max_position_embeddings": 128}', "--swap-space", "8"])
    assert (args.max_model_len, args.enable_prefix_caching, args.hf_overrides) == (64, False, {"max_position_embeddings": 128})
    assert args.enforce_eager is False and args.async_scheduling is None and args.swap_space == 8
    options = vars(args)
    params = SamplingParams(temperature=0.0, max_tokens=options.pop("max_tokens"))
    llm = LLM(**options)
    expected = llm.generate(["the cat sat"], params, use_tqdm=False)[0].outputs[0].token_ids

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    assert engine.config.enable_prefix_caching is False and engine.get_tokenizer() is not None
    engine.add_request("0", "the cat sat", params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].token_ids == expected


def test_tokenizer_mode_slow_asks_transformers_for_the_python_tokenizer(tiny_llama_dir, monkeypatch):
    import transformers

    from support.tiny_models import build_tiny_tokenizer
    from tokenmill import LLM

    asked = []
    original = transformers.AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        asked.append(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
    llm = LLM(str(tiny_llama_dir), tokenizer_mode="slow", **SMALL)
    assert asked and asked[-1]["use_fast"] is False
    text = "the weather is fine"
    assert llm.get_tokenizer().encode(text) == build_tiny_tokenizer().encode(text)
