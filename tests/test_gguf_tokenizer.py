"""A GGUF's tokenizer as llama.cpp, which writes and runs these files, tokenizes with it
(tokenmill/models/gguf_tokenizer.py), converted or read directly (load_format="gguf"). SmolLM2's
digit splitting: test_smollm2.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.gguf_writer import write_gguf
from tokenmill import LLM


@pytest.mark.parametrize("load_format", ["auto", "gguf"])
def test_llama3_vocabulary_takes_a_whole_piece_before_merges(load_format: str, tiny_llama_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp tokenizes a Llama 3 vocabulary (``tokenizer.ggml.pre`` "llama-bpe") with
    ``ignore_merges``: a piece that is a token of its own stays whole, merges or not (the original
    tokenizer.json says ``"ignore_merges": true``). transformers' reading applied the merges only,
    so a token no chain of merges reaches was cut into bytes. Here "ll" is a token and its merge is
    gone from the list: the piece "ll" is that token, the piece " all" is merged as before."""
    import gguf

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_llama_dir, hf_dir)
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    data["model"]["merges"] = [m for m in data["model"]["merges"] if m not in (["l", "l"], "l l")]
    (hf_dir / "tokenizer.json").write_text(json.dumps(data))
    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre", lambda self, _: self.add_string("tokenizer.ggml.pre", "llama-bpe"))
    path = tmp_path / "gguf" / "model.gguf"
    path.parent.mkdir()
    write_gguf(hf_dir, path)
    tokenizer = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=16 * 2**20,
                    load_format=load_format).get_tokenizer()
    ids = tokenizer("ll all", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["ll", "Ġa", "l", "l"]  # "all" is no token: merges apply


@pytest.mark.parametrize("load_format", ["auto", "gguf"])
def test_llama3_vocabulary_without_the_add_bos_key_adds_bos(load_format: str, tiny_llama_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp adds the BOS to every prompt of a Llama 3 / Tekken vocabulary unless the file's
    ``tokenizer.ggml.add_bos_token`` says otherwise (files converted before the key was written have
    none); transformers' reading added none, so those models ran without the BOS they were trained with."""
    import gguf

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre", lambda self, _: self.add_string("tokenizer.ggml.pre", "llama-bpe"))
    monkeypatch.setattr(gguf.GGUFWriter, "add_add_bos_token", lambda self, _: None)  # no key
    path = tmp_path / "model.gguf"
    write_gguf(tiny_llama_dir, path)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, kv_cache_memory_bytes=16 * 2**20,
              load_format=load_format)
    bos = llm.get_tokenizer().bos_token_id
    assert bos == 0 and llm.get_tokenizer()("the cat")["input_ids"][0] == bos
    assert llm.generate(["the cat"], use_tqdm=False)[0].prompt_token_ids[0] == bos


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tokenizer_class_from_the_model_type_is_autotokenizers(family: str, request: pytest.FixtureRequest,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the file's model type (a conversion has read its config already), the tokenizer is
    built with the class AutoTokenizer picks for the file and is the same tokenizer (the same saved
    files), without AutoTokenizer's second reading of the whole file for its config; model types
    with a tokenizer class of their own (Qwen2's) still go through AutoTokenizer."""
    import transformers.modeling_gguf_pytorch_utils as legacy
    from transformers import AutoConfig, AutoTokenizer

    from tokenmill.models.gguf_tokenizer import fix_gguf_tokenizer, load_gguf_tokenizer
    from tokenmill.models.gguf_weights import open_gguf

    path = tmp_path / "gguf" / "model.gguf"
    path.parent.mkdir()
    write_gguf(request.getfixturevalue(f"tiny_{family}_dir"), path)
    reader = open_gguf(path)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    fix_gguf_tokenizer(reference, reader)
    model_type = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).model_type
    read_config = legacy.load_gguf_checkpoint
    calls: list[str] = []
    monkeypatch.setattr(legacy, "load_gguf_checkpoint", lambda *a, **k: calls.append("read") or read_config(*a, **k))
    ours = load_gguf_tokenizer(path, reader, model_type=model_type)
    assert type(ours) is type(reference)
    assert calls == ([] if family == "llama" else ["read"])
    reference.save_pretrained(str(tmp_path / "reference"))
    ours.save_pretrained(str(tmp_path / "ours"))
    files = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for name in files:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name
    # A tokenizer_config.json beside the file may name the class AutoTokenizer takes: it decides then.
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    calls.clear()
    load_gguf_tokenizer(path, reader, model_type=model_type)
    assert calls == ["read"]


def _vocabulary_file(tmp_path: Path, tokens: list[str], **ids: int) -> object:
    """A GGUF holding only a vocabulary and the given ``tokenizer.ggml.<role>_token_id`` keys, read back."""
    import gguf

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    for role, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{role}_token_id", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_generation_ends_where_llama_cpp_ends_it(tmp_path: Path) -> None:
    """llama.cpp's end-of-generation set (llama-vocab.cpp, llama_vocab::impl::load): the file's eos /
    eot / eom and fill-in-the-middle pad, repo and file-separator ids, and the tokens whose text ends
    a turn. A Phi-3 file names <|endoftext|> its eos, and its chat answers end at <|end|>: generation
    ran on past every answer to max_tokens, ending only at the eos."""
    from tokenmill.models.gguf_tokenizer import gguf_generation_ids

    phi3 = ["<unk>", "<s>", "</s>", "a", "b", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
    ids = gguf_generation_ids(_vocabulary_file(tmp_path / "phi3", phi3, bos=1, eos=5))
    assert ids["bos_token_id"] == 1 and set(ids["eos_token_id"]) == {2, 5, 7} and ids["eos_token_id"][0] == 5

    # Harmony's <|end|> closes a message before a <|call|> or <|return|>: not an end of generation there.
    harmony = ["a", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    assert set(gguf_generation_ids(_vocabulary_file(tmp_path / "harmony", harmony, eos=3))["eos_token_id"]) == {3, 4, 5}

    # Keys the file names count whatever their text; the fill-in-the-middle texts when it names none.
    qwen = ["a", "b", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "c"]
    named = gguf_generation_ids(_vocabulary_file(tmp_path / "qwen", qwen, eos=3, eot=7, fim_pad=1))
    assert set(named["eos_token_id"]) == {3, 7, 1, 4, 5, 6}
    assert "eos_token_id" not in gguf_generation_ids(_vocabulary_file(tmp_path / "plain", ["a", "b"]))
