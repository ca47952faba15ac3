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


@torch.no_grad()
def hf_beam_search(
    model, prompt_ids: list[int], num_beams: int, max_new_tokens: int, length_penalty: float, eos: bool = True, **kwargs
) -> list[tuple[list[int], float]]:
    """transformers' beam search (no sampling, all num_beams hypotheses): per hypothesis, best first,
    its generated tokens (the eos included) and its score (sum of logprobs / length ** length_penalty).
    eos=False runs it without an eos token (vLLM's ignore_eos)."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        num_beams=num_beams,
        num_return_sequences=num_beams,
        max_new_tokens=max_new_tokens,
        length_penalty=length_penalty,
        output_scores=True,
        return_dict_in_generate=True,
        **({} if eos else {"eos_token_id": None}),
        **kwargs,
    )
    hypotheses = []
    for sequence, score, beam_indices in zip(out.sequences, out.sequences_scores, out.beam_indices):
        length = int((beam_indices >= 0).sum())  # the rest is padding after an eos
        hypotheses.append((sequence[len(prompt_ids) : len(prompt_ids) + length].tolist(), float(score)))
    return hypotheses
