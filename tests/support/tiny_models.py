"""Tiny Hugging Face models and tokenizers for the tests: random weights, real file layouts.

The models are random but *not* HF's default init: every weight, bias and norm scale is redrawn
so that a wrong name mapping, a skipped bias or a norm left at 1 changes the logits. The fixtures
in tests/conftest.py save them once per session; tests that need a variant (another config, a
quantized copy) build it with these functions.
"""

from __future__ import annotations

from pathlib import Path

import torch

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
MAX_POS = 256

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few byte-level BPE merges (Ġ is the byte-level space) so words are not all single bytes.
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "w"), ("i", "s"), ("Ġ", "o"), ("e", "s"),
    ("Ġ", "c"), ("i", "t"), ("a", "n"), ("Ġ", "i"), ("Ġw", "h"), ("in", "g"), ("Ġ", "b"), ("Ġ", "f"),
    ("e", "d"), ("Ġ", "p"), ("a", "r"), ("Ġ", "m"), ("o", "u"), ("l", "l"),
]


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (any text round-trips) with ChatML special tokens and template.

    ids: 0 <|endoftext|> (bos, pad), 1 <|im_start|>, 2 <|im_end|> (eos), then 256 bytes, then merges:
    289 tokens, an odd size on purpose (it exercises vocabulary padding under tensor parallel).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


TINY_VOCAB = len(SPECIAL_TOKENS) + 256 + len(_MERGES)


def tiny_config_kwargs(**overrides) -> dict:
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    kwargs.update(overrides)
    return kwargs


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.1 * noise)


def save_tiny_model(root: Path, name: str, config, seed: int, max_shard_size: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    out = root / name
    if max_shard_size is None:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    build_tiny_tokenizer().save_pretrained(out)
    return out


# --- pooling models: tiny BERT encoders (WordPiece tokenizer) -----------------------------------

BERT_WORDS = (
    "the a an cat cats dog dogs sat on mat warm sun wind river tea cup book read reading write city "
    "night day blue red green is are was very small large quick brown fox jumps over lazy and or not"
).split()
_BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tiny_bert_tokenizer():
    """A lower-casing WordPiece tokenizer: whole words, single characters and ## continuations, so any
    ASCII text tokenizes (other scripts become [UNK]); pairs get [SEP] and segment ids like BERT's."""
    from transformers import BertTokenizer

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;")
    vocab = [*_BERT_SPECIAL, *chars, *(f"##{c}" for c in chars), *BERT_WORDS]
    return BertTokenizer(vocab={tok: i for i, tok in enumerate(dict.fromkeys(vocab))})


def tiny_bert_config(**overrides):
    from transformers import BertConfig

    tok = build_tiny_bert_tokenizer()
    kwargs = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)
    kwargs.update(overrides)
    return BertConfig(**kwargs)


def randomize_bert_weights(model: torch.nn.Module, seed: int) -> None:
    """Every weight redrawn: LayerNorm scales near 1 with random shifts, embeddings and linears random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif "embeddings" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.2 * noise)


def save_tiny_bert(root: Path, name: str, model_cls_name: str, config, seed: int) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config)
    randomize_bert_weights(model, seed)
    out = root / name
    model.save_pretrained(out)
    build_tiny_bert_tokenizer().save_pretrained(out)
    return out


def save_tiny_bert_embedder(root: Path, name: str, seed: int) -> Path:
    """A sentence-transformers folder around a tiny BertModel: CLS pooling, no Normalize module."""
    import json

    out = save_tiny_bert(root, name, "BertModel", tiny_bert_config(), seed=seed)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    return out


def save_redrawn_bf16_model(folder: Path | str, config, seed: int = 0, matrix_std: float = 0.08,
                            vector_std: float = 0.3) -> str:
    """A model of ``config`` with every weight redrawn (matrices N(0, matrix_std), vectors
    1 + N(0, vector_std): logits peaked enough for bf16 greedy paths to agree for a while), saved in
    bf16 to ``folder``: the GPU tests' models."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, matrix_std if param.dim() > 1 else vector_std).add_(1.0 if param.dim() == 1 else 0.0)
    model.to(torch.bfloat16).save_pretrained(folder)
    return str(folder)
