"""PyTorch checkpoints (``pytorch_model.bin``, sharded with ``pytorch_model.bin.index.json``), as older
Hugging Face models ship them: written here by ``torch.save`` from the tiny models' safetensors
tensors, they must give the very logits the safetensors folder gives; read tensors-only, so a file
holding anything else is refused by name, and safetensors win where a folder has both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import SamplingParams
from tokenmill.models.loader import load_model
from tokenmill.models.source import resolve_model


def _as_pytorch_checkpoint(src: Path, dst: Path, shards: int = 1, legacy: bool = False) -> Path:
    """``src``'s weights as torch.save shards (the safetensors files left out), with an index when sharded."""
    from safetensors.torch import load_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    state = {name: t for path in sorted(src.glob("*.safetensors")) for name, t in load_file(str(path)).items()}
    names = sorted(state)
    files = {}
    for i in range(shards):
        part = {name: state[name] for name in names[i::shards]}
        file = "pytorch_model.bin" if shards == 1 else f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save(part, dst / file, _use_new_zipfile_serialization=not legacy)
        files.update(dict.fromkeys(part, file))
    if shards > 1:
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return dst


def _logits(folder: Path, paged_cache) -> torch.Tensor:
    model = load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    return paged_cache(model).step([(0, list(range(3, 20)))])[0]


@pytest.mark.parametrize("shards, legacy", [(1, False), (3, False), (1, True)])
def test_a_pytorch_checkpoint_gives_the_safetensors_logits(tiny_qwen2_dir, tmp_path, paged_cache, shards, legacy):
    folder = _as_pytorch_checkpoint(tiny_qwen2_dir, tmp_path / "m", shards, legacy)
    source = resolve_model(str(folder))
    assert source.weights_format == "pt"
    assert source.weights_path.name == ("pytorch_model.bin" if shards == 1 else "pytorch_model.bin.index.json")
    assert torch.equal(_logits(folder, paged_cache), _logits(tiny_qwen2_dir, paged_cache))


def test_an_engine_on_a_pytorch_checkpoint_generates_as_on_safetensors(tiny_llama_dir, tmp_path):
    folder = _as_pytorch_checkpoint(tiny_llama_dir, tmp_path / "m", shards=2)
    prompts = as_inputs(random_prompts(289, [5, 17], seed=3))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    ours, reference = (make_llm(path, load_format=fmt).generate(prompts, params, use_tqdm=False)
                       for path, fmt in ((folder, "pt"), (tiny_llama_dir, "auto")))
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]
    assert [o.outputs[0].cumulative_logprob for o in ours] == [o.outputs[0].cumulative_logprob for o in reference]


class _NotATensor:
    pass


def test_a_pickle_holding_more_than_tensors_is_refused_by_name(tiny_llama_dir, tmp_path):
    folder = _as_pytorch_checkpoint(tiny_llama_dir, tmp_path / "m")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": _NotATensor()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin as tensors only"):
        load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))


def test_safetensors_win_where_a_folder_has_both(tiny_llama_dir, tmp_path):
    folder = _as_pytorch_checkpoint(tiny_llama_dir, tmp_path / "m")
    shutil.copy(tiny_llama_dir / "model.safetensors", folder / "model.safetensors")
    assert resolve_model(str(folder)).weights_format == "safetensors"
    with pytest.raises(ValueError, match="holds safetensors weights"):
        load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), "pt")
