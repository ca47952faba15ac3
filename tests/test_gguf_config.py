"""The config of a GGUF of each family transformers reads (Llama, Qwen2, Qwen3, Phi-3, Qwen2-MoE,
Qwen3-MoE) is built from the keys our reader has parsed, without transformers' legacy reader
parsing the whole file again; it must be the config transformers builds from the same file
(``AutoConfig.from_pretrained(folder, gguf_file=...)``), with our fixes applied to both, in every
field, for files written the way llama.cpp's converter writes them (support/gguf_writer.py),
each rope scaling's way of being written included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.gguf_writer import write_gguf

# Per case: the HF folder's fixture and extra metadata keys ({arch}: the file's architecture).
CASES = {
    "llama-llama3-rope-tensor": ("tiny_llama_dir", {}),
    "mistral-linear-rope-keys": ("tiny_mistral_dir", {}),
    "qwen2-unknown-token": ("tiny_qwen2_dir", {"tokenizer.ggml.unknown_token_id": 1}),
    "qwen2-yarn-rope-keys": ("tiny_qwen2_yarn_dir", {}),
    "qwen3-head-dim": ("tiny_qwen3_dir", {}),
    "phi3-partial-rotary": ("tiny_phi3_dir", {}),
    "phi3-longrope-tensors": ("tiny_phi3_longrope_dir", {}),
    "qwen2-moe-arch-in-name": ("tiny_qwen2_moe_dir", {"general.name": "tiny qwen2moe"}),
    "qwen3-moe-explicit-vocab": ("tiny_qwen3_moe_dir", {"{arch}.vocab_size": 289}),
}


def _transformers_then_our_fixes(path: Path, reader) -> dict:
    """What read_gguf_config returned before: transformers' config of the file, then our fixes."""
    from transformers import AutoConfig

    from tokenmill.models.gguf_config import fix_dense_config, fix_moe_config

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    fix_dense_config(config, reader, path)
    fix_moe_config(config, reader)
    return config.to_dict()


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_built_from_our_keys_is_transformers_config(case: str, request, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import modeling_gguf_pytorch_utils

    from tokenmill.models.gguf_config import read_gguf_config
    from tokenmill.models.gguf_weights import open_gguf

    fixture, metadata = CASES[case]
    path = tmp_path / "model.gguf"
    write_gguf(request.getfixturevalue(fixture), path, metadata=metadata)
    reader = open_gguf(path)
    want = _transformers_then_our_fixes(path, reader)
    calls = []
    real = modeling_gguf_pytorch_utils.load_gguf_checkpoint
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint",
                        lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    got = read_gguf_config(path, reader).to_dict()
    assert calls == [], "transformers' legacy reader parsed the file again"
    assert got == want
    assert got["model_type"] == want["model_type"] != "mistral"  # not vacuous: a real config on both sides
    assert got["hidden_size"] == 64 and got["max_position_embeddings"] == 256


def test_a_llama_file_named_mistral_still_goes_to_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """transformers' legacy reader makes a "llama" file whose general.name is "mistral" a Mistral
    config: that quirk is left to it rather than copied."""
    from transformers import AutoConfig

    from tokenmill.models.gguf_config import read_gguf_config
    from tokenmill.models.gguf_weights import open_gguf

    path = tmp_path / "model.gguf"
    write_gguf(tiny_llama_dir, path, metadata={"general.name": "mistral"})
    reader = open_gguf(path)
    got = read_gguf_config(path, reader)
    assert got.model_type == AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).model_type == "mistral"


def test_load_format_gguf_parses_the_file_once(tiny_llama_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """load_format="gguf" reads config, weights and tokenizer from one GGUFReader (each parse of
    SmolLM2's file costs ~4 s); it opened three. The source handed to worker processes carries no
    reader (its memory map would pickle as the whole file). Tokens as the cached conversion's."""
    import pickle

    import gguf

    from tokenmill import LLM, SamplingParams

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    write_gguf(tiny_llama_dir, path)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = LLM(str(path), dtype="float32").generate(["hello world"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    opened = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: opened.append(args) or real(*args, **kwargs))
    llm = LLM(str(path), dtype="float32", load_format="gguf")
    assert len(opened) == 1
    assert llm.generate(["hello world"], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    from tokenmill.models.source import resolve_model

    source = resolve_model(str(path), load_format="gguf")
    assert source.gguf_reader is not None and pickle.loads(pickle.dumps(source)).gguf_reader is None
