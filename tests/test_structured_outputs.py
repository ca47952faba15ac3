"""Structured outputs (xgrammar): every constrained output must parse and satisfy its constraint,
checked with jsonschema and re, on a tiny random Llama (random weights: the constraint does all
the work) and on the real built-in SmolLM2."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from test_generate import make_llm
from tokenmill import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog", "owl"]},
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=16, kv_cache_memory_bytes=128 * 2**20)


def constrained(llm, prompts, structured, n=1, max_tokens=120, seed=0):
    params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, structured_outputs=structured)
    return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "nested"])
def test_json_schema_outputs_validate_on_a_random_model(tiny, schema):
    outputs = constrained(tiny, ["a", "b c", "d e f"], StructuredOutputsParams(json=schema), n=3)
    for out in outputs:
        assert out.finish_reason == "stop", out.text  # the grammar completed, not cut by max_tokens
        jsonschema.validate(json.loads(out.text), schema)


def test_an_objects_properties_come_in_the_schemas_order(tiny):
    """As in vLLM (xgrammar given the schema as written): here the order is not alphabetical."""
    schema = {"type": "object", "properties": {"model": {"type": "boolean"}, "car_type": {"enum": ["SUV", "Truck"]},
                                               "brand": {"type": "integer"}}, "required": ["model", "car_type", "brand"]}
    for out in constrained(tiny, ["a", "b c"], StructuredOutputsParams(json=schema), n=2):
        assert list(json.loads(out.text)) == ["model", "car_type", "brand"], out.text


def test_regex_and_choice_outputs_match_on_a_random_model(tiny):
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    for out in constrained(tiny, ["x", "yy"], StructuredOutputsParams(regex=pattern), n=4):
        assert re.fullmatch(pattern, out.text), out.text
    choices = ["red", "green apple", "blue"]
    picked = {out.text for out in constrained(tiny, ["x", "yy"], StructuredOutputsParams(choice=choices), n=6)}
    assert picked <= set(choices) and picked


def test_grammar_and_older_guided_decoding_spelling(tiny):
    grammar = 'root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]'
    for out in constrained(tiny, ["q"], GuidedDecodingParams(grammar=grammar), n=3):
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", out.text), out.text
    params = SamplingParams(guided_decoding=StructuredOutputsParams(regex="[ab]{3}"), seed=2)
    assert params.structured_outputs.regex == "[ab]{3}" and params.guided_decoding is None
    assert re.fullmatch("[ab]{3}", tiny.generate(["q"], params, use_tqdm=False)[0].outputs[0].text)


@pytest.mark.parametrize("extra", [dict(min_tokens=3), dict(bad_words=["Q"]), dict(logits_processors=[lambda ids, logits: logits])],
                         ids=["min_tokens", "bad_words", "processor"])
def test_grammars_combine_with_bans_and_python_processors(tiny, extra):
    """A grammar row's draw runs after the step's launch has returned (its masks wait for the
    previous token): the bans and processors that write into the logits work there too."""
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern),
                            **extra)
    out = tiny.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(pattern, out.text) and "Q" not in out.text, out.text


def test_a_token_the_grammar_rejects_ends_its_request_with_an_error(tiny):
    """Once "y" is out the choice's grammar allows only eos, which min_tokens holds back: nothing is
    left to draw from, the draw takes a token outside the grammar and, as in vLLM, that request
    ends with finish_reason "error" (not a "stop" whose token ids break the constraint); the
    request beside it runs on."""
    bad = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, structured_outputs=StructuredOutputsParams(choice=["y"]))
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    other, failed = tiny.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 5 and other.error is None
    out = failed.outputs[0]
    assert out.finish_reason == "error" and out.text == "y" and len(out.token_ids) == 2, out
    assert re.match(r"token \d+ at output position 1 breaks the structured_outputs constraint", failed.error)


def test_a_grammar_that_leaves_nothing_gives_the_token_drawn_outside_it_a_logprob_of_minus_inf(tiny):
    """After "a" the choice needs "b", a stop id the grammar holds back until the constraint is
    complete: the grammar allows nothing, the request ends with "error", and the token drawn outside
    it has the logprob the grammar's distribution gives it, -inf, not log(0 / 0) (a NaN, which
    also made the cumulative logprob NaN)."""
    b = tiny.get_tokenizer().encode("b", add_special_tokens=False)[0]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=0, max_tokens=8, logprobs=1, stop_token_ids=[b],
                                structured_outputs=StructuredOutputsParams(choice=["abc"]))
        out = tiny.generate(["x"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "error" and out.text.startswith("a") and len(out.token_ids) == 2, out
        assert "the constraint needed one of stop_token_ids there" in tiny.generate(["x"], params, use_tqdm=False)[0].error
        assert out.logprobs[0][out.token_ids[0]].logprob == 0.0  # the only token the grammar allowed
        assert out.logprobs[1][out.token_ids[1]].logprob == float("-inf") and out.cumulative_logprob == float("-inf")


def test_each_distinct_constraint_compiles_once(tiny):
    sizes = []
    for _ in range(2):
        for schema in SCHEMAS[:2]:
            constrained(tiny, ["a"], StructuredOutputsParams(json=dict(schema)), max_tokens=60)
        sizes.append(tiny.llm_engine.intake.grammars.cache_size_bytes())
    assert sizes[0] > 0 and sizes[1] == sizes[0]  # the second round compiled nothing new


def test_compiled_grammars_are_kept_within_a_bound(tiny):
    """A job whose rows bring distinct schemas must not keep every compiled grammar: the cache
    evicts the least recently used beyond its byte limit, and an evicted constraint recompiles."""
    from tokenmill.structured_outputs import GrammarCache

    limit = 200_000
    cache = GrammarCache(tiny.get_tokenizer(), tiny.llm_engine.config.vocab_size, cache_limit_bytes=limit)
    schemas = [{"type": "object", "properties": {f"field{i}": {"type": "string"}}, "required": [f"field{i}"]}
               for i in range(40)]
    for schema in schemas:
        cache.matcher(StructuredOutputsParams(json=schema))
    assert 0 < cache.cache_size_bytes() <= limit
    matcher = cache.matcher(StructuredOutputsParams(json=schemas[0]))  # evicted long ago: compiled again
    assert matcher.accept_string('{"field0": "x"}') and matcher.is_completed()  # xgrammar's compact form


def test_a_constraint_that_does_not_compile_names_its_request_and_the_reason(tiny):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: structured_outputs\.regex does not compile: Regex parsing error .*parenthesis"
                                         r".*\(regex='\(unclosed'\)$"):  # the value too: a job's rows each bring their own
        tiny.generate(["fine", "broken"], [good, bad], use_tqdm=False)
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "a" | '))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar does not compile: .*\(grammar='root ::= \"a\" \| '\)$"):
        tiny.generate(["broken"], grammar, use_tqdm=False)
    assert tiny.generate(["fine"], good, use_tqdm=False)[0].outputs[0].token_ids  # the engine is unharmed


@pytest.mark.parametrize("constraint, reason", [
    (dict(json="{not json"), r"json does not compile: Failed to parse JSON"),
    (dict(structural_tag="nonsense"), r"structural_tag does not compile: it is not JSON \(Expecting value"),
    (dict(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'),
     r"structural_tag does not compile: the older form is \{\"structures\": \[\{\"begin\": \.\.\., \"schema\""),
], ids=["json-string", "tag-not-json", "older-tag-without-schema"])
def test_refusals_say_what_is_wrong_with_the_constraint(tiny, constraint, reason):
    """Not a bare KeyError's "'schema'", nor xgrammar's internal "Check failed: (...) is false"."""
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=rf"prompts\[0\]: structured_outputs\.{reason}") as raised:
        tiny.generate(["x"], bad, use_tqdm=False)
    assert "Check failed" not in str(raised.value)


@pytest.mark.parametrize("schema, where, what", [
    ({"type": "number", "multipleOf": 0.5}, "#", "multipleOf"),  # xgrammar enforces it on integers only
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "#", "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "#", "contains"),  # xgrammar took [] and refused [1]
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a", "not"),
    ({"type": "string", "if": {"maxLength": 1}, "then": {"pattern": "^a$"}}, "#", "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}, "#", "dependentRequired"),
    ({"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}, "#/items", "maxLength"),
    ({"type": "string", "format": "colour"}, "#", "format"),
    ({"type": "object", "properties": {"b": {"type": "integer"}}, "propertyNames": {"pattern": "^a"}}, "#", "propertyNames"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 4}, "#", "maximum"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "#", "required"),
], ids=["multipleOf", "uniqueItems", "contains", "not", "if", "dependentRequired", "pattern-and-length", "format",
        "propertyNames", "ref-sibling", "required-unknown"])
def test_json_schema_keywords_xgrammar_would_ignore_are_refused(tiny, schema, where, what):
    """xgrammar compiles these schemas without a word but does not hold outputs to the keyword (the
    grammar is the one it makes without it), so a "stop" output could break its own schema; as
    vLLM's xgrammar backend (has_xgrammar_unsupported_json_features), they are refused up front."""
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=rf"prompts\[0\]: structured_outputs\.json is not supported: at {where}, "
                                         rf"{what}\b.*xgrammar"):
        tiny.generate(["x"], bad, use_tqdm=False)
    assert not tiny.llm_engine.has_unfinished_requests()


