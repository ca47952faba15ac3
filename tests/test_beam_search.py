"""LLM.beam_search against Hugging Face transformers' beam search (num_beams, length_penalty, no
sampling) on tiny random models, token for token and score for score; and the engine mechanisms
(beams sharing KV blocks, prefix caching off, chunked prefill, preemption, batching with other
requests) leaving the result unchanged. The search rules alone are also checked against
transformers on scripted distributions that make each rule decide the outcome.

A random model rarely predicts its real eos, so the tiny models' eos is set to a token their beams
use often: beams do end on eos and transformers' handling of finished hypotheses is exercised
(the tests assert that it was).
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from reference import hf_beam_search, hf_greedy, hf_model, hf_next_logprobs
from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, SamplingParams
from tokenmill.engine.beam_search import BeamSearch
from tokenmill.engine.request import Request, Sequence

MAX_TOKENS = 10
# (beam_width, length_penalty, ignore_eos, temperature). Temperature leaves deterministic beam
# search unchanged (vLLM V1 scores raw logprobs; transformers ignores it without sampling).
CASES = [(2, 0.0, False, 0.0), (3, 0.5, False, 0.0), (4, 2.0, False, 0.7), (3, 1.0, True, 0.0)]


def with_frequent_eos(src: Path, dst: Path, prompts: list[list[int]]) -> Path:
    """A copy of a tiny model whose eos (configs and tokenizer) is the token transformers' eos-free beams use
    most on ``prompts``."""
    if not dst.exists():
        model = hf_model(str(src))
        counts = collections.Counter()
        for prompt in prompts:
            for tokens, _ in hf_beam_search(model, prompt, 4, MAX_TOKENS, 1.0, eos=False):
                counts.update(tokens)
        shutil.copytree(src, dst)
        eos = counts.most_common(1)[0][0]
        for name in ("config.json", "generation_config.json"):
            config = json.loads((dst / name).read_text())
            config["eos_token_id"] = eos
            (dst / name).write_text(json.dumps(config))
        # The tokenizer names it too: an engine stops on the tokenizer's eos as well (as vLLM does),
        # where transformers' beam search reads the generation config alone.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(src))
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        tokenizer.save_pretrained(str(dst))
        assert AutoTokenizer.from_pretrained(str(dst)).eos_token_id == eos
    return dst


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    vocab_size = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    return random_prompts(vocab_size, [3, 21, 40], seed=5)


@pytest.fixture(scope="module")
def llama_eos_dir(tiny_llama_dir, tiny_models_root, prompts):
    return with_frequent_eos(tiny_llama_dir, tiny_models_root / "llama_frequent_eos", prompts)


@pytest.fixture(scope="module")
def qwen3_eos_dir(tiny_qwen3_dir, tiny_models_root, prompts):
    return with_frequent_eos(tiny_qwen3_dir, tiny_models_root / "qwen3_frequent_eos", prompts)


@pytest.fixture(scope="module")
def llama(llama_eos_dir):
    return make_llm(llama_eos_dir)


def hf_reference(path: Path, prompt: list[int], width: int, length_penalty: float, ignore_eos: bool, temperature: float):
    extra = {"temperature": temperature} if temperature else {}
    return hf_beam_search(hf_model(str(path)), prompt, width, MAX_TOKENS, length_penalty, eos=not ignore_eos, **extra)


def assert_matches_hf(output: BeamSearchOutput, prompt: list[int], reference, length_penalty: float) -> None:
    assert len(output.sequences) == len(reference)
    for beam, (ref_tokens, ref_score) in zip(output.sequences, reference):
        assert beam.tokens[: len(prompt)] == prompt
        generated = beam.tokens[len(prompt) :]
        assert generated == ref_tokens
        assert beam.cum_logprob / len(generated) ** length_penalty == pytest.approx(ref_score, abs=1e-4)


def run(llm, prompts, params) -> list[BeamSearchOutput]:
    return llm.beam_search(as_inputs(prompts), params)


@pytest.mark.parametrize("path_fixture, cases", [("llama_eos_dir", CASES), ("qwen3_eos_dir", CASES[:2])])
def test_beams_equal_transformers_beam_search(path_fixture, cases, request, prompts):
    path = request.getfixturevalue(path_fixture)
    llm = request.getfixturevalue("llama") if path_fixture == "llama_eos_dir" else make_llm(path)
    (eos,) = llm.llm_engine.config.eos_token_ids
    seen = collections.Counter()
    for width, length_penalty, ignore_eos, temperature in cases:
        params = BeamSearchParams(width, MAX_TOKENS, ignore_eos=ignore_eos, temperature=temperature, length_penalty=length_penalty)
        for prompt, output in zip(prompts, run(llm, prompts, params)):
            reference = hf_reference(path, prompt, width, length_penalty, ignore_eos, temperature)
            assert_matches_hf(output, prompt, reference, length_penalty)
            lengths = [len(beam.tokens) - len(prompt) for beam in output.sequences]
            for beam, length in zip(output.sequences, lengths):
                ends_on_eos = beam.tokens[-1] == eos and not ignore_eos
                assert beam.finish_reason == ("stop" if ends_on_eos else "length")
                seen["early eos" if ends_on_eos and length < MAX_TOKENS else beam.finish_reason] += 1
            seen["early stop"] += max(lengths) < MAX_TOKENS  # transformers' heuristic ended the search
    # Hypotheses finished on eos before the last step, at the length limit, and searches ended by
    # the early-stop heuristic all occurred.
    assert seen["early eos"] >= 3 and seen["length"] >= 3 and seen["early stop"] >= 1, seen
    assert_cache_released(llm)


def grammar_allowed_tokens(tokenizer, vocab_size: int, regex: str, prompt_len: int, eos: int):
    """transformers' prefix_allowed_tokens_fn for a regex, from xgrammar directly: the tokens its
    matcher allows after a beam's generated tokens (eos alone once the grammar has ended)."""
    import xgrammar

    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)).compile_regex(regex)

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in input_ids[prompt_len:].tolist():
            assert matcher.accept_token(token)
        if matcher.is_terminated():
            return [eos]
        mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(mask)
        bits = ((mask[0, :, None] >> torch.arange(32)) & 1).reshape(-1)[:vocab_size]
        return bits.nonzero().flatten().tolist()

    return allowed


