"""The sampled tokens' logprobs without a [rows, V] table on the GPU: the two-pass kernel
(kernels/triton/token_logprobs.py) against ``reference.token_logprobs_ref`` (log_softmax over the
whole row) on 16-bit and fp32 logits; the sampler's whole path (``sampler.kernel_logprobs``: the
kernel, and topk of the logits for k >= 2) against its table path, ties included; and in the
engine, where a step with raw logprobs and nothing written into its logits takes that path (and
prompt logprobs: perplexity, evaluations), against the same engine with ``kernel_logprobs``
swapped for the table path (``with_logprobs`` over ``log_softmax``): the same tokens, each
token's logprob and rank, and the top k. Which of exactly equal logprobs come first (or are kept
at the k-th place) is neither path's promise, so no check here depends on it
(tests/support/logprob_cases.py)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("rows", [1, 37, 1024])
@pytest.mark.parametrize("vocab", [151936, 32000, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_match_log_softmax(rows, vocab, dtype):
    from tokenmill.kernels.reference import token_logprobs_ref
    from tokenmill.kernels.triton.token_logprobs import token_logprobs

    gen = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).cuda()
    tokens = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    tokens[0] = int(logits[0].float().argmax())
    for top in (False, True):
        got = token_logprobs(logits, tokens, top)
        want = token_logprobs_ref(logits, tokens, top)
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
        # 16-bit logits: distinct values stay distinct after the shift, so the counts are exact; fp32
        # ones may differ where two logprobs round apart in one computation and together in the other.
        if dtype == torch.float32:
            assert (got[1] - want[1]).abs().max() <= 1
        else:
            assert torch.equal(got[1], want[1])
        assert got[1][0] == 1
        if top:
            assert torch.equal(got[2], want[2])
            torch.testing.assert_close(got[3], want[3], atol=1e-4, rtol=1e-5)
        # The row's max is one of its logits (exact); its log-normaliser to float32 rounding.
        assert torch.equal(got.row_max, want[4])
        torch.testing.assert_close(got.log_sum, want[5], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [0, 1, 2, 5, 20])
@pytest.mark.parametrize("vocab", [151936, 32000, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_logprobs_match_the_table(k, vocab, dtype):
    from support.logprob_cases import assert_matches_table, tied_logprob_rows
    from tokenmill.worker.sampler import kernel_logprobs

    tied, tied_tokens = tied_logprob_rows(vocab, k, dtype, seed=vocab + k)
    gen = torch.Generator().manual_seed(vocab * 7 + k)
    spread = (torch.randn(250, vocab, generator=gen) * 4).to(dtype)  # 256 rows in all
    logits = torch.cat([tied, spread]).cuda()
    tokens = torch.cat([tied_tokens, torch.randint(0, vocab, (250,), generator=gen)]).cuda()
    got = kernel_logprobs(logits, tokens, k)
    assert_matches_table(got, logits, k, rank_slack=1 if dtype == torch.float32 else 0, atol=1e-4)


@pytest.fixture(scope="module")
def small_llm(tmp_path_factory):
    from transformers import Qwen3Config

    from support.tiny_models import save_redrawn_bf16_model

    config = Qwen3Config(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = save_redrawn_bf16_model(tmp_path_factory.mktemp("token_logprobs"), config)
    return LLM(model, skip_tokenizer_init=True, max_model_len=512, gpu_memory_utilization=0.2, seed=0)


KS = (0, 1, 2, 5, 20)


def _runs(llm: LLM, monkeypatch: pytest.MonkeyPatch, prompts: list, params_of) -> tuple[dict, dict]:
    """Each k's outputs without the table (the calls seen, to be sure that path ran) and with
    ``kernel_logprobs`` swapped for the table path, in the sampler and in prompt logprobs."""
    from tokenmill.worker import prompt_logprobs, sampler

    real, seen = sampler.kernel_logprobs, []

    def spied(logits, token_ids, k):
        seen.append(k)
        return real(logits, token_ids, k)

    def table(logits, token_ids, k):
        seen.append(-1 - k)
        return sampler.with_logprobs(token_ids, torch.log_softmax(logits.float(), dim=-1), k)

    runs = []
    for swapped in (spied, table):
        for module in (sampler, prompt_logprobs):
            monkeypatch.setattr(module, "kernel_logprobs", swapped)
        runs.append({k: llm.generate(prompts, params_of(k), use_tqdm=False) for k in KS})
        assert set(seen) == ({*KS} if swapped is spied else {-1 - k for k in KS}), seen
        seen.clear()
    monkeypatch.undo()
    return runs[0], runs[1]


def _same_position(got: dict, want: dict, token: int, k: int) -> None:
    """One position's logprob dicts (the token's entry, then the top k: vLLM's dict holds k + 1
    entries, or k when the token is one of the top ones) from the two paths."""
    assert abs(got[token].logprob - want[token].logprob) < 1e-4 and got[token].rank == want[token].rank
    tops = []
    for lp in (got, want):
        entries = sorted(((e.logprob, t) for t, e in lp.items() if len(lp) == k or t != token), reverse=True)
        assert len(entries) == k, lp
        tops.append(entries)
    for (a, _), (b, _) in zip(*tops):  # place by place: equal values read alike in either order
        assert abs(a - b) < 1e-4, tops
    for t in got.keys() & want.keys():  # and each id listed by both with one logprob
        assert abs(got[t].logprob - want[t].logprob) < 1e-4, (t, tops)
    if k:
        kth = tops[1][-1][0]
        above = {t for value, t in tops[1] if value > kth}  # the table path's strictly above its k-th
        assert above <= {t for _, t in tops[0]}, tops


def test_engine_logprobs_agree_with_the_table(small_llm, monkeypatch):
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 31000 for j in range(5 + i % 9)]} for i in range(48)]
    kernel, table = _runs(small_llm, monkeypatch, prompts, lambda k: SamplingParams(
        temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=k))
    for k in KS:
        for got, want in zip(kernel[k], table[k]):
            ids = want.outputs[0].token_ids
            assert got.outputs[0].token_ids == ids and len(got.outputs[0].logprobs) == len(ids) == 12
            for token, lp_got, lp_want in zip(ids, got.outputs[0].logprobs, want.outputs[0].logprobs):
                _same_position(lp_got, lp_want, token, k)


def test_engine_prompt_logprobs_agree_with_the_table(small_llm, monkeypatch):
    prompts = [{"prompt_token_ids": [3 + (11 * i + 5 * j) % 31000 for j in range(40 + i)]} for i in range(6)]
    kernel, table = _runs(small_llm, monkeypatch, prompts, lambda k: SamplingParams(
        max_tokens=1, detokenize=False, prompt_logprobs=k))
    for k in KS:
        for got, want in zip(kernel[k], table[k]):
            ids = want.prompt_token_ids
            assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(ids)
            for position in range(1, len(ids)):
                _same_position(got.prompt_logprobs[position], want.prompt_logprobs[position], ids[position], k)
