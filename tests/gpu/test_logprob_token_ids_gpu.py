"""logprob_token_ids on a CUDA GPU: the listed ids' logprobs against Hugging Face in fp32 on the
same GPU, HF bf16 the yardstick of bf16 noise (decode steps replayed from CUDA graphs, rows with
and without lists in one batch), async scheduling against synchronous steps in fp32, and the
device state's gather under CUDA's sync check (no host sync: the ids stay on the device, new rows
arrive in one pinned copy)."""

from __future__ import annotations

import random

import pytest
import torch

from support.hf_reference import bf16_slack, hf_logprobs
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # before fixtures build models

VOCAB = 1024


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from transformers import Qwen3Config

    from support.tiny_models import save_redrawn_bf16_model

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)
    return save_redrawn_bf16_model(tmp_path_factory.mktemp("qwen3_logprob_ids"), config)


def _inputs(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 9, 40, 300]))]} for _ in range(count)]


def _mixed(count: int) -> list[SamplingParams]:
    rng = random.Random(1)
    base = dict(max_tokens=6, ignore_eos=True, detokenize=False)
    kinds = [
        lambda: SamplingParams(temperature=0.0, logprob_token_ids=rng.sample(range(VOCAB), 5), **base),
        lambda: SamplingParams(temperature=0.0, logprobs=4, **base),
        lambda: SamplingParams(temperature=0.8, seed=rng.randrange(100), repetition_penalty=1.2, **base),
        lambda: SamplingParams(temperature=0.9, seed=rng.randrange(100), n=2, logprob_token_ids=rng.sample(range(VOCAB), 128),
                               **base),
    ]
    return [kinds[i % len(kinds)]() for i in range(count)]


def test_listed_logprobs_match_hf_on_gpu(model_path):
    """bf16: each listed id's logprob against HF fp32 on the same prefix, within the bf16 slack that
    HF's own bf16 forward sets on the same ids (support/hf_reference.py), and its rank exact."""
    llm = LLM(model_path, skip_tokenizer_init=True, max_model_len=1024, gpu_memory_utilization=0.3)
    inputs, params = _inputs(12, seed=3), _mixed(12)
    outputs = llm.generate(inputs, params, use_tqdm=False)
    errors, noises = [], []
    for prompt, p, out in zip(inputs, params, outputs):
        for completion in out.outputs:
            if not p.logprob_token_ids:
                assert p.logprobs is None or all(len(e) <= p.logprobs + 1 for e in completion.logprobs)
                continue
            ids = list(prompt["prompt_token_ids"])
            for token, entry in zip(completion.token_ids, completion.logprobs):
                truth, bf16 = (hf_logprobs(model_path, dtype, ids) for dtype in (torch.float32, torch.bfloat16))
                assert list(entry)[0] == token and len(entry) == len(set(p.logprob_token_ids) | {token})
                for place, tid in enumerate(p.logprob_token_ids, start=1):  # distinct ids (rng.sample)
                    assert entry[tid].rank == place
                    errors.append(abs(entry[tid].logprob - float(truth[tid])))
                    noises.append(abs(float(bf16[tid] - truth[tid])))
                ids.append(token)
    assert len(errors) >= 12 * 5 and max(errors) < bf16_slack(noises), (max(errors), bf16_slack(noises))


def test_async_scheduling_equals_synchronous_with_listed_ids_on_gpu(model_path):
    options = dict(skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32, gpu_memory_utilization=0.3, dtype="float32")
    sync = LLM(model_path, async_scheduling=False, **options)
    fast = LLM(model_path, async_scheduling=True, **options)
    inputs, params = _inputs(24, seed=5), _mixed(24)
    want = sync.generate(inputs, params, use_tqdm=False)
    before = fast.llm_engine.stats.num_overlapped_steps
    got = fast.generate(inputs, params, use_tqdm=False)
    assert fast.llm_engine.stats.num_overlapped_steps - before > 3
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.token_ids == wc.token_ids
            if wc.logprobs is not None:
                assert [[(t, lp.rank) for t, lp in e.items()] for e in gc.logprobs] == \
                    [[(t, lp.rank) for t, lp in e.items()] for e in wc.logprobs]
                assert [lp.logprob for e in gc.logprobs for lp in e.values()] == \
                    pytest.approx([lp.logprob for e in wc.logprobs for lp in e.values()], abs=1e-4)


def test_logprob_ids_state_needs_no_host_sync():
    from support.state_seq import StateSeq as Seq
    from tokenmill.worker.sampling_state import LogprobIdsState, step_rows

    device = torch.device("cuda")

    def to_device(host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory().to(device, non_blocking=True)

    state = LogprobIdsState(device)
    seqs = [Seq(i, SamplingParams(logprob_token_ids=list(range(i, 3 * i + 1)) if i % 2 else None)) for i in range(9)]
    logprobs = torch.log_softmax(torch.randn(len(seqs), VOCAB, device=device), dim=-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the first step fills and grows the table, the others only gather
            gathered = state.gather(logprobs, step_rows(state.slots(seqs, to_device), to_device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for row, seq in enumerate(seqs):
        listed = seq.params.logprob_token_ids
        if listed:
            assert torch.equal(gathered[row, : len(listed)].cpu(), logprobs[row, listed].cpu())