def test_json_schema_keywords_xgrammar_enforces_still_run(tiny):
    """Names that look like the refused keywords where they are data, and the forms xgrammar holds to."""
    schemas = [
        {"type": "object", "properties": {"not": {"type": "integer"}, "format": {"enum": ["if"]}}, "required": ["not", "format"]},
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 99},
        {"type": "string", "format": "date"}, {"type": "string", "maxLength": 3},
        {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "description": "a number"},
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": False, "maxItems": 2},
    ]
    for schema in schemas:
        for out in constrained(tiny, ["a"], StructuredOutputsParams(json=schema), n=2, max_tokens=40):
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text, strict=False), schema)


def test_a_dict_from_a_batch_row_becomes_structured_outputs_params():
    params = SamplingParams.from_optional(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


@pytest.mark.parametrize("field, value, message", [
    ("regex", None, r"needs exactly one of .*; got none"),  # compiled an any-JSON-object grammar before
    ("choice", ["yes", "no"], r"needs exactly one of .*; got \['regex', 'choice'\]"),  # the regex alone was used
    ("disable_any_whitespace", "no", r"disable_any_whitespace='no' is invalid: must be True or False"),
])
def test_a_constraint_changed_after_construction_is_checked_again(tiny, field, value, message):
    structured = StructuredOutputsParams(regex="[0-9]+")
    setattr(structured, field, value)
    params = SamplingParams(max_tokens=4, structured_outputs=structured)
    with pytest.raises(ValueError, match=rf"prompts\[1\]: StructuredOutputsParams.*{message}"):
        tiny.generate(["fine", "changed"], [SamplingParams(max_tokens=4), params], use_tqdm=False)
    assert not tiny.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"), ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"choice": []}, r"choice=\[\] is invalid"),
    # Types: each was taken and failed later (xgrammar's message) or ran as something else ("yes" as True).
    ({"regex": 5}, "regex=5 is invalid: must be a string"), ({"grammar": ["root ::= 'a'"]}, "grammar=.* must be a string"),
    ({"json": [1]}, r"json=\[1\] is invalid: must be a JSON schema: a dict or a JSON string"),
    ({"json_object": "yes"}, "json_object='yes' is invalid: must be None, True or False"),
])
def test_malformed_structured_outputs_params(kwargs, message):
    with pytest.raises(ValueError, match=f"StructuredOutputsParams.*{message}"):
        StructuredOutputsParams(**kwargs)


