"""A property and differential fuzz of structured outputs under the engine's scheduling paths.

Random constraints (JSON schemas built from simple keywords, json_object, regexes, choices, EBNF
grammars) meet random sampling settings (n > 1, best_of, seeds, temperatures, stop strings,
stop_token_ids, min_tokens, max_tokens cuts, logprobs, ignore_eos, top-k/top-p) on engines whose
scheduling differs: tiny KV pools that preempt and recompute, token budgets that cut prompts inside
blocks, block sizes 4 to 32, asynchronous scheduling, the prefix cache, the priority policy.

The reference for every output is xgrammar itself: a matcher of a compiler we build here from the
tokenizer, told the stop tokens vLLM's xgrammar backend tells it (the model's eos ids and the
request's stop_token_ids), fed the output's token ids:
- finish_reason "stop" from an eos or a stop id: every token accepted and the matcher terminated;
  the text parses (json.loads) and holds the schema's keywords, or is one of the choices, or
  matches the regex (without the stop id's text, or with it where the stop id spelled the
  constraint's last character: xgrammar takes it as both);
- "stop" from a stop string, and "length": every token accepted (a valid prefix);
- "error" (nothing the grammar allowed was left to draw, e.g. min_tokens holding back eos): every
  token accepted but the last, which the grammar refuses.
And the differential part: the same seeds give the same tokens, texts, finish reasons and logprobs
on every engine (a request's draws depend on its seed and position only). Beside them: aborts and a
constraint refused at intake mid-run, steps that fail midway, beam search, LoRA adapters taking turns.

Bounded here (8 workloads of 10 requests on 5 engines, ~400 request runs). A wider run of the same
workloads on 7 engines (seeds 100-999, ~63,000 request runs) found a NaN logprob, since fixed, and
the UTF-8 encoded surrogates below; a first scratch run found stop ids ending outputs mid-constraint.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from test_engine_differential import assert_same_outputs
from test_generate import make_llm
from tokenmill import BeamSearchParams, SamplingParams, StructuredOutputsParams

OPTIONS = dict(max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
VARIANTS = {
    "tiny_pool_prefix_cache": dict(enable_prefix_caching=True, num_gpu_blocks_override=7, max_num_batched_tokens=23),
    "tiny_pool_async": dict(enable_prefix_caching=False, num_gpu_blocks_override=7, max_num_batched_tokens=17,
                            async_scheduling=True),
    "block_4_async": dict(enable_prefix_caching=True, block_size=4, num_gpu_blocks_override=34, max_num_batched_tokens=9,
                          async_scheduling=True),
    "block_32_priority": dict(enable_prefix_caching=True, block_size=32, num_gpu_blocks_override=4,
                              max_num_batched_tokens=29, scheduling_policy="priority"),
}
PREEMPTING = {"tiny_pool_prefix_cache", "tiny_pool_async", "block_32_priority"}

REGEXES = [r"[a-z]{1,5}", r"\d{1,3}(\.\d{1,2})?", r"(yes|no|maybe)!?", r"[A-Z][a-z]{0,3}-\d{2}", r"(ab|c)+x", r"[^\n]{0,5}"]
GRAMMARS = ['root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+', 'root ::= "a" root "b" | "c"', 'root ::= ("x" | "yz")+ "."']
CHOICES = ["red", "green apple", "blue", "x", '"q"', "a\\b"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema of the keywords `holds_schema` checks: types, enum, bounds, required."""
    kind = rng.choice(["integer", "boolean", "enum", "string", "null", "number"] + (["array", "object"] if depth < 2 else []))
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        return rng.choice([{"type": "number"}, {"type": "number", "minimum": 0, "maximum": 10}])
    if kind == "enum":
        return {"enum": rng.sample(["a", "b c", 'd"e', 1, 2.5, True, None, "ü"], rng.randint(1, 4))}
    if kind == "string":
        return rng.choice([{"type": "string", "maxLength": rng.randint(0, 6)}, {"type": "string", "pattern": "^[a-c]{1,4}$"},
                           {"type": "string", "minLength": 1, "maxLength": 3}])
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    if kind == "object":
        names = rng.sample(["a", "bb", "c d", "e"], rng.randint(1, 3))
        return {"type": "object", "properties": {name: random_schema(rng, depth + 1) for name in names},
                "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}
    return {"type": kind}


def holds_schema(value, schema: dict) -> bool:
    """The keywords `random_schema` writes, read as JSON Schema reads them (not through our code)."""
    if "enum" in schema:
        return any(value == v and type(value) is type(v) for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "number":
        return type(value) in (int, float) and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "boolean":
        return type(value) is bool
    if kind == "null":
        return value is None
    if kind == "string":
        return (type(value) is str and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
                and re.search(schema.get("pattern", ""), value) is not None)
    if kind == "array":
        return (type(value) is list and schema["minItems"] <= len(value) <= schema["maxItems"]
                and all(holds_schema(v, schema["items"]) for v in value))
    return (type(value) is dict and set(schema["required"]) <= set(value) <= set(schema["properties"])
            and all(holds_schema(v, schema["properties"][k]) for k, v in value.items()))


def random_constraint(rng: random.Random) -> StructuredOutputsParams:
    kind = rng.choice(["json", "json", "regex", "choice", "grammar", "json_object"])
    if kind == "json":
        return StructuredOutputsParams(json=random_schema(rng))
    if kind == "regex":
        return StructuredOutputsParams(regex=rng.choice(REGEXES))
    if kind == "choice":
        return StructuredOutputsParams(choice=rng.sample(CHOICES, rng.randint(1, 4)))
    if kind == "grammar":
        return StructuredOutputsParams(grammar=rng.choice(GRAMMARS))
    return StructuredOutputsParams(json_object=True)


def workload(seed: int, tokenizer, num: int = 10) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    # Ids of characters the constraints write, so stop ids and stop strings do meet them.
    text_ids = sorted({tokenizer.encode(c, add_special_tokens=False)[0] for c in '",:}]0123456789abcx.'})
    prompts, params = [], []
    for _ in range(num):
        args: dict = dict(max_tokens=rng.randint(3, 30), temperature=rng.choice([0.0, 0.8, 1.0, 1.5]),
                          seed=rng.randrange(10**6), structured_outputs=random_constraint(rng))
        if args["temperature"] > 0:
            args.update(rng.choice([{}, {}, {"n": rng.randint(2, 3)}, {"n": 1, "best_of": 2}]))
        if rng.random() < 0.25:
            args.update(stop=rng.sample(['"', ",", "a", "1", "}"], 2), include_stop_str_in_output=rng.random() < 0.5)
        if rng.random() < 0.25:
            args.update(stop_token_ids=rng.sample(text_ids, 2))
        if rng.random() < 0.15:
            args.update(min_tokens=rng.randint(1, min(4, args["max_tokens"])))
        if rng.random() < 0.3:
            args.update(logprobs=rng.choice([0, 2]))
        if rng.random() < 0.1:
            args.update(ignore_eos=True)
        if rng.random() < 0.1:
            args.update(top_k=5, top_p=0.8)
        params.append(SamplingParams(**args))
        # Printable ASCII (byte tokens 36-96): a prompt ending inside a UTF-8 character would put its
        # replacement character at the head of the output's text.
        prompts.append({"prompt_token_ids": [rng.randrange(36, 97) for _ in range(rng.randint(10, 60))]})
    return prompts, params


class Reference:
    """xgrammar's compiler over the tokenizer, built here: fresh matchers to replay outputs with."""

    def __init__(self, llm):
        import xgrammar

        self.xgrammar = xgrammar
        self.tokenizer = llm.get_tokenizer()
        self.eos_ids = set(llm.llm_engine.config.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(self.tokenizer))

    def matcher(self, constraint: StructuredOutputsParams, stop_token_ids) -> object:
        c = self.compiler
        if constraint.json is not None:
            compiled = c.compile_json_schema(json.dumps(constraint.json), any_whitespace=False)
        elif constraint.json_object:
            compiled = c.compile_builtin_json_grammar()  # any JSON value, any whitespace: a superset
        elif constraint.regex is not None:
            compiled = c.compile_regex(constraint.regex)
        elif constraint.grammar is not None:
            compiled = c.compile_grammar(constraint.grammar)
        else:
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in constraint.choice))
        return self.xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(self.eos_ids | set(stop_token_ids)))

    def check(self, completion, params: SamplingParams, where: str) -> None:
        constraint, ids = params.structured_outputs, completion.token_ids
        matcher = self.matcher(constraint, params.stop_token_ids)
        where = f"{where}: {constraint.key} {completion}"
        if completion.finish_reason == "error":
            assert all(matcher.accept_token(t) for t in ids[:-1]) and not matcher.accept_token(ids[-1]), where
            return
        assert completion.finish_reason in ("stop", "length"), where
        assert all(matcher.accept_token(t) for t in ids), where
        if completion.finish_reason == "length" or isinstance(completion.stop_reason, str):
            return  # cut by max_tokens or a stop string: a prefix is all it must be
        assert matcher.is_terminated(), where
        if "\ufffd" in completion.text:
            # Bytes no UTF-8 decoder takes, which xgrammar's character classes let through (a UTF-8
            # encoded surrogate, ED A0-BF xx, is one character to it and three U+FFFD to Python):
            # the matcher's verdict is the check there.
            return
        texts = [completion.text]
        if isinstance(completion.stop_reason, int):  # the stop id's text, in the output or not
            stop_text = self.tokenizer.decode([completion.stop_reason])
            own = completion.text[:-len(stop_text)] if params.include_stop_str_in_output else completion.text
            texts = [own, own + stop_text]
        assert any(self.holds(constraint, text) for text in texts), where

    @staticmethod
    def holds(constraint: StructuredOutputsParams, text: str) -> bool:
        if constraint.choice is not None:
            return text in constraint.choice
        if constraint.regex is not None:
            return re.fullmatch(constraint.regex, text) is not None
        if constraint.grammar is not None:
            return True  # the matcher's verdict is the whole check
        try:
            value = json.loads(text, strict=False)  # xgrammar's JSON strings take raw control characters
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) if constraint.json_object else holds_schema(value, constraint.json)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return make_llm(tiny_llama_dir, enable_prefix_caching=False, async_scheduling=False, **OPTIONS)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return {name: make_llm(tiny_llama_dir, **OPTIONS, **args) for name, args in VARIANTS.items()}


