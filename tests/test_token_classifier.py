"""vLLM's causal LM as a classifier from tokens' logits (``classifier_from_token`` + ``method`` through
hf_overrides, as for Qwen3-Reranker): the tiny Qwen3 causal LM's scores and probabilities against
transformers' causal LM, its logits of those tokens at the last position."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM

ENGINE = dict(dtype="float32", device="cpu", seed=0)
TOKENS = ["a", "Ġt", "e"]  # tokens of the tiny byte-level vocabulary


def _overrides(tokens: list[str], method: str) -> dict:
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens, "method": method}


def _hf_token_logits(path, ids: list[int], token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1, token_ids]


@pytest.mark.parametrize("method, tokens", [("from_2_way_softmax", TOKENS[:2]), ("no_post_processing", TOKENS)])
def test_scores_are_the_causal_lms_token_logits(tiny_qwen3_dir, random_sentences, method, tokens):
    llm = LLM(str(tiny_qwen3_dir), hf_overrides=_overrides(tokens, method), **ENGINE)
    token_ids = llm.get_tokenizer().convert_tokens_to_ids(tokens)
    texts = random_sentences(4, seed=9)
    outputs = llm.classify(texts, use_tqdm=False)
    for out in outputs:
        logits = _hf_token_logits(tiny_qwen3_dir, out.prompt_token_ids, token_ids)
        # 2-way: softmax over the two tokens = sigmoid(true - false); else a softmax over every token.
        expected = logits.softmax(-1)[1:] if method == "from_2_way_softmax" else logits.softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=0, atol=1e-5)
    if method == "from_2_way_softmax":  # a reranker: score() on pairs, the same number
        pair = llm.score(texts[0], texts[1], use_tqdm=False)[0]
        logits = _hf_token_logits(tiny_qwen3_dir, pair.prompt_token_ids, token_ids)
        assert pair.outputs.score == pytest.approx(float(logits.softmax(-1)[1]), abs=1e-5)
    assert torch.tensor([o.outputs.probs for o in outputs]).std(0).max() > 1e-3


@pytest.mark.parametrize("overrides, message", [
    (_overrides(["a"], "from_2_way_softmax"), "needs 2 classifier_from_token"),
    (_overrides(["a", "b"], "logit_diff"), "method='logit_diff' is invalid"),
    (_overrides(["a", "no-such-token"], "from_2_way_softmax"), "no-such-token"),
])
def test_bad_settings_are_refused_by_name(tiny_qwen3_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen3_dir), hf_overrides=overrides, **ENGINE)


def test_a_score_job_with_hf_overrides_on_the_command_line(tiny_qwen3_dir, random_sentences, tmp_path):
    """`tokenmill run --task score --hf-overrides JSON` (vLLM's flag) scores each row as LLM.score does
    with the same overrides; a value that is not a JSON object is a usage error."""
    import json

    from tokenmill.cli import main

    overrides = _overrides(TOKENS[:2], "from_2_way_softmax")
    first, second = random_sentences(3, seed=11), random_sentences(3, seed=12)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text_1": a, "text_2": b}) + "\n" for a, b in zip(first, second)))
    out = tmp_path / "out.jsonl"
    flags = ["--task", "score", "--model", str(tiny_qwen3_dir), "--dtype", "float32", "--device", "cpu", "--no-progress"]
    assert main(["run", str(source), "-o", str(out), *flags, "--hf-overrides", json.dumps(overrides)]) == 0
    records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["row"])
    expected = LLM(str(tiny_qwen3_dir), hf_overrides=overrides, **ENGINE).score(first, second, use_tqdm=False)
    assert [r["score"] for r in records] == pytest.approx([o.outputs.score for o in expected], abs=1e-6)
    with pytest.raises(SystemExit):
        main(["run", str(source), "-o", str(tmp_path / "o2.jsonl"), *flags, "--hf-overrides", "[1, 2]"])
