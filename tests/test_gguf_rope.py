"""A GGUF file's rope scaling read back into the Hugging Face parameters it was written from
(tokenmill/models/gguf_rope.py): the llama3 parameters fitted to llama.cpp's ``rope_freqs``
divisors give transformers' own inverse frequencies, the scaling keys map to HF's types, and what
cannot be expressed exactly is refused by name. (End-to-end loads of scaled files against
transformers: test_gguf_dense.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.gguf_writer import llama3_rope_factors, write_gguf

# (head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
LLAMA_31_8B = (128, 500000.0, 8.0, 1.0, 4.0, 8192)
LLAMA_32_1B = (64, 500000.0, 32.0, 1.0, 4.0, 8192)
LLAMA3_CASES = {
    "llama-3.1-8b": LLAMA_31_8B,
    "llama-3.2-1b": LLAMA_32_1B,
    "low-freq-factor-2": (128, 500000.0, 8.0, 2.0, 5.0, 8000),  # the same scaling as low 1, high 2.5, L 4000
    "one-pair-in-the-band": (16, 10000.0, 4.0, 1.0, 1.2, 64),
    "no-pair-in-the-band": (16, 10000.0, 4.0, 1.0, 1.05, 30),
    "no-pair-scaled": (16, 10000.0, 4.0, 1.0, 4.0, 100000),  # plain RoPE
    "every-pair-scaled": (16, 10000.0, 4.0, 1.0, 4.0, 1),  # a linear scaling
}


def _rope(case: tuple) -> dict:
    _, theta, factor, low, high, length = case
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": length}


def _hf_inverse_frequencies(rope: dict, head_dim: int) -> torch.Tensor:
    """transformers' own inverse frequencies for these rope parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope)
    if rope["rope_type"] == "default":
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")[0]


@pytest.mark.parametrize("case", list(LLAMA3_CASES))
def test_llama3_parameters_fitted_to_rope_freqs_give_transformers_frequencies(case: str) -> None:
    from tokenmill.models.gguf_rope import llama3_from_factors

    params = LLAMA3_CASES[case]
    head_dim, theta = params[0], params[1]
    rope = _rope(params)
    factors = llama3_rope_factors(rope, head_dim).double().numpy()  # as llama.cpp's converter writes them
    derived = llama3_from_factors(factors, theta, head_dim, "test")
    if case.startswith("llama-3"):  # Llama's own values come back exactly
        assert derived == {k: v for k, v in rope.items() if k != "rope_theta"}
    if case == "no-pair-scaled":
        assert derived == {}
    if case == "every-pair-scaled":
        assert derived == {"rope_type": "linear", "factor": 4.0}
    got = _hf_inverse_frequencies({"rope_type": "default", "rope_theta": theta, **derived}, head_dim)
    want = _hf_inverse_frequencies(rope, head_dim)
    assert (want != 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))).any() or case == "no-pair-scaled"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def _read_config(path: Path):
    """The config tokenmill reads from the file (load_format="gguf": no conversion)."""
    from tokenmill.models.source import resolve_model

    return resolve_model(str(path), load_format="gguf").hf_config


def _file(hf_dir: Path, tmp_path: Path, **kwargs) -> Path:
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = folder / "model.gguf"
    write_gguf(hf_dir, path, **kwargs)
    return path


