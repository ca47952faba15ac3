"""Mixture-of-experts GGUF files: Qwen3-MoE and Qwen2-MoE written the way llama.cpp lays them out
(merged 3-D expert tensors, the shared expert's gate squeezed to 1-D, llama.cpp's metadata keys;
support/gguf_writer.py) load into the same model as their Hugging Face folder, and a Mixtral GGUF
(llama.cpp's "llama" architecture with experts) is refused by name.

Some tensors are stored as Q8_0 or F16, so the reference is transformers on the values the file
holds: the original weights with those tensors replaced by their dequantized values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from reference import hf_greedy, hf_model
from support.gguf_writer import write_gguf, write_gguf_and_reference
from tokenmill import LLM, SamplingParams

# Per model: GGUF tensors stored as Q8_0 (merged experts, a shared expert) and as F16. Q8_0 needs
# rows of a multiple of 32: H = 64, and Qwen2-MoE's experts are 32 wide (Qwen3-MoE's 48 are not).
STORED = {
    "tiny_qwen3_moe_dir": ({"blk.0.ffn_up_exps": "Q8_0", "blk.2.ffn_gate_exps": "Q8_0"}, ["blk.0.attn_q"]),
    "tiny_qwen2_moe_dir": ({"blk.1.ffn_down_exps": "Q8_0", "blk.0.ffn_gate_shexp": "Q8_0"},
                           ["blk.1.ffn_gate_inp_shexp", "blk.0.ffn_gate_exps"]),
}
# Fields whose transformers defaults differ from these tiny models, so a field left unread shows.
CONFIG_FIELDS = ("architectures", "model_type", "num_experts", "num_local_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                 "mlp_only_layers", "intermediate_size", "head_dim", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "vocab_size")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(autouse=True)
def conversion_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own, so conversions never touch (or come from) the user's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache))
    return cache


def _hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _random_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("fixture", list(STORED))
def test_moe_gguf_generates_as_transformers_on_its_weights(fixture: str, request, tmp_path: Path,
                                                          conversion_cache: Path) -> None:
    hf_dir = request.getfixturevalue(fixture)
    path, reference = write_gguf_and_reference(hf_dir, tmp_path, *STORED[fixture])
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=16 * 2**20, seed=0)

    # The converted folder: the original's config (the MoE fields transformers does not read from
    # a GGUF included) and the hub's tensor layout, one tensor per expert.
    source = llm.llm_engine.source
    assert source.config_dir is not None and source.config_dir.parent == conversion_cache / "models"
    want = json.loads((hf_dir / "config.json").read_text())
    got = json.loads((source.config_dir / "config.json").read_text())
    assert {f: got.get(f) for f in CONFIG_FIELDS} == {f: want.get(f) for f in CONFIG_FIELDS}
    assert source.hf_config.architectures == want["architectures"]
    with safe_open(str(source.config_dir / "model.safetensors"), "pt") as converted, \
            safe_open(str(hf_dir / "model.safetensors"), "pt") as hub:
        assert set(converted.keys()) == set(hub.keys())

    prompts = _random_prompts(want["vocab_size"], [4, 21, 40])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ref_model = hf_model(str(reference))
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(ref_model, prompt, GREEDY.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4
    # The file's tokenizer is the model's: same ids for text, and the chat template carried over.
    text = "the cat<|im_end|> sat on 12 mats!\n"
    ours_tok, hub_tok = llm.get_tokenizer(), _hf_tokenizer(hf_dir)
    assert ours_tok.encode(text) == hub_tok.encode(text)
    assert ours_tok.chat_template == hub_tok.chat_template and ours_tok.eos_token == hub_tok.eos_token


def test_moe_gguf_read_directly_matches_its_conversion(tiny_qwen2_moe_dir: Path, tmp_path: Path, paged_cache,
                                                       hf_reference) -> None:
    """load_format="gguf" (no conversion: config and tensors straight from the file) builds the same model."""
    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model

    path, reference = write_gguf_and_reference(tiny_qwen2_moe_dir, tmp_path, *STORED["tiny_qwen2_moe_dir"])
    source = resolve_model(str(path), load_format="gguf")
    assert source.weights_format == "gguf" and source.config_dir is None
    assert (source.hf_config.moe_intermediate_size, source.hf_config.shared_expert_intermediate_size) == (32, 96)
    model = load_model(source, torch.float32, torch.device("cpu"), "gguf")
    tokens = _random_prompts(source.hf_config.vocab_size, [19])[0]
    with torch.no_grad():
        want = hf_reference(reference)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(paged_cache(model).step([(0, tokens)])[0], want, atol=1e-4, rtol=0)


def test_mixtral_gguf_is_refused_by_name(tiny_mixtral_dir: Path, tmp_path: Path, conversion_cache: Path) -> None:
    """llama.cpp writes Mixtral as architecture "llama" with llama.expert_count > 0; transformers would
    read it as a dense Llama, so it is refused before anything is converted."""
    from tokenmill.models.source import resolve_model

    folder = tmp_path / "mixtral"
    folder.mkdir()
    path = folder / "mixtral.gguf"
    write_gguf(tiny_mixtral_dir, path)
    message = rf"GGUF file {re.escape(str(path))} has llama\.expert_count=4: .*'qwen2moe', 'qwen3moe'"
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=message):
        resolve_model(str(path), load_format="gguf")
    # Only the content hash was remembered: no converted folder, finished or half-written.
    assert sorted(p.name for p in (conversion_cache / "models").iterdir()) == ["gguf-hashes"]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_written_gguf_is_what_transformers_reads_as_llama_cpp_files(family: str, tmp_path: Path) -> None:
    """The test's writer and our reader could share a wrong idea of llama.cpp's layout (merged experts'
    order, the shared gate's shape) and still agree with each other. transformers' own GGUF loader,
    written for llama.cpp's files, reads the file into the original model: the layout is llama.cpp's.
    (Every layer sparse, as llama.cpp's converter writes these architectures: transformers' loader
    has no dense blocks for them. Its config reading leaves the MoE widths at class defaults, so
    the original config is given.)"""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    from support.tiny_models import save_tiny_model, tiny_config_kwargs

    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**tiny_config_kwargs(tie_word_embeddings=True, head_dim=16), moe_intermediate_size=48,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    else:
        config = Qwen2MoeConfig(**tiny_config_kwargs(tie_word_embeddings=False), moe_intermediate_size=32,
                                shared_expert_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                                architectures=["Qwen2MoeForCausalLM"])
    hf_dir = save_tiny_model(tmp_path, family, config, seed=11)
    folder = tmp_path / "gguf"
    folder.mkdir()
    write_gguf(hf_dir, folder / "model.gguf")  # every tensor F32: the values are the original's
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf", dtype=torch.float32,
                                                  config=AutoConfig.from_pretrained(hf_dir))
    tokens = torch.tensor([_random_prompts(config.vocab_size, [17])[0]])
    with torch.no_grad():
        want = hf_model(str(hf_dir))(tokens).logits
        assert want.std() > 0.1
        torch.testing.assert_close(theirs(tokens).logits, want, atol=1e-5, rtol=0)


def test_one_part_of_a_split_gguf_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp's gguf-split writes split.count into every part; loading one part alone would report
    the other parts' tensors missing (and read a MoE file's layers as dense)."""
    import gguf

    from tokenmill.models.gguf_weights import open_gguf

    path = tmp_path / "model-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"GGUF file {re.escape(str(path))} has split\.count=2: .*llama-gguf-split --merge"):
        open_gguf(path)