@pytest.fixture(scope="module")
def replay(reference):
    return Reference(reference)


def check_all(replay: Reference, outputs, params, name: str) -> None:
    for i, (out, sp) in enumerate(zip(outputs, params, strict=True)):
        assert len(out.outputs) == sp.n, f"{name}: request {i}"
        for completion in out.outputs:
            replay.check(completion, sp, f"{name}: request {i}.{completion.index}")


@pytest.mark.parametrize("seed", range(8))
def test_constrained_outputs_hold_and_agree_under_every_scheduling(reference, engines, replay, seed):
    prompts, params = workload(seed, replay.tokenizer)
    want = reference.generate(prompts, params, use_tqdm=False)
    check_all(replay, want, params, "reference")
    for name, llm in engines.items():
        before = llm.llm_engine.scheduler.num_preemptions
        priority = [i % 3 for i in range(len(prompts))] if "priority" in name else None
        got = llm.generate(prompts, params, use_tqdm=False, priority=priority)
        check_all(replay, got, params, name)
        assert_same_outputs(want, got, name)
        if name in PREEMPTING:
            assert llm.llm_engine.scheduler.num_preemptions > before, f"{name} never preempted"


def test_the_workloads_reach_every_ending(reference, replay):
    """The fuzz is only as good as what it meets: grammar-complete stops, stop ids and stop strings
    ending constrained outputs, max_tokens cuts and rows whose grammar left nothing to draw."""
    endings = set()
    for seed in range(8):
        prompts, params = workload(seed, replay.tokenizer)
        for out in reference.generate(prompts, params, use_tqdm=False):
            for c in out.outputs:
                endings.add((c.finish_reason, type(c.stop_reason).__name__))
    assert endings >= {("stop", "NoneType"), ("stop", "int"), ("stop", "str"), ("length", "NoneType"),
                       ("error", "NoneType")}, endings