@pytest.mark.parametrize("regex, width, length_penalty", [("(ab|b[ac]|c)+d?", 3, 1.0), ("[a-c]{2,4}|de", 2, 0.5)])
def test_beams_under_a_grammar_equal_transformers_with_allowed_tokens(tiny_llama_dir, prompts, regex, width, length_penalty):
    """vLLM 0.26's BeamSearchParams(structured_outputs=...): every step's candidates are the best
    tokens the grammar allows, scored by raw logprobs, as transformers' beam search with a
    prefix_allowed_tokens_fn (built from xgrammar, not from tokenmill) finds them."""
    from tokenmill import StructuredOutputsParams

    llm = make_llm(tiny_llama_dir)
    (eos,) = llm.llm_engine.config.eos_token_ids
    tokenizer, vocab_size = llm.get_tokenizer(), llm.llm_engine.config.vocab_size
    params = BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty,
                              structured_outputs=StructuredOutputsParams(regex=regex))
    ended = 0
    for prompt, output in zip(prompts, run(llm, prompts, params)):
        allowed = grammar_allowed_tokens(tokenizer, vocab_size, regex, len(prompt), eos)
        reference = hf_beam_search(hf_model(str(tiny_llama_dir)), prompt, width, MAX_TOKENS, length_penalty,
                                   prefix_allowed_tokens_fn=allowed)
        assert_matches_hf(output, prompt, reference, length_penalty)
        for beam in output.sequences:
            allowed(0, torch.tensor(beam.tokens))  # xgrammar accepts every generated token
            if beam.finish_reason == "stop":
                ended += 1
                assert re.fullmatch(regex, tokenizer.decode(beam.tokens[len(prompt):], skip_special_tokens=True))
    assert ended >= 1  # some beam completed its grammar and ended on eos
    assert_cache_released(llm)


