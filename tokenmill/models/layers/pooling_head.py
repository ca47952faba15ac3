"""The head of a pooling model in float32, as vLLM 0.26 runs it: a classifier's last Linear layers
(a decoder's ``score``, BERT's pooler dense and ``classifier``, RoBERTa's classification head, a token
classifier's ``classifier``) and the pooled states an embedding is made from.

A bf16 head rounds each logit to 8 bits of mantissa (~0.4%), and a bf16 mean of a sequence's states
rounds the embedding the same way; vLLM keeps both in float32 unless the config says otherwise
(``hf_overrides={"head_dtype": "model"}``, or a dtype's name), and so do we, so that scores and
embeddings match what a vLLM user had. A head is at most a hidden x hidden dense and a hidden x
labels layer, run on one row a sequence (or a token): float32 costs next to nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.models.layers.linear import ColumnParallelLinear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


def head_dtype(config: "PretrainedConfig", model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a pooling model's head: the config's ``head_dtype`` ("model": ``model_dtype``; or a
    dtype's name), float32 when it has none (vLLM's rule)."""
    wanted = getattr(config, "head_dtype", None)
    if wanted is None:
        return torch.float32
    if wanted == "model":
        return model_dtype
    if isinstance(wanted, torch.dtype):
        return wanted
    if not isinstance(wanted, str) or wanted.lower() not in _DTYPES:
        raise ValueError(f"head_dtype={wanted!r} is not supported; supported: 'model', {sorted(_DTYPES)}")
    return _DTYPES[wanted.lower()]


class HeadLinear(ColumnParallelLinear):
    """A replicated Linear layer of a pooling head: parameters in ``dtype``, its input cast to it."""

    def __init__(self, input_size: int, output_size: int, bias: bool, config: "PretrainedConfig"):
        """Built as the model is: its dtype (the default dtype then) is what ``"model"`` means."""
        super().__init__(input_size, output_size, bias)
        dtype = head_dtype(config, torch.get_default_dtype())
        for param in self.parameters():  # still unfilled: the loader copies the checkpoint's values in
            param.data = param.data.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))