@pytest.mark.parametrize(("metadata", "want"), [
    ({"{arch}.rope.scaling.factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),  # llama.cpp's default type
    ({"{arch}.rope.scaling.type": "none", "{arch}.rope.scaling.factor": 2.0}, {"rope_type": "default"}),
    ({"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0}, {  # the context length stands in
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
])
def test_scaling_keys_map_to_hf_rope_types(metadata: dict, want: dict, tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    config = _read_config(_file(tiny_qwen2_dir, tmp_path, metadata=metadata))
    assert config.rope_parameters == {"rope_theta": 10000.0, **want}


def _off_the_blend() -> torch.Tensor:
    """llama3 divisors with three pairs in the blend band (head_dim 16, high_freq_factor 16), the
    middle one moved 5% off the line the other two and the scaling's shape fix."""
    factors = llama3_rope_factors(_rope((16, 10000.0, 4.0, 1.0, 16.0, 256)), 16)
    assert ((factors > 1) & (factors < 4)).sum() == 3
    factors[2] *= 1.05
    return factors


# Files whose rope scaling we cannot honour: (base model fixture, write_gguf arguments, message).
REFUSED = {
    "unknown-type": ("tiny_qwen2_dir", {"metadata": {"{arch}.rope.scaling.type": "dynamic"}},
                     r"qwen2\.rope\.scaling\.type='dynamic' is not supported; supported: "
                     r"\['none', 'linear', 'yarn', 'longrope'\]"),
    "yarn-without-factor": ("tiny_qwen2_dir", {"metadata": {"{arch}.rope.scaling.type": "yarn"}},
                            r"qwen2\.rope\.scaling\.type='yarn' needs qwen2\.rope\.scaling\.factor > 0, got None"),
    "yarn-partial-extrapolation": ("tiny_qwen2_dir", {"metadata": {
        "{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0, "{arch}.rope.scaling.yarn_ext_factor": 0.5}},
        r"qwen2\.rope\.scaling\.yarn_ext_factor=0\.5 cannot be honoured .*; supported: the key absent or 1\.0"),
    "yarn-log-multiplier": ("tiny_qwen2_dir", {"metadata": {
        "{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
        "{arch}.rope.scaling.yarn_log_multiplier": 0.1}},
        r"qwen2\.rope\.scaling\.yarn_log_multiplier=0\.1\d* cannot be honoured \(DeepSeek's YaRN mscale"),
    "attn-factor-without-longrope": ("tiny_qwen2_dir", {"metadata": {"{arch}.rope.scaling.attn_factor": 1.5}},
                                     r"qwen2\.rope\.scaling\.attn_factor=1\.5 cannot be honoured without LongRoPE"),
    "longrope-without-factors": ("tiny_qwen2_dir", {"metadata": {"{arch}.rope.scaling.type": "longrope"}},
                                 r"qwen2\.rope\.scaling\.type='longrope' but no rope_factors_long\.weight"),
    "rope-freqs-and-linear": ("tiny_llama_dir", {"metadata": {
        "{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 2.0}},
        r"both a rope_freqs\.weight tensor \(llama3 rope scaling\) and llama\.rope\.scaling\.type='linear'"),
    "rope-freqs-wrong-length": ("tiny_llama_dir", {"rope_tensors": {"rope_freqs.weight": torch.ones(6) * 2}},
                                r"tensor rope_freqs\.weight has 6 values; the rotary width \(16 dims\) needs 8"),
    "rope-freqs-not-rising": ("tiny_llama_dir", {"rope_tensors": {
        "rope_freqs.weight": torch.tensor([1.0, 3.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0])}},
        r"tensor rope_freqs\.weight: the divisors \[1\.0, 3\.0, 2\.0, .*\] are not a llama3 scaling"),
    "rope-freqs-off-the-blend": ("tiny_llama_dir", {"rope_tensors": {
        "rope_freqs.weight": _off_the_blend()}},
        r"tensor rope_freqs\.weight: no llama3 rope scaling reproduces the tensor within fp32 rounding; the closest "
        r"\(factor=4\.0, .*\) gives \S+ for pair \d, the tensor has \S+"),
    # llama.cpp rotates only the first rope.dimension_count dims of each head (refuses it for "llama").
    "partial-rotary-qwen3": ("tiny_qwen3_dir", {"metadata": {"{arch}.rope.dimension_count": 16}},
                             r"qwen3\.rope\.dimension_count=16, but its heads have 32 dims"),
    "partial-rotary-llama": ("tiny_llama_dir", {"metadata": {"{arch}.rope.dimension_count": 8}},
                             r"llama\.rope\.dimension_count=8, but its heads have 16 dims"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_rope_scaling_we_cannot_honour_is_refused_by_name(case: str, request, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fixture, kwargs, message = REFUSED[case]
    path = _file(request.getfixturevalue(fixture), tmp_path, **kwargs)
    with pytest.raises(ValueError, match=rf"GGUF file {re.escape(str(path))}(,|:| has) .*{message}"):
        _read_config(path)
    if case == "rope-freqs-off-the-blend":  # the conversion refuses it too, and leaves no converted folder
        from tokenmill import LLM

        cache = tmp_path / "cache"
        monkeypatch.setenv("TOKENMILL_CACHE", str(cache))
        with pytest.raises(ValueError, match=message):
            LLM(str(path), dtype="float32", device="cpu")
        assert sorted(p.name for p in (cache / "models").iterdir()) == ["gguf-hashes"]
