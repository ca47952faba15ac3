"""A pooling model's head in float32 by default, as vLLM 0.26 runs it (``models/layers/pooling_head.py``):
the classifier's weights keep the checkpoint's float32 values in a bf16 model and its logits are
float32 products of them; ``hf_overrides={"head_dtype": "model"}`` puts it back in the model's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tokenmill import LLM
from tokenmill.models.layers.pooling_head import head_dtype
from tokenmill.models.loader import load_model
from tokenmill.models.source import apply_hf_overrides, resolve_model


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_head_dtype_follows_vllms_rule():
    assert head_dtype(_Config(), torch.bfloat16) == torch.float32
    assert head_dtype(_Config(head_dtype="model"), torch.bfloat16) == torch.bfloat16
    assert head_dtype(_Config(head_dtype="float16"), torch.bfloat16) == torch.float16
    with pytest.raises(ValueError, match="head_dtype='int8' is not supported"):
        head_dtype(_Config(head_dtype="int8"), torch.bfloat16)


def _bf16_model(path, overrides=None):
    source = resolve_model(str(path))
    if overrides:
        source = apply_hf_overrides(source, overrides)
    return load_model(source, torch.bfloat16, torch.device("cpu"), "auto")


@pytest.mark.parametrize("fixture, head", [("tiny_qwen3_classifier_dir", "score"), ("tiny_bert_classifier_dir", "classifier")])
def test_a_bf16_classifier_keeps_a_float32_head(request, fixture, head):
    path = request.getfixturevalue(fixture)
    checkpoint = load_file(str(next(path.glob("*.safetensors"))))
    stored = next(t for name, t in checkpoint.items() if name.endswith(f"{head}.weight"))
    assert stored.dtype == torch.float32  # the tiny models are saved in float32
    model = _bf16_model(path)
    layer = getattr(model, head)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, stored)
    x = torch.randn(3, stored.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = layer(x)
    bias = layer.bias
    assert got.dtype == torch.float32
    assert torch.equal(got, F.linear(x.float(), stored, None if bias is None else bias.float()))
    in_model = getattr(_bf16_model(path, {"head_dtype": "model"}), head)
    assert in_model.weight.dtype == torch.bfloat16 and in_model(x).dtype == torch.bfloat16


def test_classify_scores_through_the_float32_head(tiny_qwen3_classifier_dir):
    """End to end in bf16: the float32 head's probabilities differ from the bf16 head's (the logits
    are not rounded to 8 bits), and each is the softmax of its own head's logits."""
    prompts = ["a short text", "another one, somewhat longer than the first"]
    fp32_head = LLM(str(tiny_qwen3_classifier_dir), dtype="bfloat16", device="cpu")
    bf16_head = LLM(str(tiny_qwen3_classifier_dir), dtype="bfloat16", device="cpu", hf_overrides={"head_dtype": "model"})
    ours = [o.outputs.probs for o in fp32_head.classify(prompts)]
    model_dtype = [o.outputs.probs for o in bf16_head.classify(prompts)]
    assert ours != model_dtype
    for probs in ours + model_dtype:
        assert abs(sum(probs) - 1.0) < 1e-5
