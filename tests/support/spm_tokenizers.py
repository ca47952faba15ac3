"""Tiny SentencePiece-style tokenizers, laid out as Llama-2 / Mistral / Phi-3 tokenizer.json files are.

Those families' files are SentencePiece models converted to `tokenizers` (transformers'
convert_slow_tokenizer.py, LlamaConverter): BPE with ``byte_fallback`` (a character outside the
vocabulary is spelled as ``<0xE2>``-style byte tokens), "▁" for spaces, and the decoder sequence
Replace("▁" -> " "), ByteFallback, Fuse, Strip(one leading space). Two layouts exist:

- ``legacy``: Llama-2, TinyLlama, Mistral v0.1: a normalizer (Prepend "▁", Replace " " -> "▁"), no
  pre-tokenizer;
- ``metaspace``: Mistral v0.3 and what transformers 5's LlamaTokenizer builds when it loads either
  layout (no normalizer; Metaspace pre-tokenizer, prepend_scheme "first", split False).

The vocabulary is trained here on a few sentences (a small deterministic BPE: the most frequent pair
first, ties by the pair's text), so accents and a few CJK characters are whole tokens and emoji and
other CJK characters go through byte fallback. Added tokens as Phi-3 / Mistral have them: <unk>,
<s>, </s> (special, not normalized), <|user|> and <|end|> (special, rstrip), <tool> (not special)
and "foo bar" (not special, normalized: matched after the "▁" replacement).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

CORPUS = [
    "The café serves crème brûlée and naïve piñatas.", "東京の天気は晴れです。今日は良い日。",
    "Hello world, hello there! Numbers 12345 and symbols {} [] ().", "Ça va? Él está aquí. Über straße.",
    "def f(x):\n    return x * 2  # double", "I like tea and coffee; the end.",
]
NUM_MERGES = 150
SPACE = "\u2581"  # "▁"


def _train_merges(corpus: list[str], alphabet: set[str], num_merges: int) -> list[tuple[str, str]]:
    """BPE merges over the corpus's "▁"-prefixed words, deterministic (the tokenizers trainer breaks
    ties by hash order, so its vocabulary changes between runs)."""
    words = Counter(SPACE + w for line in corpus for w in line.replace("\n", " \n ").split(" ") if w)
    split = {w: [c for c in w] for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            parts = split[word]
            for a, b in zip(parts, parts[1:]):
                if a in alphabet or len(a) > 1:
                    if b in alphabet or len(b) > 1:
                        pairs[(a, b)] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for word, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    out.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[word] = out
    return merges


def build_spm_tokenizer(layout: str = "metaspace") -> Any:
    """A PreTrainedTokenizerFast with the family's tokenizer.json structure (see the module doc).

    ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos), 3..258 the bytes <0x00>..<0xFF>, then the alphabet and
    the merges, then the added tokens <|user|>, <|end|>, <tool>, "foo bar"."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if layout not in ("legacy", "metaspace"):
        raise ValueError(f"layout is 'legacy' or 'metaspace', got {layout!r}")
    counts = Counter(c for line in CORPUS for c in line)
    # Characters seen at least twice are in the vocabulary; the rest (and any emoji) are byte tokens.
    alphabet = {c for c, n in counts.items() if n >= 2 and c not in " \n"} | {SPACE}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in sorted(alphabet):
        vocab.setdefault(c, len(vocab))
    merges = _train_merges(CORPUS, alphabet, NUM_MERGES)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if layout == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=True) for t in ("<|user|>", "<|end|>")])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False),
                    AddedToken("foo bar", special=False, normalized=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