SCRIPTED_VOCAB = 256


def scripted_logprobs(ids: list[int], prompt_len: int, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """A made-up next-token distribution, a fixed function of the sequence, that makes every rule
    matter: at the first step the eos tokens sit right behind the best token (with several eos ids,
    more than beam_width of the top 2 * beam_width candidates end); in the next two steps eos is
    likely, so finished hypotheses fill up early; and the model grows ever more confident, so
    transformers' stop heuristic fires, sometimes before the best hypothesis is found."""
    generated = len(ids) - prompt_len
    gen = torch.Generator().manual_seed(hash(tuple(ids)) & 0x7FFFFFFF)
    logits = torch.randn(SCRIPTED_VOCAB, generator=gen) * (1.0 + generated)
    if generated == 0:
        logits[list(eos_ids)] = logits.max() - 0.01 * torch.arange(1, len(eos_ids) + 1)
    elif generated < 3:
        logits[list(eos_ids)] += 6.0
    return torch.log_softmax(logits, dim=-1)


class _Host:
    """The scheduler's part in BeamSearch.advance, for a search run without an engine."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.seq_ids = itertools.count()

    def new_sequence(self, req: Request, index: int) -> Sequence:
        seq = Sequence(next(self.seq_ids), index, req, self.prompt)
        seq.logprobs = []
        return seq

    def finish(self, seq) -> None:
        pass

    def add_forks(self, seqs) -> None:
        pass


def scripted_search(prompt: list[int], params: BeamSearchParams, eos_ids: tuple[int, ...]) -> list[tuple[list[int], float]]:
    """BeamSearch driven by scripted_logprobs instead of a model: (tokens, score) per hypothesis."""
    search = BeamSearch(params, set() if params.ignore_eos else set(eos_ids), params.max_tokens)
    request = Request("scripted", None, prompt, SamplingParams())
    request.beam = search
    host = _Host(prompt)
    request.sequences = [host.new_sequence(request, 0)]
    while not search.done:
        for seq in request.sequences:
            top = scripted_logprobs(prompt + seq.output_token_ids, len(prompt), eos_ids).topk(search.num_candidates)
            search.report(seq, top.indices.tolist(), top.values.tolist())
        request.sequences = search.advance(request.sequences, host)
    return [(hyp.token_ids, hyp.score) for hyp in search.finished]


def test_search_rule_equals_transformers_on_scripted_distributions():
    """The selection, scoring and stop rules alone, on distributions that make eos common (one or
    several eos ids) and the early-stop heuristic decisive; transformers runs its beam search with
    a logits processor that replaces the model's log-probabilities by the same scripted ones."""
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

    # The model only carries transformers' generate loop (its logits are replaced): the smallest will do.
    config = LlamaConfig(
        vocab_size=SCRIPTED_VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    prompt = [44, 3, 250, 12, 8, 77, 160]
    seen = collections.Counter()
    for width in (2, 3, 4):
        for length_penalty in (0.5, 1.0, 2.0):
            for eos_ids, ignore_eos in (((7,), False), ((7, 8, 9), False), ((7,), True)):
                if ignore_eos and length_penalty != 1.0:
                    continue

                def scripted(input_ids: torch.Tensor, scores: torch.Tensor, eos_ids=eos_ids) -> torch.Tensor:
                    return torch.stack([scripted_logprobs(row.tolist(), len(prompt), eos_ids) for row in input_ids])

                reference = hf_beam_search(
                    model, prompt, width, 12, length_penalty, eos=not ignore_eos,
                    logits_processor=LogitsProcessorList([scripted]), **({} if ignore_eos else {"eos_token_id": list(eos_ids)}),
                )
                ours = scripted_search(prompt, BeamSearchParams(width, 12, ignore_eos, length_penalty=length_penalty), eos_ids)
                assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in reference]
                assert [score for _, score in ours] == pytest.approx([score for _, score in reference], abs=1e-4)
                seen["early stop"] += max(len(tokens) for tokens, _ in reference) < 12
                seen["eos"] += sum(tokens[-1] in eos_ids and not ignore_eos for tokens, _ in reference)
    assert seen["early stop"] >= 3 and seen["eos"] >= 10, seen


def assert_cache_released(llm) -> None:
    engine = llm.llm_engine
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert not any(engine.kv.pool.ref_counts), "a beam kept KV blocks after its request finished"


MECHANISM_CASE = (3, 0.5)  # width, length_penalty: forks every step, some beams end on eos


@pytest.fixture(scope="module")
def mechanism_reference(llama_eos_dir, prompts):
    width, length_penalty = MECHANISM_CASE
    return [hf_reference(llama_eos_dir, p, width, length_penalty, False, 0.0) for p in prompts]


@pytest.mark.parametrize(
    "options, blocks",
    [
        ({"enable_prefix_caching": False}, None),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 4}, None),  # chunked prefill, few sequences per step
        ({"enable_prefix_caching": False}, 4),  # room for one beam of the longest prompt: constant preemption
        ({}, 6),  # preemption with prefix caching
    ],
)
def test_engine_mechanisms_leave_beams_unchanged(options, blocks, llama, llama_eos_dir, prompts, mechanism_reference):
    if blocks is not None:
        options = dict(options, kv_cache_memory_bytes=(blocks + 1) * llama.llm_engine.executor.runner.kv_bytes_per_block())
    llm = make_llm(llama_eos_dir, **options)
    width, length_penalty = MECHANISM_CASE
    outputs = run(llm, prompts, BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty))
    for prompt, output, reference in zip(prompts, outputs, mechanism_reference):
        assert_matches_hf(output, prompt, reference, length_penalty)
    if blocks is not None:
        assert llm.llm_engine.kv.num_usable_blocks == blocks and llm.llm_engine.scheduler.num_preemptions > 0
    assert_cache_released(llm)


