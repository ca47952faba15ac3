"""Hugging Face transformers on the GPU as the GPU tests' reference: a model folder's next-token
logprobs in a given dtype, and our greedy tokens scored teacher-forced against them.

A bf16 engine is judged against HF in fp32 (the truth), with HF's own bf16 forward as the yardstick
of bf16 noise on the same positions: two bf16 implementations that sum in different orders differ
by up to about twice that noise, and a bug in a kernel or a weight layout moves logprobs by whole
units (docs/perf.md 53: HF bf16 was up to 0.056 from fp32 on the tiny test models, and ours on
the H200 0.084 from HF bf16 on one of them)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str, dtype: torch.dtype, adapter: str | None = None):
    """HF's model of ``path`` on the GPU, with the PEFT LoRA adapter folder ``adapter`` around it if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    if adapter is None:
        return model
    from peft import PeftModel

    # PEFT would keep the adapter in fp32; cast with the model, so a bf16 yardstick rounds it as we do.
    return PeftModel.from_pretrained(model, adapter).to(dtype).cuda().eval()


@torch.no_grad()
def hf_logprobs(path: str, dtype: torch.dtype, ids: list[int], adapter: str | None = None) -> torch.Tensor:
    """[V] float32 log-softmax of HF's logits after ``ids`` (with a PEFT adapter: see hf_model)."""
    logits = hf_model(path, dtype, adapter)(torch.tensor([ids], device="cuda")).logits
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


def teacher_forced_positions(llm, reference, prompts, tokens: int,
                             yardstick=None, lora_request=None) -> list[tuple[float, bool, float, float]]:
    """Along our greedy tokens, each position scored on the same prefix (so errors do not compound):
    (the reference's top-two gap, whether we picked its argmax, |our logprob - its logprob| of our
    token, |yardstick's logprob - its logprob| of our token, 0 without a yardstick). ``lora_request``:
    the prompts' LoRA adapter (one, or one per prompt)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request)
    rows = []
    for prompt, output in zip(prompts, outputs):
        ids = list(prompt)
        for position, token in enumerate(output.outputs[0].token_ids):
            ref = reference(ids)
            top2 = torch.topk(ref, 2).values
            ours = abs(output.outputs[0].logprobs[position][token].logprob - float(ref[token]))
            noise = abs(float(yardstick(ids)[token] - ref[token])) if yardstick is not None else 0.0
            rows.append((float(top2[0] - top2[1]), token == int(ref.argmax()), ours, noise))
            ids.append(token)
    return rows


def assert_within(rows, slack: float, clear_needed: int) -> None:
    """``teacher_forced_positions`` rows judged: our logprob within ``slack`` of the reference's at
    every position, and the reference's argmax picked wherever its top two are more than ``slack``
    apart, at ``clear_needed`` positions at least (so the agreement check is never vacuous)."""
    clear = [agree for gap, agree, _, _ in rows if gap > slack]
    worst = max(ours for _, _, ours, _ in rows)
    assert len(clear) >= clear_needed and all(clear) and worst < slack, (len(clear), sum(clear), worst, slack)


def bf16_slack(noises) -> float:
    """How far a bf16 engine's logprob may sit from HF fp32's: 0.05 plus twice HF bf16's own largest
    distance from fp32 on the same positions."""
    return 0.05 + 2 * max(noises)