def test_json_schema_on_the_builtin_model():
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=512, seed=0)
    schema = SCHEMAS[0]
    convo = [{"role": "user", "content": "Describe a person and their pet as JSON."}]
    params = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=100, structured_outputs=StructuredOutputsParams(json=schema))
    for out in llm.chat([convo], params, use_tqdm=False)[0].outputs:
        jsonschema.validate(json.loads(out.text), schema)
    choice = StructuredOutputsParams(choice=["positive", "negative"])
    reply = llm.chat([[{"role": "user", "content": "Is 'I love it' positive or negative?"}]],
                     SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice), use_tqdm=False)
    assert reply[0].outputs[0].text in {"positive", "negative"}
    anything = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=StructuredOutputsParams(json_object=True))
    ask = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    out = llm.chat([ask], anything, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


TAGGED = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize("tag", [
    {"structures": [{"begin": "<f>", "schema": TAGGED, "end": "</f>"}], "triggers": ["<f>"]},  # vLLM's older form
    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"],
                                          "tags": [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": TAGGED},
                                                    "end": "</f>"}]}},
], ids=["structures", "format"])
def test_structural_tags_constrain_only_the_tagged_sections(tiny, tag):
    """vLLM's structural_tag: free text, where each trigger opens a section held to its schema
    (xgrammar's matcher says which strings the compiled tag accepts)."""
    from tokenmill.structured_outputs import GrammarCache

    cache = GrammarCache(tiny.get_tokenizer(), tiny.llm_engine.config.vocab_size)
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    assert cache.matcher(params).accept_string('free text <f>{"x": 12}</f> and more')
    assert not cache.matcher(params).accept_string('free text <f>{"y": 12}')
    out = tiny.generate(["a"], SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=params),
                        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 1  # runs through the engine (random text rarely reaches a trigger)