def test_max_model_len_ends_the_search_like_max_new_tokens(llama_eos_dir, prompts):
    llm = make_llm(llama_eos_dir, max_model_len=48)
    prompt = prompts[2]  # 40 tokens: room for 8 of the 10 new tokens asked for
    (output,) = run(llm, [prompt], BeamSearchParams(3, MAX_TOKENS, ignore_eos=True))
    reference = hf_beam_search(hf_model(str(llama_eos_dir)), prompt, 3, 48 - len(prompt), 1.0, eos=False)
    assert_matches_hf(output, prompt, reference, 1.0)
    assert all(len(beam.tokens) == 48 and beam.finish_reason == "length" for beam in output.sequences)


def test_beams_share_their_parents_blocks(llama_eos_dir, prompts, monkeypatch):
    llm = make_llm(llama_eos_dir, enable_prefix_caching=False)  # sharing must not rely on the prefix cache
    engine = llm.llm_engine
    prompt = prompts[2]  # 40 tokens: two full blocks of 16
    engine.add_request("beams", {"prompt_token_ids": prompt}, BeamSearchParams(4, MAX_TOKENS, ignore_eos=True))
    shared_steps = 0
    execute = engine.executor.execute_model

    def inspecting_execute(plan):
        nonlocal shared_steps
        scheduled = plan.scheduled
        if len(scheduled) == 4:  # every beam of the group runs in this step
            heads = {tuple(item.seq.block_ids[:2]) for item in scheduled}
            assert len(heads) == 1, "every beam holds the prompt's two full blocks"
            assert all(engine.kv.pool.ref_counts[block] == 4 for block in next(iter(heads)))
            shared_steps += 1
        return execute(plan)

    monkeypatch.setattr(engine.executor, "execute_model", inspecting_execute)
    while engine.has_unfinished_requests():
        engine.step()
    assert shared_steps == MAX_TOKENS - 1  # all steps after the prompt's
    # The prompt was computed once: later steps computed at most a block's worth of tokens per beam.
    assert engine.stats.num_batched_tokens <= len(prompt) + (MAX_TOKENS - 1) * 4 * engine.config.block_size


