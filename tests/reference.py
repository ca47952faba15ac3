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


# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler exceeds them once
# in a thousand seeds (the draw tests use fixed seeds, so they are deterministic).
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
CHI2_9DOF_P001 = CHI2_P001[9]


def draw_test_logits() -> torch.Tensor:
    """11 logits, one of them -inf: 10 possible outcomes, 9 degrees of freedom."""
    logits = torch.randn(11, generator=torch.Generator().manual_seed(0)) * 1.5
    logits[7] = float("-inf")
    return logits


def softmax_chi_square(samples: torch.Tensor, logits: torch.Tensor, temperature: float) -> float:
    """Pearson's chi-square of the sampled token counts against softmax(logits / temperature);
    a token of probability 0 must never have been drawn."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    counts = torch.bincount(samples, minlength=logits.shape[0]).double()
    assert (counts[probs == 0] == 0).all(), "a token of probability 0 (-inf logit) was drawn"
    keep = probs > 0
    expected = probs[keep] * samples.numel()
    return float(((counts[keep] - expected) ** 2 / expected).sum())
