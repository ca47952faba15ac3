"""How long a sequence (prompt and output) may be for a model: ``LLM(max_model_len=...)``.

The model's positions bound it, as a linear or YaRN rope scaling stretches them (vLLM's rule).
Two attention features tokenmill does not implement bound it further, to where its outputs stay
the model's own: a sliding window (every token here attends
to the whole sequence, which is the same thing up to the window) and LongRoPE's long-context
factors (which transformers and vLLM switch on past original_max_position_embeddings, depending on
the batch). Left unset, max_model_len stops at those lengths; asked for beyond them, the window is
taken with a warning (or refused with ``disable_sliding_window=True``, vLLM's full-attention switch
that caps at the window) and LongRoPE is refused.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def resolve_max_model_len(asked: int | None, disable_sliding_window: bool, hf_config: Any) -> int:
    """The max_model_len an engine runs with (``asked``: the user's, None for the default)."""
    limit = model_max_len(hf_config)
    max_model_len = asked or limit
    if max_model_len > limit:
        stretched = limit != _model_positions(hf_config)
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model's max_position_embeddings ({limit}"
            f"{', as its rope scaling stretches them' if stretched else ''}); use max_model_len <= {limit}"
        )
    max_model_len = _window_limited(max_model_len, asked, disable_sliding_window, hf_config)
    return _longrope_limited(max_model_len, asked, hf_config)


# RoBERTa's positions start after its padding id (models/roberta.py): its table's first rows are never a token's.
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta", "camembert")


def model_max_len(hf_config: Any) -> int:
    from tokenmill.models.layers.rotary import rope_scaled_len

    return rope_scaled_len(hf_config, _model_positions(hf_config))


def _model_positions(hf_config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            if getattr(hf_config, "model_type", None) in _POSITIONS_AFTER_PADDING:
                value -= int(getattr(hf_config, "pad_token_id", 1) or 0) + 1
            return value
    return 2048


def model_sliding_window(hf_config: Any) -> int | None:
    """The model's attention window, if it has one (Qwen2's configs carry a window they use only
    with use_sliding_window=True)."""
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    return None if getattr(hf_config, "use_sliding_window", True) is False else window


def _window_limited(max_model_len: int, asked: int | None, disable_sliding_window: bool, hf_config: Any) -> int:
    window = model_sliding_window(hf_config)
    if window is None or max_model_len <= window:
        return max_model_len
    if asked is None:
        logger.info("the model attends within a sliding window of %d tokens, which tokenmill does not implement: "
                    "max_model_len=%d keeps its outputs exact (a larger max_model_len attends fully past it)",
                    window, window)
        return window
    if disable_sliding_window:
        raise ValueError(f"max_model_len={asked} is larger than the model's sliding_window ({window}), which "
                         f"disable_sliding_window=True caps it at; use max_model_len <= {window}")
    logger.warning("the model attends within a sliding window of %d tokens, which tokenmill does not implement: with "
                   "max_model_len=%d, tokens past position %d attend to the whole sequence and their outputs differ from "
                   "the model's (max_model_len <= %d is exact)", window, max_model_len, window, window)
    return max_model_len


def _longrope_limited(max_model_len: int, asked: int | None, hf_config: Any) -> int:
    from tokenmill.models.layers.rotary import longrope_limit

    limit = longrope_limit(hf_config)
    if limit is None or max_model_len <= limit:
        return max_model_len
    if asked is not None:
        raise ValueError(
            f"max_model_len={asked} is past the model's original_max_position_embeddings ({limit}): its "
            f"LongRoPE switches to long-context factors there, which tokenmill does not implement; use max_model_len <= {limit}"
        )
    logger.info("LongRoPE model: max_model_len=%d (its original_max_position_embeddings, past which its long-context "
                "factors are not implemented)", limit)
    return limit
