"""Reference computations with Hugging Face transformers (fp32, CPU), written independently of tokenmill."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by repeated full forwards; returns tokens and their log-probabilities."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(logp[token]))
        ids.append(token)
    return tokens, logprobs


@torch.no_grad()
def hf_next_logprobs(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
