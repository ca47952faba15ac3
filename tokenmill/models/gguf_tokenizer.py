"""The tokenizer of a GGUF file: transformers' reading of its ``tokenizer.ggml.*`` keys, with what
that reading gets wrong for the files we load set the way llama.cpp (which wrote and runs them)
reads them.

- The generation config's ids (``gguf_generation_ids``): every token llama.cpp ends generation at
  (its end-of-generation set): the file's eos, end-of-turn and end-of-message tokens, its
  fill-in-the-middle pad / repo / file-separator tokens, and the tokens whose text marks an end of
  turn in the chat formats llama.cpp knows (Phi-3's ``<|end|>``, Qwen's ``<|endoftext|>`` beside
  ``<|im_end|>``, Gemma's ``<end_of_turn>``, ...), found by their text because converters often
  leave the eot key out. A Phi-3 file names ``<|endoftext|>`` as its eos, and a chat answer there
  ends with ``<|end|>``: without it generation ran on to max_tokens.
- The special tokens: bos/eos/pad/unk from the file's token ids (transformers can pick another
  eos, which would make generation run past the end of every answer).
- No WordPiece-style cleanup on decoding (``clean_up_tokenization_spaces`` strips the space
  before punctuation in BPE text; llama.cpp's byte-level vocabularies never clean up).
- The pre-tokenizer of llama.cpp's digit-splitting BPE vocabularies (``tokenizer.ggml.pre``
  "smollm", "starcoder", "refact", ...): llama.cpp isolates every digit before GPT-2's split,
  as the original tokenizer.json's ``Digits(individual_digits=True)`` does. transformers knows no
  split for these names and keeps GPT-2's alone, so the spaces or newlines before a digit were cut
  apart ("  42" as " ", " 4", "2" instead of "  ", "4", "2"): other tokens than the model was
  trained on, for every number after a blank line or an indent.
- Whole pieces before merges for the Llama 3 and Tekken vocabularies (``tokenizer.ggml.pre``
  "llama-bpe", "tekken", ...): llama.cpp takes a piece that is a token of its own as that token
  (``ignore_merges``, as the original tokenizer.json says); transformers applied the merges only.
  Those vocabularies also get the BOS when the file has no ``tokenizer.ggml.add_bos_token``
  (converted before the key was written), as llama.cpp adds it; transformers added none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.models.gguf_config import CONFIG_BUILT_HERE
from tokenmill.models.gguf_weights import field

# llama.cpp's pre-tokenizers that split every digit apart, then split the rest as GPT-2 does
# (llama-vocab.cpp: one case for all of these names).
_DIGITS_APART = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b")
# llama.cpp's pre-tokenizers that take a piece found whole in the vocabulary as one token before any
# merge (its tokenizer_ignore_merges; the originals' tokenizer.json: "ignore_merges": true).
_WHOLE_PIECES_FIRST = ("llama3", "llama-v3", "llama-bpe", "falcon3", "tekken")
# llama.cpp's pre-tokenizers that add the BOS when the file has no tokenizer.ggml.add_bos_token.
_BOS_BY_DEFAULT = ("llama3", "llama-v3", "llama-bpe", "falcon3", "tekken", "chameleon")


def gguf_tokenizer_class(gguf_path: Path, reader: Any | None = None, model_type: str | None = None) -> Any:
    """The class to build this GGUF's tokenizer with (``from_pretrained(folder, gguf_file=...)``).
    AutoTokenizer, except where the class it would end at is known: the generic fast class for the
    architectures whose config is built here (AutoTokenizer first asks transformers for the file's
    config, which it refuses for them), and, given ``model_type`` (the file's config's, read by the
    caller), for a model type transformers registers no tokenizer class of its own for (Llama,
    Phi-3, Mistral), unless a tokenizer_config.json beside the file names a class: AutoTokenizer
    builds the generic class for those, after reading the whole file
    again only to learn the model type (transformers' GGUF config reader: ~5 s for SmolLM2's
    49k-token vocabulary). transformers builds a GGUF's tokenizer from its ``tokenizer.ggml.*`` keys
    whatever the architecture, so the generic fast class gives the same tokenizer."""
    if reader is None:
        import gguf

        reader = gguf.GGUFReader(str(gguf_path))
    # A tokenizer_config.json beside the file may name another class, which AutoTokenizer would take.
    by_model_type = model_type is not None and not (Path(gguf_path).parent / "tokenizer_config.json").exists()
    if field(reader, "general.architecture") in CONFIG_BUILT_HERE or (by_model_type and _has_generic_tokenizer(model_type)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def _has_generic_tokenizer(model_type: str) -> bool:
    """Whether AutoTokenizer builds a GGUF of this model type with the generic fast class (which
    transformers 5 also calls TokenizersBackend): no class of the type's own in its registry."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    return TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend", "PreTrainedTokenizerFast")


