"""Poolers: how the hidden states of a whole prompt become one vector, and what is done to it after.

The runner hands over the hidden states of a flat batch (the tokens of every sequence side by
side, no padding) with each sequence's start and length. A pooling type picks or averages rows:

    CLS   the first token (BERT's [CLS])
    LAST  the last token (decoder embedders and classifiers: it has seen the whole prompt)
    MEAN  the average over the sequence's tokens (sentence-transformers' mean pooling)

Then per request: an embedding is cut to ``dimensions`` (Matryoshka) and L2-normalised; a
classifier's logits go through its activation (softmax over labels, or sigmoid for one label).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.pooling.config import POOLING_TYPES, Activation


def pool(hidden: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [T, H] of a flat batch; starts and lens [B] (integers on hidden's device) -> [B, H]
    (CLS, LAST: rows of hidden; MEAN: float32). Nothing here waits for the device (the lengths stay there)."""
    if pooling_type == "CLS":
        return hidden[starts]
    if pooling_type == "LAST":
        return hidden[starts + lens - 1]
    if pooling_type == "MEAN":
        # Sum each sequence's rows in fp32 (index_add over a per-token sequence id), then divide; the
        # mean stays fp32 (the head decides its dtype: models/layers/pooling_head.py).
        seq_of_token = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens, output_size=hidden.shape[0])
        sums = torch.zeros(len(lens), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_of_token, hidden.float())
        return sums / lens[:, None].float()
    raise ValueError(f"pooling_type={pooling_type!r} is not supported; supported: {POOLING_TYPES}")


def finish_embeddings(x: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation to the first ``dimensions`` features, then L2 normalisation (in fp32)."""
    x = x.float()
    if dimensions is not None:
        x = x[..., :dimensions]
    return F.normalize(x, p=2, dim=-1) if normalize else x


def activate(logits: torch.Tensor, activation: Activation) -> torch.Tensor:
    logits = logits.float()
    if activation == "softmax":
        return logits.softmax(dim=-1)
    if activation == "sigmoid":
        return logits.sigmoid()
    return logits
