"""Pooling models on a CUDA GPU against Hugging Face transformers on the same GPU: a BERT
classifier (fp32, tight) and a Qwen3 classifier in bf16 (the engine's GPU default) against fp32."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM
from tokenmill.pooling.engine import PoolingEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _hf_probs(path, texts: list[str], pair: bool = False) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    with torch.no_grad():
        for text in texts:
            enc = {k: v.cuda() for k, v in tok(text, return_tensors="pt").items()}
            rows.append(hf(**enc).logits[0].float().softmax(-1))
    return torch.stack(rows).cpu()


def test_bert_classifier_on_gpu(tiny_bert_classifier_dir, random_sentences):
    llm = LLM(str(tiny_bert_classifier_dir), dtype="float32", gpu_memory_utilization=0.3, seed=0)
    assert isinstance(llm.llm_engine, PoolingEngine)
    texts = random_sentences(40, seed=21, high=40)
    got = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    torch.testing.assert_close(got, _hf_probs(tiny_bert_classifier_dir, texts), rtol=0, atol=1e-4)


def test_qwen3_classifier_on_gpu_bf16(tiny_qwen3_classifier_dir, random_sentences):
    llm = LLM(str(tiny_qwen3_classifier_dir), gpu_memory_utilization=0.3, seed=0)
    assert llm.llm_engine.config.dtype == torch.bfloat16
    texts = random_sentences(40, seed=22, high=60)
    got = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    torch.testing.assert_close(got, _hf_probs(tiny_qwen3_classifier_dir, texts), rtol=0, atol=3e-2)
