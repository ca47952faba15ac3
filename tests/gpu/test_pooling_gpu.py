"""Pooling models on a CUDA GPU against Hugging Face transformers on the same GPU: a BERT
classifier (fp32, tight) and a Qwen3 classifier in bf16 (the engine's GPU default) against fp32,
token classifiers (BERT, XLM-R in fp32; Qwen3 in bf16), embedders."""

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


# ---- token classifiers (NER): encode(pooling_task="token_classify"), a row per prompt token


def _hf_token_logits(path, texts: list[str]) -> list[torch.Tensor]:
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    hf = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [hf(**{k: v.cuda() for k, v in tok(text, return_tensors="pt").items()}).logits[0].float().cpu() for text in texts]


@pytest.mark.parametrize("kind", ["bert", "xlmr"])
def test_encoder_token_classifier_on_gpu(kind, tmp_path_factory, random_sentences):
    """BERT / XLM-R token classifiers in fp32 on the packed GPU path (varlen kernel, asynchronous
    steps), against transformers on the same GPU (the CPU twin: tests/test_for_token_classification.py)."""
    from support.tiny_token_classifiers import save_bert_token_classifier, save_xlmr_token_classifier

    root = tmp_path_factory.mktemp("ner")
    folder = save_bert_token_classifier(root, seed=31) if kind == "bert" else save_xlmr_token_classifier(root, seed=32)
    llm = LLM(str(folder), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=256)
    assert llm.llm_engine.config.async_scheduling
    texts = random_sentences(40, seed=25, high=60)
    outputs = llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
    for out, logits in zip(outputs, _hf_token_logits(folder, texts)):
        assert out.outputs.data.shape == logits.shape
        torch.testing.assert_close(out.outputs.data, logits.softmax(-1), rtol=0, atol=1e-4)


def test_qwen3_token_classifier_on_gpu_bf16(tmp_path_factory, random_sentences):
    """Qwen3ForTokenClassification in bf16 (the engine's GPU default) against transformers' fp32:
    per-token probabilities and, with use_activation=False, logits."""
    from support.tiny_token_classifiers import save_decoder_token_classifier
    from tokenmill import PoolingParams

    folder = save_decoder_token_classifier(tmp_path_factory.mktemp("ner"), "qwen3", seed=36)
    llm = LLM(str(folder), gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=512)
    assert llm.llm_engine.config.dtype == torch.bfloat16
    texts = random_sentences(40, seed=26, high=60)
    probs = llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
    raw = llm.encode(texts, PoolingParams(use_activation=False), pooling_task="token_classify", use_tqdm=False)
    for out, out_raw, logits in zip(probs, raw, _hf_token_logits(folder, texts)):
        torch.testing.assert_close(out.outputs.data, logits.softmax(-1), rtol=0, atol=3e-2)
        torch.testing.assert_close(out_raw.outputs.data, logits, rtol=0, atol=1e-1)


# ---- the packed GPU path: varlen attention, fused LayerNorm, one copy each way, steps in flight


def test_bert_embedder_on_gpu_matches_sentence_transformers(tiny_bert_embedder_dir, random_sentences):
    """CLS embeddings through the varlen kernel (bidirectional, head_dim 8 padded to 16) and the
    fused add+LayerNorm, with asynchronous steps, against sentence-transformers on the same GPU."""
    from sentence_transformers import SentenceTransformer

    llm = LLM(str(tiny_bert_embedder_dir), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=256)
    assert llm.llm_engine.config.async_scheduling
    texts = random_sentences(60, seed=23, high=45)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    expected = SentenceTransformer(str(tiny_bert_embedder_dir), device="cuda").encode(texts, convert_to_tensor=True).float().cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)



def test_encode_outputs_are_not_pinned(tiny_bert_embedder_dir, random_sentences):
    """`encode` hands out tensors that a caller may keep for the rest of the process: they lie in
    pageable memory, not in the step's pinned buffer (which the next steps reuse), and hold what
    `embed` returns for the same texts."""
    llm = LLM(str(tiny_bert_embedder_dir), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=256)
    texts = random_sentences(30, seed=25, high=45)  # several steps at 256 tokens
    for task in ("embed", "token_embed"):
        outputs = llm.encode(texts, pooling_task=task, use_tqdm=False)
        assert not any(o.outputs.data.is_pinned() for o in outputs), task
    embedded = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    encoded = torch.stack([o.outputs.data for o in llm.encode(texts, pooling_task="embed", use_tqdm=False)])
    torch.testing.assert_close(encoded, embedded, rtol=0, atol=0)

