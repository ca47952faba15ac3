"""vLLM's causal LM served as a classifier from a few tokens' logits (Qwen3-Reranker, mxbai-rerank-v2):
with ``hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "method": "from_2_way_softmax"}`` the score head is made, at load, from the LM head's
rows of those tokens. ``from_2_way_softmax``: one label, the second token's row minus the first's (its
sigmoid is the softmax over the two tokens' logits); ``no_post_processing``: one label per token, the
rows as they are. (vLLM's older ``is_original_qwen3_reranker: True`` means ``from_2_way_softmax``.)"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_tokens(config: Any) -> tuple[list[str], str] | None:
    """The config's (tokens, method), checked, with ``num_labels`` set to match; None when it has neither."""
    tokens = getattr(config, "classifier_from_token", None)
    method = getattr(config, "method", None)
    if method is None and getattr(config, "is_original_qwen3_reranker", False):
        method = "from_2_way_softmax"
    if tokens is None and method is None:
        return None
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"hf_overrides classifier_from_token={tokens!r} is invalid: must be a list of token strings")
    if method not in METHODS:
        raise ValueError(f"hf_overrides method={method!r} is invalid: must be one of {list(METHODS)}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"method='from_2_way_softmax' needs 2 classifier_from_token entries (false, true), got {tokens!r}")
    config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
    return list(tokens), method


def classifier_token_ids(tokens: list[str], tokenizer: Any) -> list[int]:
    """The tokens' ids in the model's vocabulary (token strings, as vLLM converts them: not text)."""
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the tokenizer to find its tokens; do not set skip_tokenizer_init")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token {unknown!r}: not tokens of this model's vocabulary")
    return ids


def with_score_weight(weights: Iterable[tuple[str, Any]], ids: list[int], method: str,
                      head_names: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors, then ``score.weight`` made from the rows ``ids`` of the first of
    ``head_names`` it holds (the LM head, or the embedding a tied head is)."""
    rows: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in head_names:
            rows[name] = torch.cat([tensor.narrow(0, i, 1).float().clone() for i in ids])
        yield name, tensor
    found = next((rows[name] for name in head_names if name in rows), None)
    if found is None:
        raise ValueError(f"classifier_from_token needs the LM head to make the score head; the checkpoint has none of "
                         f"{list(head_names)}")
    yield "score.weight", found[1:2] - found[0:1] if method == "from_2_way_softmax" else found