def load_gguf_tokenizer(gguf_path: Path, reader: Any | None = None, model_type: str | None = None,
                        **kwargs: Any) -> Any:
    """The tokenizer of the GGUF at ``gguf_path`` (``reader``: its reader, if open; ``model_type``:
    its config's, if read), as llama.cpp tokenizes; ``kwargs`` go to ``from_pretrained``."""
    import gguf

    reader = reader if reader is not None else gguf.GGUFReader(str(gguf_path))
    cls = gguf_tokenizer_class(gguf_path, reader, model_type)
    tokenizer = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, **kwargs)
    fix_gguf_tokenizer(tokenizer, reader)
    return tokenizer


# Token texts that end generation wherever they are in the vocabulary, as llama.cpp's
# llama_vocab::load marks its end-of-generation set by text (the end-of-turn markers of the chat
# formats it knows), and the texts it takes for fill-in-the-middle pad / repo / file-separator tokens
# (those end generation there too). llama.cpp takes the latter by text only where the file names no
# such id; here they count either way (a file naming one names that same token in the files seen).
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>",
    "</s>", "<eos>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
    "<|return|>", "<|call|>", "<|calls|>", "<|flush|>", "<turn|>", "<|tool_response>", "[e~[",
})
_FILL_IN_THE_MIDDLE_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})
# Roles whose id the file may name, each ending generation in llama.cpp.
_END_OF_GENERATION_ROLES = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def gguf_generation_ids(reader: Any) -> dict[str, Any]:
    """The generation config's bos/eos/pad ids from the file. The eos is a list when generation
    ends at more than one token: llama.cpp's end-of-generation set (the module docstring)."""
    ids: dict[str, Any] = {}
    for name, role in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = field(reader, f"tokenizer.ggml.{role}_token_id")
        if value is not None:
            ids[name] = int(value)
    ends = [int(v) for v in (field(reader, f"tokenizer.ggml.{role}_token_id") for role in _END_OF_GENERATION_ROLES)
            if v is not None]
    ends += _ends_by_text(field(reader, "tokenizer.ggml.tokens") or [])
    if len(set(ends)) > 1:
        ids["eos_token_id"] = list(dict.fromkeys(ends))
    return ids


def _ends_by_text(tokens: list[str]) -> list[int]:
    """The ids of the tokens llama.cpp ends generation at by their text, with its two exceptions: in
    a vocabulary that also has harmony's ``<|return|>`` and ``<|call|>`` (or ``<|calls|>`` and
    ``<|flush|>``), ``<|end|>`` only closes a message; beside ``<|tool_response>``, ``</s>`` is text."""
    found = {text: index for index, text in enumerate(tokens)
             if text in _END_OF_GENERATION_TEXTS or text in _FILL_IN_THE_MIDDLE_TEXTS}
    calls = "<|call|>" in found or "<|calls|>" in found
    if calls and ("<|return|>" in found or "<|flush|>" in found):
        found.pop("<|end|>", None)
    if "<|tool_response>" in found:
        found.pop("</s>", None)
    return sorted(found.values())


def fix_gguf_tokenizer(tokenizer: Any, reader: Any) -> None:
    """Set what transformers' reading of the file gets wrong (see the module docstring)."""
    tokenizer.clean_up_tokenization_spaces = False
    tokens = field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        return
    for attr, role in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        value = field(reader, f"tokenizer.ggml.{role}_token_id")
        if value is not None and 0 <= int(value) < len(tokens):
            setattr(tokenizer, attr, tokens[int(value)])
    if field(reader, "tokenizer.ggml.model") != "gpt2":
        return
    pre = field(reader, "tokenizer.ggml.pre")
    if pre in _WHOLE_PIECES_FIRST:
        tokenizer.backend_tokenizer.model.ignore_merges = True
    if pre in _BOS_BY_DEFAULT and field(reader, "tokenizer.ggml.add_bos_token") is None:
        tokenizer.add_bos_token = True
    if pre in _DIGITS_APART:
        from tokenizers import Regex, pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