def test_beam_groups_batch_with_other_requests_and_step_synchronously(llama_eos_dir, prompts, mechanism_reference):
    llm = make_llm(llama_eos_dir, async_scheduling=True)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=2 * MAX_TOKENS, ignore_eos=True)
    width, length_penalty = MECHANISM_CASE
    outputs = {}

    def step() -> None:
        outputs.update((o.request_id, o) for o in engine.step(finished_only=True))

    for i, prompt in enumerate(prompts):
        engine.add_request(f"greedy-{i}", {"prompt_token_ids": prompt}, greedy)
    for _ in range(3):
        step()
    overlapped = engine.stats.num_overlapped_steps
    assert overlapped > 0
    for i, prompt in enumerate(prompts):  # joins the running greedy requests, one step in flight
        engine.add_request(f"beam-{i}", {"prompt_token_ids": prompt}, BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty))
    while any(f"beam-{i}" in engine.requests for i in range(len(prompts))):
        step()
        assert engine.stats.num_overlapped_steps == overlapped  # beam selection needs each step's results
    assert any(f"greedy-{i}" in engine.requests for i in range(len(prompts)))  # they shared steps
    while engine.has_unfinished_requests():
        step()
    assert engine.stats.num_overlapped_steps > overlapped  # back to overlapping once the beams are done
    hf = hf_model(str(llama_eos_dir))
    for i, prompt in enumerate(prompts):
        assert outputs[f"greedy-{i}"].outputs[0].token_ids == hf_greedy(hf, prompt, 2 * MAX_TOKENS)[0]
        beams = outputs[f"beam-{i}"].outputs
        assert [c.token_ids for c in beams] == [tokens for tokens, _ in mechanism_reference[i]]
        for c, (_, score) in zip(beams, mechanism_reference[i]):
            assert c.cumulative_logprob / len(c.token_ids) ** length_penalty == pytest.approx(score, abs=1e-4)
    assert_cache_released(llm)


def beam_summary(output: BeamSearchOutput) -> list[tuple]:
    return [(b.tokens, b.text, b.finish_reason, round(b.cum_logprob, 4)) for b in output.sequences]


def test_output_shape_text_and_logprobs(llama, llama_eos_dir, prompts):
    tokenizer = llama.get_tokenizer()
    inputs = ["the cat sat on", {"prompt": "in the beginning"}, {"prompt_token_ids": prompts[1]}]
    prompt_ids = [tokenizer.encode(inputs[0]), tokenizer.encode(inputs[1]["prompt"]), prompts[1]]
    params = BeamSearchParams(3, MAX_TOKENS, length_penalty=0.5)
    outputs = llama.beam_search(inputs, params)
    for others in (llama.beam_search(inputs, params, concurrency_limit=2), llama.beam_search(inputs[0], params)):
        assert [beam_summary(o) for o in others] == [beam_summary(o) for o in outputs[: len(others)]]
    with_stop = llama.beam_search(inputs, BeamSearchParams(3, MAX_TOKENS, length_penalty=0.5, include_stop_str_in_output=True))
    hf = hf_model(str(llama_eos_dir))
    for prompt, output, output_with_stop in zip(prompt_ids, outputs, with_stop):
        assert isinstance(output, BeamSearchOutput) and len(output.sequences) == 3
        for beam, beam_with_stop in zip(output.sequences, output_with_stop.sequences):
            assert isinstance(beam, BeamSearchSequence) and beam.tokens[: len(prompt)] == prompt
            shown = beam.tokens[:-1] if beam.finish_reason == "stop" else beam.tokens
            assert beam.text == tokenizer.decode(shown) and beam_with_stop.text == tokenizer.decode(beam.tokens)
            generated = beam.tokens[len(prompt) :]
            assert len(beam.logprobs) == len(generated)
            for token, entry in zip(generated, beam.logprobs):
                assert len(entry) == 6 and sorted(lp.rank for lp in entry.values()) == list(range(1, 7))
                assert entry[token].decoded_token == tokenizer.decode([token])
            assert beam.cum_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(generated, beam.logprobs)), abs=1e-5)
        best = output.sequences[0]  # its logprob entries against transformers' distributions
        for position, entry in enumerate(best.logprobs):
            reference = hf_next_logprobs(hf, best.tokens[: len(prompt) + position])
            assert max(abs(lp.logprob - float(reference[t])) for t, lp in entry.items()) < 1e-4
            assert sorted(entry, key=lambda t: entry[t].rank) == reference.topk(len(entry)).indices.tolist()
    assert any(b.finish_reason == "stop" for o in outputs for b in o.sequences)  # the eos text rule was exercised


