"""A model given as broken local files, or with bad loading arguments: a clear error that names the
file or the field, the value and what is allowed; never a bare TypeError from deep inside a loader,
and never a weight silently cast or left unset. (tests/test_loader.py has the first such cases:
truncated and missing files, missing, unexpected and misshapen tensors.)"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill.models.loader import load_model
from tokenmill.models.source import ModelSource, apply_hf_overrides, resolve_model

CPU = torch.device("cpu")


def _load(source: ModelSource) -> torch.nn.Module:
    return load_model(source, torch.float32, CPU)


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip))
    return dst


def _edit_config(folder: Path, **fields: Any) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- config.json --------------------------------------------------------------------------------


def test_config_that_is_not_an_object_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json.*holds a JSON list, not an object"):
        resolve_model(str(folder))


def test_architectures_given_as_a_string_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Read as a list, "LlamaForCausalLM"[0] made the error name architecture 'L'.
    folder = _edit_config(_copy(tiny_llama_dir, tmp_path / "m"), architectures="LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"architectures='LlamaForCausalLM' .*must be a list of names"):
        _load(resolve_model(str(folder)))


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("hidden_size", "64", "an integer >= 1"),
        ("vocab_size", None, "an integer >= 1"),
        ("num_hidden_layers", 0, "an integer >= 1"),
        ("num_hidden_layers", 2.0, "an integer >= 1"),
        ("intermediate_size", -5, "an integer >= 1"),
        ("max_position_embeddings", "256", "an integer >= 1"),
    ],
)
def test_config_size_of_the_wrong_type_is_named(tiny_llama_dir: Path, tmp_path: Path, field: str, value: Any,
                                                allowed: str) -> None:
    """These reached torch as tensor sizes: TypeError, IndexError or RuntimeError from inside the model."""
    folder = _edit_config(_copy(tiny_llama_dir, tmp_path / "m"), **{field: value})
    with pytest.raises(ValueError, match=rf"config\.json.*{field}={value!r} is invalid: must be {allowed}"):
        resolve_model(str(folder))



def test_kv_heads_that_do_not_divide_the_heads_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """transformers reads this config; the model loaded and the first forward failed inside attention
    ("Number of heads in key and value must divide the number of heads in query")."""
    folder = _edit_config(_copy(tiny_llama_dir, tmp_path / "m"), num_attention_heads=6, num_key_value_heads=4,
                          hidden_size=96, head_dim=16)
    with pytest.raises(ValueError, match=r"config\.json: num_key_value_heads=4 is invalid: it must divide "
                                         r"num_attention_heads=6"):
        resolve_model(str(folder))

def test_hf_overrides_are_checked_as_config_json_is(tiny_llama_dir: Path) -> None:
    source = resolve_model(str(tiny_llama_dir))
    with pytest.raises(ValueError, match=r"hf_overrides.*hidden_size='x' is invalid: must be an integer >= 1"):
        apply_hf_overrides(source, {"hidden_size": "x"})
    with pytest.raises(ValueError, match=r"hf_overrides=.*returned None: it must return the config"):
        apply_hf_overrides(source, lambda config: None)  # a function that edits in place and forgets to return
    assert apply_hf_overrides(source, {"num_hidden_layers": 1}).hf_config.num_hidden_layers == 1


# --- safetensors --------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [{"weight_map": ["model-00001-of-00004.safetensors"]},
                                   {"weight_map": {"model.norm.weight": 3}}, [1]])
def test_malformed_checkpoint_index_is_named(tiny_llama_sharded_dir: Path, tmp_path: Path, index: Any) -> None:
    folder = _copy(tiny_llama_sharded_dir, tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"checkpoint index .*model\.safetensors\.index\.json is not valid"):
        _load(resolve_model(str(folder)))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_bert_embedder_dir"])  # lazy CheckpointTensors, plain tensors
@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64])
def test_integer_tensor_for_a_float_weight_is_refused(fixture: str, dtype: torch.dtype, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    """It was cast into the weight silently (int8 codes without their scales, a bool norm of 0s and 1s)."""
    from safetensors.torch import load_file, save_file

    folder = _copy(request.getfixturevalue(fixture), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("dense.weight") or n.endswith("up_proj.weight"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor {name!r} has dtype {dtype}: must be a floating-point dtype"):
        _load(resolve_model(str(folder)))


def test_tensor_held_by_two_shards_is_refused(tiny_llama_sharded_dir: Path, tmp_path: Path) -> None:
    """Each shard's tensors are read whatever the index says: the later copy silently won."""
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama_sharded_dir, tmp_path / "m")
    first, second = sorted(folder.glob("model-*.safetensors"))[:2]
    name = sorted(load_file(first))[0]
    tensors = load_file(second)
    tensors[name] = torch.zeros_like(load_file(first)[name])
    save_file(tensors, second, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint tensor {name!r} appears twice"):
        _load(resolve_model(str(folder)))


# --- GGUF ---------------------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["foo", "mamba", "gpt2"])
@pytest.mark.parametrize("load_format", ["auto", "gguf"])
def test_gguf_of_an_unsupported_architecture_lists_the_supported(arch: str, load_format: str, tmp_path: Path) -> None:
    """transformers' own refusal ("architecture foo is not supported yet", no file named) or an
    AttributeError came first, before any list of what loads."""
    path = _write_gguf(tmp_path / "model.gguf", arch)
    with pytest.raises(ValueError, match=rf"{path}.*general\.architecture='{arch}'.*supported: \[.*'llama'.*'qwen3'"):
        resolve_model(str(path), load_format=load_format)


# Metadata that loaded and then ran wrong (NaN rotations, an eos never sampled), failed deep in the
# model (an IndexError, a bare reshape error) or with transformers' own non-ValueError: (keys, message).
BAD_METADATA = {
    "context-length-0": ({"{arch}.context_length": 0},
                         r"llama\.context_length=0 \(max_position_embeddings\) is invalid: must be an integer >= 1"),
    "kv-heads-not-dividing": ({"{arch}.attention.head_count_kv": 3},
                              r"llama\.attention\.head_count_kv=3 does not divide llama\.attention\.head_count=4"),
    "heads-not-dividing-the-width": ({"{arch}.attention.head_count": 3},
                                     r"hidden size \(64\) is not a multiple of the "
                                     r"number of attention heads \(3\)"),
    "rope-base-negative": ({"{arch}.rope.freq_base": -1.0},
                           r"llama\.rope\.freq_base=-1\.0 is invalid: must be a number > 0"),
    "norm-epsilon-missing": ({"left_out": "add_layer_norm_rms_eps"},
                             r"has no llama\.attention\.layer_norm_rms_epsilon, which a llama model needs"),
    "context-length-missing": ({"left_out": "add_context_length"}, r"has no llama\.context_length"),
    "eos-outside-the-vocabulary": ({"eos_token_id": 5000},
                                   r"tokenizer\.ggml\.eos_token_id=5000 is not a token of the file's vocabulary "
                                   r"\(tokenizer\.ggml\.tokens: ids 0\.\.288\)"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
@pytest.mark.parametrize("load_format", ["auto", "gguf"])
def test_contradictory_gguf_metadata_is_refused_by_key(case: str, load_format: str, tiny_llama_dir: Path,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.gguf_writer import write_gguf

    import gguf

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    metadata, message = dict(BAD_METADATA[case][0]), BAD_METADATA[case][1]
    if metadata.get("left_out"):  # a key the writer would write: keep it out of the file
        monkeypatch.setattr(gguf.GGUFWriter, metadata.pop("left_out"), lambda self, *args: None)
    hf_dir = tiny_llama_dir
    if "eos_token_id" in metadata:  # the writer takes the tokenizer's keys from the model's config
        hf_dir = _edit_config(_copy(tiny_llama_dir, tmp_path / "hf"), **metadata)
        metadata = {}
    path = tmp_path / "model.gguf"
    write_gguf(hf_dir, path, metadata=metadata)
    with pytest.raises(ValueError, match=rf"(?s)GGUF file {re.escape(str(path))}\W.*{message}"):
        _load(resolve_model(str(path), load_format=load_format, dtype="float32"))


def test_big_endian_gguf_is_refused(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf's reader reads a big-endian file's metadata, but its dequantizer takes the tensors' bytes
    as little-endian: with the config from a folder (config.json beside gguf_file=), every weight
    loaded as garbage without an error (llama.cpp refuses such files on a little-endian machine)."""
    import gguf

    from support.gguf_writer import write_gguf

    writer_init = gguf.GGUFWriter.__init__
    monkeypatch.setattr(gguf.GGUFWriter, "__init__", lambda self, path, arch, **kwargs: writer_init(
        self, path, arch, endianess=gguf.GGUFEndian.BIG, **kwargs))
    folder = _copy(tiny_llama_dir, tmp_path / "model", skip=("model.safetensors",))
    write_gguf(tiny_llama_dir, folder / "big.gguf")
    assert gguf.GGUFReader(str(folder / "big.gguf")).endianess == gguf.GGUFEndian.BIG
    with pytest.raises(ValueError, match=rf"GGUF file {re.escape(str(folder / 'big.gguf'))} is big-endian"):
        _load(resolve_model(str(folder), gguf_file="big.gguf"))


# --- arguments and the tokenizer ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokenizer": ""}, r"LLM\(tokenizer=''\) is invalid: must be None or a non-empty string"),
        ({"tokenizer": 5}, r"LLM\(tokenizer=5\) is invalid: must be None or a non-empty string"),
        ({"revision": 5}, r"LLM\(revision=5\) is invalid: must be None or a non-empty string"),
        ({"tokenizer_revision": ["main"]}, r"LLM\(tokenizer_revision=\['main'\]\) is invalid"),
        ({"gguf_file": 1}, r"LLM\(gguf_file=1\) is invalid"),
    ],
)
def test_bad_path_arguments_are_named(tiny_llama_dir: Path, kwargs: dict, message: str) -> None:
    from tokenmill.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(str(tiny_llama_dir), **kwargs)


def test_folder_without_tokenizer_says_so(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """transformers' own message blamed a missing sentencepiece; skip_tokenizer_init and tokenizer= still load."""
    from tokenmill.config import EngineArgs
    from tokenmill.engine_inputs import load_tokenizer

    folder = _copy(tiny_llama_dir, tmp_path / "m", skip=("tokenizer*",))
    source = resolve_model(str(folder))
    with pytest.raises(ValueError, match=rf"{folder} has no tokenizer files .*tokenizer=.*skip_tokenizer_init=True"):
        load_tokenizer(source, EngineArgs(model=str(folder)))
    other = resolve_model(str(folder), tokenizer=str(tiny_llama_dir))
    assert load_tokenizer(other, EngineArgs(model=str(folder))).eos_token_id == 2
