"""Dense GGUF files of every family the README claims, written the way llama.cpp's converter lays
them out (support/gguf_writer.py), load into the model of the original Hugging Face folder, rope
scaling included: Llama with Llama 3.1's "llama3" scaling (the ``rope_freqs`` tensor), Mistral
with a linear scaling and Qwen2 with YaRN (``rope.scaling.*`` keys), Qwen2's q/k/v biases, Qwen3's
head_dim (not hidden / heads) and biases, Phi-3's fused ``attn_qkv`` / gate+up ``ffn_up`` with
partial rotary, and with LongRoPE (its factor tensors), Granite's four multipliers (metadata) and
SmolLM3's layers without rotary.

The reference is transformers in fp32 on the ORIGINAL config (its rope scaling included) and the
values the file encodes (some tensors are stored as Q8_0 or F16): greedy tokens identical and
logprobs, of the prompt and of the output, within 1e-4. Prompts are long enough (40 tokens) that
the scalings change every position's rotation in the low-frequency pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference import hf_model
from support.gguf_writer import write_gguf_and_reference
from support.tiny_models import save_tiny_model, tiny_config_kwargs
from tokenmill import LLM, SamplingParams

# Per case: the HF folder's fixture, GGUF tensors stored as Q8_0 (rows of a multiple of 32) and as F16.
CASES = {
    "llama-llama3-rope": ("tiny_llama_dir", {"blk.0.attn_q": "Q8_0"}, ["blk.1.ffn_up"]),
    "mistral-linear-rope": ("tiny_mistral_dir", {"blk.1.attn_k": "Q8_0"}, ["blk.0.attn_output"]),
    "qwen2-biases": ("tiny_qwen2_dir", {"blk.0.ffn_down": "Q8_0"}, ["blk.1.attn_q"]),
    "qwen2-yarn-rope": ("tiny_qwen2_yarn_dir", {}, ["blk.0.ffn_gate"]),
    "qwen3-head-dim": ("tiny_qwen3_dir", {"blk.1.attn_v": "Q8_0"}, []),
    "phi3-fused-partial-rotary": ("tiny_phi3_dir", {"blk.0.attn_qkv": "Q8_0"}, ["blk.1.ffn_up"]),
    "phi3-longrope": ("tiny_phi3_longrope_dir", {}, ["blk.0.attn_qkv"]),
    "granite-multipliers": ("tiny_granite_dir", {"blk.0.ffn_up": "Q8_0"}, []),
    "smollm3-nope-layers": ("tiny_smollm3_gguf_dir", {}, ["blk.3.attn_q"]),
}
# Config fields compared between the original and the converted folder, where the original has them.
CONFIG_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                 "max_position_embeddings", "attention_bias", "mlp_bias", "partial_rotary_factor", "sliding_window",
                 "original_max_position_embeddings", "embedding_multiplier", "residual_multiplier",
                 "attention_multiplier", "logits_scaling", "no_rope_layers", "use_sliding_window")
# llama.cpp writes Mistral as architecture "llama" (and no sliding window): it loads as the Llama it is.
AS_LLAMA = {"mistral-linear-rope": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "sliding_window": None}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0)


@pytest.fixture(autouse=True)
def conversion_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own, so conversions never touch (or come from) the user's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny_smollm3_gguf_dir(tiny_models_root: Path) -> Path:
    """SmolLM3 with four layers and HF's default layout, layer 3 without rotary: a GGUF has no key for
    these layers and llama.cpp fixes every fourth (tiny_smollm3_dir's [1, 0] has no GGUF form)."""
    from transformers import SmolLM3Config

    config = SmolLM3Config(**tiny_config_kwargs(tie_word_embeddings=True, num_hidden_layers=4),
                           architectures=["SmolLM3ForCausalLM"])
    assert config.no_rope_layers == [1, 1, 1, 0]
    return save_tiny_model(tiny_models_root, "smollm3_gguf", config, seed=23)


def _random_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(steps):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        tokens.append(int(torch.argmax(logp)))
        logprobs.append(float(logp[tokens[-1]]))
        ids.append(tokens[-1])
    return tokens, logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_dense_gguf_computes_what_the_original_model_computes(case: str, request, tmp_path: Path,
                                                             conversion_cache: Path) -> None:
    fixture, quantized, f16 = CASES[case]
    hf_dir = request.getfixturevalue(fixture)
    path, reference = write_gguf_and_reference(hf_dir, tmp_path, quantized, f16)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=16 * 2**20, seed=0)

    # The converted folder: the original's config, rope parameters included, as a plain HF folder.
    source = llm.llm_engine.source
    assert source.config_dir is not None and source.config_dir.parent == conversion_cache / "models"
    want = json.loads((hf_dir / "config.json").read_text())
    got = json.loads((source.config_dir / "config.json").read_text())
    want.update(AS_LLAMA.get(case, {}))
    assert {f: got.get(f) for f in CONFIG_FIELDS if f in want} == {f: want[f] for f in CONFIG_FIELDS if f in want}
    assert got["rope_parameters"] == want["rope_parameters"]

    prompts = _random_prompts(want["vocab_size"], [9, 40])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ref_model, converted = hf_model(str(reference)), hf_model(str(source.config_dir))
    for prompt, output in zip(prompts, outputs):
        want_prompt = _hf_prompt_logprobs(ref_model, prompt)
        ours_prompt = [output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0]
        assert max(abs(a - b) for a, b in zip(ours_prompt, want_prompt)) < 1e-4
        # transformers reading the converted folder computes the same (it is a valid HF folder).
        assert max(abs(a - b) for a, b in zip(_hf_prompt_logprobs(converted, prompt), want_prompt)) < 1e-4
        ref_tokens, ref_logprobs = _hf_greedy(ref_model, prompt, GREEDY.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4


def test_llama3_gguf_read_directly_matches_transformers(tiny_llama_dir: Path, tmp_path: Path, paged_cache,
                                                        hf_reference) -> None:
    """load_format="gguf" (no conversion: config and tensors straight from the file) derives the same
    llama3 rope scaling, and rope_freqs is not taken for a weight."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model

    path, reference = write_gguf_and_reference(tiny_llama_dir, tmp_path)
    source = resolve_model(str(path), load_format="gguf")
    assert source.weights_format == "gguf" and source.config_dir is None
    assert source.hf_config.rope_parameters == json.loads((tiny_llama_dir / "config.json").read_text())["rope_parameters"]
    model = load_model(source, torch.float32, torch.device("cpu"), "gguf")
    tokens = _random_prompts(source.hf_config.vocab_size, [33])[0]
    with torch.no_grad():
        want = hf_reference(reference)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(paged_cache(model).step([(0, tokens)])[0], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_phi3_dir", "tiny_qwen3_dir"])
def test_the_written_gguf_is_what_transformers_reads_as_llama_cpp_files(fixture: str, request, tmp_path: Path) -> None:
    """The test's writer and our reader could share a wrong idea of llama.cpp's layout (the q/k
    permutation's direction, Phi-3's fused tensors) and still agree with each other. transformers'
    own GGUF loader, written for llama.cpp's files, reads the file into the original model: the
    layout is llama.cpp's. (Its config reading misses what test_dense_gguf_... checks, so the
    original config is given.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = request.getfixturevalue(fixture)
    path, _ = write_gguf_and_reference(hf_dir, tmp_path)  # every tensor F32: the values are the original's
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                  config=AutoConfig.from_pretrained(hf_dir))
    tokens = torch.tensor(_random_prompts(theirs.config.vocab_size, [17]))
    with torch.no_grad():
        want = hf_model(str(hf_dir))(tokens).logits
        assert want.std() > 0.1
        torch.testing.assert_close(theirs(tokens).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("load_format", ["auto", "gguf"])
def test_end_of_turn_and_end_of_message_ids_end_generation(load_format: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """llama.cpp ends generation at the file's eos and also at its ``tokenizer.ggml.eot_token_id`` /
    ``eom_token_id`` (llama_vocab's end-of-generation set): only the eos did."""
    from support.gguf_writer import write_gguf

    path = tmp_path / "model.gguf"
    write_gguf(tiny_llama_dir, path, metadata={"tokenizer.ggml.eot_token_id": 1, "tokenizer.ggml.eom_token_id": 0})
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=16 * 2**20,
              load_format=load_format)
    assert llm.llm_engine.config.eos_token_ids == {2, 1, 0}