def test_aborting_a_beam_search_frees_its_blocks(llama, prompts):
    engine = llama.llm_engine
    engine.add_request("doomed", {"prompt_token_ids": prompts[1]}, BeamSearchParams(4, MAX_TOKENS, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.requests["doomed"].sequences) == 4
    engine.abort_request("doomed")
    assert_cache_released(llama)


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"beam_width": 0}, "beam_width", ">= 1"),
        ({"beam_width": 2.5}, "beam_width", "an integer"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"temperature": -1.0}, "temperature", ">= 0"),
        ({"length_penalty": float("nan")}, "length_penalty", "finite"),
        ({"length_penalty": "long"}, "length_penalty", "a finite number"),
        ({"ignore_eos": "yes"}, "ignore_eos", "True or False"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs", "None or a StructuredOutputsParams"),
    ],
)
def test_bad_beam_search_params_name_the_field(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert f"BeamSearchParams.{field}=" in str(err.value) and allowed in str(err.value)


def test_bad_beam_search_calls_are_refused_and_leave_nothing_running(llama, prompts):
    params = BeamSearchParams(2, 4)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llama.beam_search(as_inputs(prompts), SamplingParams())
    with pytest.raises(ValueError, match="lora_request"):
        llama.beam_search(as_inputs(prompts), params, lora_request="adapter")
    with pytest.raises(ValueError, match="concurrency_limit=0"):
        llama.beam_search(as_inputs(prompts), params, concurrency_limit=0)
    with pytest.raises(ValueError, match=r"beam_width=300 is invalid: must be <= max_num_seqs \(256\)"):
        llama.beam_search(as_inputs(prompts), BeamSearchParams(300, 4))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llama.beam_search([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": []}], params)
    # Run a chunk at a time, the bad prompt is still named by its index in the whole list, and it is
    # found before the first chunk's search runs (which it would otherwise throw away).
    steps = llama.llm_engine.stats.num_steps
    with pytest.raises(ValueError, match=r"prompts\[2\] is empty"):
        llama.beam_search([*as_inputs(prompts[:2]), {"prompt_token_ids": []}], params, concurrency_limit=2)
    assert llama.llm_engine.stats.num_steps == steps
    assert_cache_released(llama)


@pytest.mark.parametrize("field, value, allowed", [("beam_width", 0, "an integer >= 1"), ("length_penalty", None, "a finite number"),
                                                   ("max_tokens", "4", "an integer >= 1")])
def test_a_beam_search_field_set_after_construction_is_checked(llama, prompts, field, value, allowed):
    """As SamplingParams' (test_bad_input.py): beam_width=0 failed an assert inside the engine, a None
    length_penalty a bare TypeError after the search, a string max_tokens was named as SamplingParams'."""
    params = BeamSearchParams(2, 4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"prompts\[0\]: BeamSearchParams.{field}={value!r} is invalid: must be {allowed}"):
        llama.beam_search(as_inputs(prompts[:2]), params)
    assert_cache_released(llama)
