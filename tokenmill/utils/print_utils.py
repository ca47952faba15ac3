"""`print_embeddings`: how vLLM's pooling examples print a vector (its first four values and size)."""

from __future__ import annotations

from collections.abc import Sequence


def print_embeddings(embeds: Sequence[float], prefix: str = "Embeddings") -> None:
    shown = str(embeds[:4])[:-1] + ", ...]" if len(embeds) > 4 else embeds
    print(f"{prefix}: {shown} (size={len(embeds)})")
