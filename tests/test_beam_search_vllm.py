"""LLM.beam_search against a brute-force search written from vLLM 0.26's `LLM.beam_search`
(vllm/entrypoints/llm.py, vllm/beam_search.py) over transformers' fp32 next-token log-probabilities.

vLLM's rules, as the reference below follows them: each live beam offers its ``2 * beam_width`` most
likely next tokens; a candidate ending on the tokenizer's eos goes to a completed list (all of them,
whatever their rank) unless ``ignore_eos``; the others, sorted by the score key, give the next
``beam_width`` live beams; after ``max_tokens`` steps (no early stop) completed and live beams are
sorted by the key and the first ``beam_width`` returned, tokens including the prompt. The key is
``cum_logprob / len(tokens) ** length_penalty``, ``len`` counting the prompt and not a final eos.

tokenmill follows transformers' beam search instead (docs/from-vllm.md, "Beam search"). The two
agree whenever no beam may end: with ``ignore_eos``, except where vLLM's key leaves a live beam's
trailing eos token out of its length, which this test checks is the one reason they part.
With eos on they part as documented; test_beam_search.py checks those searches against transformers.
"""

from __future__ import annotations

import functools

from reference import hf_model, hf_next_logprobs
from test_beam_search import llama, llama_eos_dir, prompts  # noqa: F401 (fixtures)
from tokenmill import BeamSearchOutput, BeamSearchParams

MAX_TOKENS = 6


def vllm_beam_search(next_logprobs, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                     eos: int, ignore_eos: bool, eos_shortens: bool = True) -> list[tuple[list[int], float]]:
    """vLLM's search, brute force: per returned beam, best first, its tokens (prompt included) and
    cumulative logprob. ``eos_shortens=False`` drops the key's eos rule (to name it as the difference)."""

    def key(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        length = len(tokens) - (eos_shortens and tokens[-1] == eos)
        return cum / length**length_penalty

    live, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        extended = []
        for tokens, cum in live:
            top = next_logprobs(tuple(tokens)).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [token], cum + logprob)
                (completed if token == eos and not ignore_eos else extended).append(beam)
        live = sorted(extended, key=key, reverse=True)[:width]
    return sorted(completed + live, key=key, reverse=True)[:width]


def same_beams(output: BeamSearchOutput, reference: list[tuple[list[int], float]]) -> bool:
    return [b.tokens for b in output.sequences] == [tokens for tokens, _ in reference] and all(
        abs(b.cum_logprob - cum) < 1e-4 for b, (_, cum) in zip(output.sequences, reference))


def test_beams_equal_a_brute_force_vllm_search_where_no_beam_ends(llama, llama_eos_dir, prompts):
    tokenizer = llama.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    inputs = ["the cat sat on the", {"prompt_token_ids": prompts[1]}, {"prompt_token_ids": list(chat)}]
    prompt_ids = [tokenizer.encode(inputs[0]), prompts[1], list(chat)]
    hf = hf_model(str(llama_eos_dir))
    next_logprobs = functools.lru_cache(maxsize=None)(lambda ids: hf_next_logprobs(hf, list(ids)))
    (eos,) = llama.llm_engine.config.eos_token_ids
    parted = 0
    for width in (1, 2, 3, 4):
        for length_penalty in (0.0, 1.0, 2.0):
            outputs = llama.beam_search(inputs, BeamSearchParams(width, MAX_TOKENS, ignore_eos=True, length_penalty=length_penalty))
            for prompt, output in zip(prompt_ids, outputs):
                assert len(output.sequences) == width
                for beam in output.sequences:
                    assert beam.tokens[: len(prompt)] == prompt and len(beam.tokens) == len(prompt) + MAX_TOKENS
                    assert beam.finish_reason == "length" and beam.stop_reason is None and beam.lora_request is None
                    assert len(beam.logprobs) == MAX_TOKENS and all(len(entry) == 2 * width for entry in beam.logprobs)
                    assert beam.text == tokenizer.decode(beam.tokens)  # vLLM's: the prompt's text too
                args = (next_logprobs, prompt, width, MAX_TOKENS, length_penalty, eos, True)
                if not same_beams(output, vllm_beam_search(*args)):
                    # vLLM scores a live beam ending on the eos token (ignored) one token shorter;
                    # tokenmill ranks equally long live beams by their cumulative logprob alone.
                    assert length_penalty != 0 and same_beams(output, vllm_beam_search(*args, eos_shortens=False))
                    parted += 1
    assert parted <= 4  # a rare tie-break rule, not the algorithm


def test_an_empty_prompt_list_gives_no_outputs(llama):
    """vLLM's beam_search fails on [] (a zero range step); tokenmill's, like its generate, returns []."""
    assert llama.beam_search([], BeamSearchParams(2, 4)) == []
    assert llama.beam_search([], BeamSearchParams(2, 4), concurrency_limit=3) == []