def test_vllms_other_structured_output_options(tiny):
    assert StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True, disable_additional_properties=True)
    with pytest.raises(ValueError, match=r"whitespace_pattern='\[ \]\*' is not supported"):
        StructuredOutputsParams(regex="a+", whitespace_pattern="[ ]*")
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object, structural_tag"):
        StructuredOutputsParams(regex="a", structural_tag="{}")
    # An empty schema is a schema: beside a regex it is two constraints (the regex was dropped silently).
    with pytest.raises(ValueError, match=r"exactly one of .*; got \['json', 'regex'\]"):
        StructuredOutputsParams(json={}, regex="[0-9]+")
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag='{"structures": [{"begin": "<f>"}]}'))
    with pytest.raises(ValueError, match=r"prompts\[0\]: structured_outputs\.structural_tag does not compile"):
        tiny.generate(["a"], bad, use_tqdm=False)


def test_a_steps_matchers_advance_together_as_one_by_one(tiny):
    """The batch matcher (a step's masks filled together on xgrammar's threads) against
    xgrammar's single-matcher calls on twin matchers: rows without a matcher or with a completed
    one allow everything, the others get their own masks, step after step."""
    import random

    import torch
    import xgrammar

    from tokenmill.structured_outputs import GrammarCache

    vocab = tiny.llm_engine.config.vocab_size
    cache = GrammarCache(tiny.get_tokenizer(), vocab)
    constraints = [StructuredOutputsParams(json=SCHEMAS[0]), StructuredOutputsParams(regex=r"[a-z]{2,40}"),
                   StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(json=SCHEMAS[1])]
    batch = [None, *(cache.matcher(c) for c in constraints), None]
    twins = [None, *(cache.matcher(c) for c in constraints), None]
    eos = tiny.get_tokenizer().eos_token_id
    for matcher in (batch[3], twins[3]):  # the choice completed and its stop token taken
        assert matcher.accept_string("yes") and matcher.accept_token(eos) and matcher.is_terminated()
    rng = random.Random(0)
    for _ in range(12):
        mask = cache.bitmask(batch)
        expected = xgrammar.allocate_token_bitmask(len(twins), vocab)
        for row, twin in enumerate(twins):
            if twin is not None and not twin.is_terminated():
                twin.fill_next_token_bitmask(expected, row)
        assert torch.equal(mask, expected)
        staging = torch.randint(-2**31, 2**31 - 1, (len(batch) + 2, mask.shape[1]), dtype=torch.int32)
        assert torch.equal(cache.bitmask(batch, out=staging), mask)  # into a reused, poisoned buffer
        assert (mask[0] == -1).all() and (mask[3] == -1).all() and (mask[1] != -1).any()
        allowed = ((mask[:, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :vocab]
        live = [row for row, m in enumerate(batch) if m is not None and not m.is_terminated()]
        tokens = [rng.choice(allowed[row].nonzero().flatten().tolist()) for row in live]
        for row, token in zip(live, tokens):
            assert batch[row].accept_token(token) and twins[row].accept_token(token)
        assert [m is None or m.is_terminated() for m in batch] == [t is None or t.is_terminated() for t in twins]


def test_an_engine_with_grammars_is_freed_by_reference_counting(tiny_llama_dir):
    """A dropped LLM goes at once, grammars wired in or not (on a GPU its weights and KV cache, with
    tensor parallelism its worker processes): no part of the engine may point back at the engine
    or at a part that points at it (a cycle waits for a full collection)."""
    import gc
    import weakref

    llm = make_llm(tiny_llama_dir, max_num_seqs=4)
    constrained(llm, ["a", "b"], StructuredOutputsParams(regex="[ab]{3}"), max_tokens=8)
    engine = weakref.ref(llm.llm_engine)
    parts = [weakref.ref(part) for part in (llm.llm_engine.scheduler, llm.llm_engine.intake, llm.llm_engine.executor)]
    gc.collect()
    gc.disable()
    try:
        del llm
        assert engine() is None and all(part() is None for part in parts)
    finally:
        gc.enable()


def test_the_batch_matcher_takes_half_the_cpus_this_process_may_use(tiny, monkeypatch):
    """Not xgrammar's "auto" (half the host's hardware threads, whatever the process may use)."""
    import os

    import xgrammar

    from tokenmill.structured_outputs import GrammarCache

    asked = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(xgrammar, "BatchGrammarMatcher", lambda max_threads: asked.append(max_threads))
    GrammarCache(tiny.get_tokenizer(), tiny.llm_engine.config.vocab_size)
    assert asked == [8]


def test_padding_ids_past_the_tokenizer_are_masked_as_xgrammar_masks_them(tiny):
    """A model vocabulary wider than its tokenizer's (a padded lm_head): xgrammar sees only the
    tokenizer's ids (told the model's size it takes every padding id for a special token and slows
    down with their number), and the masks equal xgrammar's own over the model's vocabulary, step
    after step: padding never allowed on a constrained row, everything on an unconstrained one."""
    import random

    import torch
    import xgrammar

    from tokenmill.structured_outputs import GrammarCache

    tokenizer = tiny.get_tokenizer()
    vocab = len(tokenizer.get_vocab()) + 300  # 589: the tokenizer's last word partly padding
    cache = GrammarCache(tokenizer, vocab)
    assert cache.grammar_vocab_size == len(tokenizer.get_vocab())
    reference = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    # Free text allows every id of the tokenizer: xgrammar sets its whole last word, padding bits too.
    constraints = [StructuredOutputsParams(json=SCHEMAS[0]), StructuredOutputsParams(json=SCHEMAS[2]),
                   StructuredOutputsParams(regex=r"[\s\S]{0,40}")]
    batch = [cache.matcher(c) for c in constraints] + [None]
    twins = [xgrammar.GrammarMatcher(reference.compile_regex(c.regex) if c.regex else
                                     reference.compile_json_schema(c.key[1], any_whitespace=False)) for c in constraints]
    rng = random.Random(1)
    for _ in range(15):
        mask = cache.bitmask(batch)
        expected = xgrammar.allocate_token_bitmask(len(batch), vocab)
        for row, twin in enumerate(twins):
            if not twin.is_terminated():
                twin.fill_next_token_bitmask(expected, row)
        # Into a reused buffer (the GPU's pinned staging), left poisoned by an earlier step.
        staging = torch.randint(-2**31, 2**31 - 1, (6, mask.shape[1]), dtype=torch.int32)
        assert torch.equal(cache.bitmask(batch, out=staging), mask)
        live_rows = [row for row, m in enumerate(batch) if m is not None and not m.is_terminated()]
        staging.random_(-2**31, 2**31 - 1)
        assert torch.equal(cache.bitmask([batch[row] for row in live_rows], out=staging), mask[live_rows])  # all constrained
        allowed = ((mask[:, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :vocab]
        # Bits past the model's vocabulary are no ids (xgrammar sets them in free text).
        assert torch.equal(allowed, ((expected[:, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :vocab])
        assert not allowed[:3, cache.grammar_vocab_size:].any() and allowed[3].all()
        live = [row for row, m in enumerate(batch[:3]) if not m.is_terminated()]
        tokens = [rng.choice(allowed[row].nonzero().flatten().tolist()) for row in live]
        for row, token in zip(live, tokens):
            assert batch[row].accept_token(token) and twins[row].accept_token(token)


def test_grammar_masks_in_the_logits_own_dtype_draw_as_a_float32_copy_would(tiny_llama_dir):
    """The mask goes into bfloat16 logits in place (no float32 copy of [rows, V] a step): the same
    draws as the same engine handed float32 logits, and every output valid."""
    import torch

    llm = make_llm(tiny_llama_dir, dtype="bfloat16", max_num_seqs=8)
    prompts = ["a", "b c", "d e f", "g"]
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))
    own = llm.generate(prompts, params, use_tqdm=False)
    model = llm.llm_engine.executor.runner.model
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: compute_logits(hidden).float()
    try:
        as_float32 = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.compute_logits = compute_logits
    assert compute_logits(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert [c.token_ids for o in own for c in o.outputs] == [c.token_ids for o in as_float32 for c in o.outputs]
    for completion in (c for o in own for c in o.outputs):
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])


def test_a_stop_token_id_ends_a_constrained_output_only_where_the_constraint_is_complete(tiny):
    """As vLLM's xgrammar backend (its issue 42403): the request's stop_token_ids and the model's eos
    ids are the grammar's stop tokens, allowed only where the constraint may end. "b" is text to
    xgrammar: it stayed allowed mid-way and ended outputs there ("stop" with "ab" of "[ab]{4}").
    The reference: a matcher of xgrammar's own compiler told the same stop tokens. A stop id that
    spells the constraint's last character ends it too (xgrammar takes it as both); its text stays
    out of the output, as any stop id's (vLLM's detokenizer)."""
    import xgrammar

    tokenizer = tiny.get_tokenizer()
    b, eos = tokenizer.encode("b", add_special_tokens=False)[0], tokenizer.eos_token_id
    regex = "[ab]{4}"
    params = SamplingParams(temperature=1.0, seed=1, n=6, max_tokens=10, stop_token_ids=[b],
                            structured_outputs=StructuredOutputsParams(regex=regex))
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer)).compile_regex(regex)
    for out in tiny.generate(["x"], params, use_tqdm=False)[0].outputs:
        assert out.finish_reason == "stop" and out.stop_reason in (None, b), out
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=[eos, b])
        assert all(matcher.accept_token(t) for t in out.token_ids) and matcher.is_terminated(), out
        assert out.text in ("aaaa", "aaa" if out.token_ids[-1] == b else None), out