def test_xlmr_embedder_on_gpu_matches_sentence_transformers(tmp_path_factory, random_sentences):
    """XLM-RoBERTa (positions after the padding id, mean pooling, normalised) on the packed GPU path,
    against sentence-transformers on the same GPU (the CPU twin: tests/test_roberta.py)."""
    from sentence_transformers import SentenceTransformer

    from test_roberta import save_xlmr_embedder

    folder = save_xlmr_embedder(tmp_path_factory.mktemp("xlmr"))
    llm = LLM(str(folder), dtype="float32", gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=256)
    texts = random_sentences(60, seed=24, high=60)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    expected = SentenceTransformer(str(folder), device="cuda").encode(texts, convert_to_tensor=True).float().cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_qwen3_embedder_on_gpu_bf16(tiny_qwen3_dir, random_sentences):
    """Last-token embeddings of a decoder (causal varlen kernel after the fused qkv prologue) in
    bf16 against transformers' fp32 hidden states."""
    from transformers import AutoModel, AutoTokenizer

    llm = LLM(str(tiny_qwen3_dir), runner="pooling", gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=512)
    texts = random_sentences(50, seed=24, high=60)  # at most 218 tokens: the tiny model has 256 positions
    outputs = llm.embed(texts, use_tqdm=False)
    hf = AutoModel.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    with torch.no_grad():
        for text, out in zip(texts, outputs):
            ids = tok(text, return_tensors="pt")["input_ids"].cuda()
            expected = torch.nn.functional.normalize(hf(input_ids=ids).last_hidden_state[0, -1].float(), dim=0).cpu()
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=0, atol=3e-2)


def _kernel_variants() -> dict[str, int]:
    """How many compiled variants each pooling-path Triton kernel holds (Triton's own caches)."""
    from tokenmill.kernels.triton import activation, layernorm, qkv_prologue, rmsnorm, varlen_attention

    kernels = {
        "varlen": varlen_attention._varlen_attention_kernel, "layernorm": layernorm._layer_norm_kernel,
        "rmsnorm": rmsnorm._rms_norm_kernel, "silu": activation._silu_and_mul_kernel, "qkv": qkv_prologue._qkv_prologue_kernel,
    }
    counts = {}
    for name, kernel in kernels.items():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


@pytest.mark.parametrize("model", ["bert", "qwen3"])
def test_steps_never_sync_and_compile_nothing_after_warm_up(model, tiny_bert_embedder_dir, tiny_qwen3_dir):
    """After one warm-up call, steps of other sizes (odd and even token counts, any alignment of
    the packed segments) launch without a host sync and compile no new kernel variant."""
    path = tiny_bert_embedder_dir if model == "bert" else tiny_qwen3_dir
    llm = LLM(str(path), runner="pooling", gpu_memory_utilization=0.3, seed=0, max_num_batched_tokens=512)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(5)
    vocab = engine.config.vocab_size  # 133 for the tiny BERT, 289 for the tiny Qwen3
    prompts = [{"prompt_token_ids": torch.randint(5, vocab, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 48, (80,), generator=gen)]
    llm.embed(prompts[:4], use_tqdm=False)  # warm-up: compiles
    torch.cuda.synchronize()
    before = _kernel_variants()
    for i, prompt in enumerate(prompts[4:]):
        engine.add_request(f"s{i}", prompt, None)
    launched = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        while batch := engine._next_batch():
            launched.append((batch, engine.runner.launch(batch)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(launched) > 3, "expected several steps of different sizes"
    done = [o for step in launched for o in engine._finish(step)]
    assert len(done) == len(prompts) - 4 and not engine.has_unfinished_requests()
    assert _kernel_variants() == before, "a step compiled a new kernel variant"