def test_aborts_and_a_refused_constraint_leave_the_other_constrained_requests_unchanged(reference, engines, replay):
    """Requests driven by LLMEngine.step, a third aborted after a few steps (waiting, running,
    preempted or with a token in flight), and a request whose constraint does not compile added
    mid-run (refused at intake, by name): every other request ends as on the reference."""
    prompts, params = workload(3, replay.tokenizer)
    want = reference.generate(prompts, params, use_tqdm=False)
    rng = random.Random(7)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    for name in ("tiny_pool_prefix_cache", "block_4_async"):
        engine = engines[name].llm_engine
        ids = [f"{name}-{i}" for i in range(len(prompts))]
        for request_id, prompt, sp in zip(ids, prompts, params):
            engine.add_request(request_id, prompt, sp)
        abort_at = {request_id: rng.randint(1, 8) for request_id in rng.sample(ids, len(ids) // 3)}
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
            engine.abort_request([r for r, at in abort_at.items() if at == steps])
            if steps == 3:
                with pytest.raises(ValueError, match=r"structured_outputs\.regex does not compile"):
                    engine.add_request(f"{name}-bad", prompts[0], bad)
        kept = [i for i, r in enumerate(ids) if r not in abort_at]
        assert f"{name}-bad" not in finished and set(finished) >= {ids[i] for i in kept}
        assert_same_outputs([want[i] for i in kept], [finished[ids[i]] for i in kept], f"{name} with aborts")
        check_all(replay, [finished[ids[i]] for i in kept], [params[i] for i in kept], name)


def test_beam_search_under_random_constraints(reference, engines, replay):
    """Beams fork their parent's matcher: every returned beam is a valid prefix, one ended on eos a
    whole constraint, and the search is the same on a preempting engine."""
    rng = random.Random(11)
    for _ in range(4):
        constraint = random_constraint(rng)
        params = BeamSearchParams(beam_width=3, max_tokens=rng.randint(4, 12), structured_outputs=constraint)
        prompts = [[rng.randrange(36, 97) for _ in range(rng.randint(2, 20))] for _ in range(2)]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        want = reference.beam_search(inputs, params)
        got = engines["tiny_pool_prefix_cache"].beam_search(inputs, params)
        for prompt, a, b in zip(prompts, want, got, strict=True):
            assert [(s.tokens, s.finish_reason) for s in a.sequences] == [(s.tokens, s.finish_reason) for s in b.sequences]
            for beam in a.sequences:
                matcher = replay.matcher(constraint, ())
                where = f"{constraint.key} {beam}"
                assert all(matcher.accept_token(t) for t in beam.tokens[len(prompt):]), where
                assert matcher.is_terminated() == (beam.finish_reason == "stop"), where


@pytest.mark.parametrize("where", ["launch", "read_back", "grammar_masks"])
def test_steps_that_fail_midway_leave_the_constrained_requests_as_they_were(reference, engines, replay, monkeypatch, where):
    """A step that raises (an engine bug, Ctrl-C) is recovered from: sequences are recomputed from
    the tokens the host holds, and each matcher holds exactly those tokens, whichever part of the
    step failed (its launch, the read-back that advances the matchers, or the masks filled from
    them for the next draw). A driver that goes on gets the reference's outputs."""
    prompts, params = workload(4, replay.tokenizer)
    want = reference.generate(prompts, params, use_tqdm=False)
    engine = engines["tiny_pool_async"].llm_engine
    ids = [f"{where}-{i}" for i in range(len(prompts))]
    for request_id, prompt, sp in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, sp)
    owner, name = {"launch": (engine.executor, "execute_model"), "read_back": (engine.scheduler, "update_from_output"),
                   "grammar_masks": (engine.intake.grammars, "bitmask")}[where]
    original, calls = getattr(owner, name), iter(range(1, 10**6))

    def failing(*args, **kwargs):
        if next(calls) in (2, 5, 9, 14):
            raise RuntimeError("a bug")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    finished, failures = {}, 0
    for _ in range(500):  # a wedged engine fails the test, not hangs it
        if not engine.has_unfinished_requests():
            break
        try:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        except RuntimeError as error:
            assert str(error) == "a bug"
            failures += 1
    assert failures == 4 and not engine.has_unfinished_requests()
    got = [finished[request_id] for request_id in ids]
    assert_same_outputs(want, got, f"failing {where}")
    check_all(replay, got, params, f"failing {where}")


def test_constrained_requests_with_lora_adapters_under_a_tiny_pool(tiny_llama_dir, replay, tmp_path_factory):
    """Constrained requests spread over two adapters and the base model: on one device slot (the
    adapters take turns, sequences held back) with a tiny pool that preempts, the outputs are those
    of an engine with two slots and room for all, and each holds its constraint."""
    from support.lora_adapters import save_adapter
    from tokenmill.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("grammar_lora")
    adapters = [None] + [LoRARequest(f"a{i}", i, str(save_adapter(tiny_llama_dir, root / f"a{i}", seed=i, r=8, lora_alpha=16)))
                         for i in (1, 2)]
    prompts, params = workload(5, replay.tokenizer)
    chosen = [adapters[i % 3] for i in range(len(prompts))]
    roomy = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, **OPTIONS)
    tight = make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, num_gpu_blocks_override=7, max_num_batched_tokens=19,
                     async_scheduling=True, **OPTIONS)
    want = roomy.generate(prompts, params, lora_request=chosen, use_tqdm=False)
    got = tight.generate(prompts, params, lora_request=chosen, use_tqdm=False)
    check_all(replay, want, params, "two slots")
    assert_same_outputs(want, got, "one slot, tiny pool")
    assert tight.llm_engine.scheduler.num_preemptions > 0
    base = roomy.generate(prompts, params, use_tqdm=False)  # the adapters do change the outputs
    assert [c.token_ids for o in base for c in o.outputs] != [c.token_ids for o in want for c in o.outputs]
