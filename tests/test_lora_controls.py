"""LoRA adapters: the engine's adapter controls (add / list / pin / remove, a pinned adapter's slot)
and every refusal (bad adapters, bad settings, LoRA without enable_lora, pooling models), each checked
to leave the engine serving the next good request. The adapters, fixtures and HF + PEFT comparison
are tests/test_lora.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.lora_adapters import (
    adapter_config, adapter_tensors, copy_adapter, make_adapter, peft_greedy, save_adapter, write_adapter,
)
from test_generate import as_inputs, random_prompts
# adapter, llama, lora_root and requests are test_lora's fixtures, shared (their names are parameters below).
from test_lora import (  # noqa: F401
    GREEDY, OPTIONS, VOCAB, adapter, assert_matches_peft, llama, lora_request, lora_root, make_llm, requests,
)
from tokenmill import LLM, BeamSearchParams


def test_add_list_pin_and_remove_lora(tiny_llama_dir, requests, lora_root):
    """add_lora validates and loads ahead (True); list_loras holds the ids added or used; pin_lora and
    remove_lora are True for a known id only. With A pinned in one of two slots, B and C take turns in
    the other and every output stays right; a removed adapter is loaded again from its folder when a
    request names it."""
    llm = make_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=4)
    engine = llm.llm_engine
    a, b, c = requests["A"], requests["B"], requests["C"]
    assert engine.list_loras() == set()
    assert engine.add_lora(a) is True
    assert engine.list_loras() == {a.lora_int_id}
    assert engine.pin_lora(a.lora_int_id) is True
    assert engine.pin_lora(99) is False
    assert engine.remove_lora(99) is False
    missing = lora_root / "never_made"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        engine.add_lora(lora_request("missing", 98, missing))
    assert engine.list_loras() == {a.lora_int_id}

    prompts = random_prompts(VOCAB, [7, 20, 11, 26], seed=18)
    per_prompt = [b, c, None, a]
    assert_matches_peft(tiny_llama_dir, llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt),
                        prompts, per_prompt)
    assert engine.list_loras() == {a.lora_int_id, b.lora_int_id, c.lora_int_id}

    assert engine.remove_lora(b.lora_int_id) is True
    assert engine.remove_lora(b.lora_int_id) is False
    assert engine.list_loras() == {a.lora_int_id, c.lora_int_id}
    per_prompt = [a, b, c, b]
    assert_matches_peft(tiny_llama_dir, llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt),
                        prompts, per_prompt)
    assert engine.list_loras() == {a.lora_int_id, b.lora_int_id, c.lora_int_id}


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_adapter_keeps_its_slot(tiny_llama_dir, requests, monkeypatch, pinned):
    """Two slots; A, then B, then C, then A again, one request each. Pinned, A keeps its slot: C is
    loaded over B (though A was used longer ago) and A's second request loads nothing. Unpinned (the
    control), the slot used longest ago goes, so A is loaded again. White-box: the loads are the
    executor's "load_lora" calls (every rank loads a slot through them)."""
    llm = make_llm(tiny_llama_dir, max_loras=2)
    executor = llm.llm_engine.executor
    loads: list[tuple[int, int]] = []  # (slot, lora_int_id)
    original = executor.collective_rpc

    def recording(method, timeout=None, args=(), kwargs=None):
        if method == "load_lora":
            slot, spec = args
            loads.append((slot, spec.lora_int_id))
        return original(method, timeout=timeout, args=args, kwargs=kwargs)

    monkeypatch.setattr(executor, "collective_rpc", recording)
    a, b, c = requests["A"], requests["B"], requests["C"]
    if pinned:
        assert llm.llm_engine.add_lora(a) is True and llm.llm_engine.pin_lora(a.lora_int_id) is True
    prompt = random_prompts(VOCAB, [9], seed=22)
    for req in (a, b, c, a):
        assert_matches_peft(tiny_llama_dir, llm.generate(as_inputs(prompt), GREEDY, use_tqdm=False, lora_request=req),
                            prompt, [req])
    ids = [lora_id for _, lora_id in loads]
    slot = dict((lora_id, s) for s, lora_id in loads)
    if pinned:
        assert ids == [a.lora_int_id, b.lora_int_id, c.lora_int_id], loads
        assert slot[c.lora_int_id] == slot[b.lora_int_id] != slot[a.lora_int_id], loads
    else:
        assert ids == [a.lora_int_id, b.lora_int_id, c.lora_int_id, a.lora_int_id], loads


# --- refusals -----------------------------------------------------------------------------------


def _bad_adapter(case: str, root: Path, base: Path, good: Path) -> tuple[Path, list[str]]:
    """The adapter folder of a refusal case and the patterns its error message must contain."""
    out = root / f"bad_{case}"
    if case == "missing_folder":
        return out, [re.escape(str(out))]
    if case == "no_adapter_config":
        out.mkdir(exist_ok=True)
        (out / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        return out, [re.escape(str(out))]
    if case == "rank_over_max_lora_rank":
        return save_adapter(base, out, seed=21, r=32, lora_alpha=32), [r"\b32\b", "max_lora_rank"]
    if case == "dora":
        return save_adapter(base, out, seed=22, use_dora=True), ["use_dora"]
    if case == "bias":
        return save_adapter(base, out, seed=23, bias="all"), ["bias", "all"]
    if case == "modules_to_save":
        return save_adapter(base, out, seed=24, modules_to_save=["lm_head"]), ["modules_to_save", "lm_head"]
    if case in ("embed_tokens", "lm_head"):  # as PEFT saves them: with the base layer's weight
        other = {"embed_tokens": "q_proj", "lm_head": "v_proj"}[case]
        return save_adapter(base, out, seed=25, target_modules=[other, case]), [case]
    if case in ("embed_tokens_lora_only", "lm_head_lora_only"):  # save_embedding_layers=False: LoRA tensors only
        module = case.removesuffix("_lora_only")
        full = _bad_adapter(module, root, base, good)[0]
        return copy_adapter(full, out, drop="base_layer"), [module]
    if case == "one_tensor_misshapen":
        name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        wrong = torch.zeros(adapter_tensors(good)[name].shape[0] + 8, 16)
        return copy_adapter(good, out, tensor_changes={name: wrong}), [r"layers\.1\.self_attn\.v_proj", "lora_B"]
    if case == "other_hidden_size":
        from transformers import AutoModelForCausalLM, LlamaConfig

        from support.tiny_models import tiny_config_kwargs

        if not out.exists():
            other = AutoModelForCausalLM.from_config(LlamaConfig(**tiny_config_kwargs(hidden_size=48, tie_word_embeddings=False)))
            make_adapter(other, out, seed=27)
        return out, [r"layers\.\d+\.(self_attn|mlp)\.[a-z]+_proj"]
    if case == "rank_zero":  # was a ZeroDivisionError
        tensors = adapter_tensors(good)
        name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        a, b = tensors[name], tensors[name.replace("lora_A", "lora_B")]
        changes = {name: a[:0], name.replace("lora_A", "lora_B"): b[:, :0]}
        return copy_adapter(good, out, tensor_changes=changes), [r"layers\.0\.self_attn\.q_proj", r"rank 0\b"]
    if case == "integer_tensors":  # were cast to the model's dtype and run
        changes = {"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": torch.ones(16, 64, dtype=torch.int8)}
        return copy_adapter(good, out, tensor_changes=changes), [r"layers\.1\.mlp\.up_proj\.lora_A", "I8", "floating"]
    if case in CONFIG_CASES:  # adapter_config.json's text replaced, or some of its fields
        change = CONFIG_CASES[case]
        if isinstance(change[0], dict):
            return copy_adapter(good, out, config_changes=change[0]), change[1]
        copy_adapter(good, out)
        (out / "adapter_config.json").write_bytes(change[0])
        return out, change[1]
    raise AssertionError(case)


# Case -> (fields replaced, or the file's bytes; patterns the message must hold). Each once escaped the
# checks as a TypeError / AttributeError / re.error (or ran with use_rslora="false" read as true).
CONFIG_CASES: dict[str, tuple] = {
    "config_not_an_object": (b"[]", ["adapter_config.json", "JSON object"]),
    "config_not_utf8": (b"\xff\xfe{}", ["adapter_config.json", "UTF-8"]),
    "lora_alpha_null": ({"lora_alpha": None}, ["lora_alpha=None", "number"]),
    "lora_alpha_text": ({"lora_alpha": "16"}, ["lora_alpha='16'", "number"]),
    "r_not_an_int": ({"r": 8.5}, [r"r=8\.5", "integer"]),
    "alpha_pattern_not_a_dict": ({"alpha_pattern": ["q_proj"]}, ["alpha_pattern", "q_proj"]),
    "alpha_pattern_bad_regex": ({"alpha_pattern": {"q_proj(": 4}}, ["alpha_pattern", r"q_proj\("]),
    "rank_pattern_bad_value": ({"rank_pattern": {"q_proj": "4"}}, ["rank_pattern", "'4'"]),
    "use_rslora_text": ({"use_rslora": "false"}, ["use_rslora='false'", "true or false"]),
    # LoRA variants with the usual tensors, whose forward is not plain LoRA's: they ran as plain LoRA.
    "alora": ({"alora_invocation_tokens": [5, 6]}, ["alora_invocation_tokens=\\[5, 6\\]", "aLoRA"]),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, ["layer_replication", "replicate"]),
    "bdlora": ({"use_bdlora": {"nblocks": 2}}, ["use_bdlora", "not supported"]),
    # PEFT cannot load it (its r sizes the tensors); it ran with lora_alpha / 16, vLLM's is lora_alpha / 8.
    "r_disagrees_with_the_tensors": ({"r": 8}, [r"\br=8\b", r"\b16\b", r"layers\.\d+\.(self_attn|mlp)\.[a-z]+_proj"]),
}
BAD_CASES = ["missing_folder", "no_adapter_config", "rank_over_max_lora_rank", "dora", "bias", "modules_to_save",
             "embed_tokens", "lm_head", "embed_tokens_lora_only", "lm_head_lora_only", "one_tensor_misshapen",
             "other_hidden_size", "rank_zero", "integer_tensors", *CONFIG_CASES]


@pytest.mark.parametrize("case", BAD_CASES)
def test_a_bad_adapter_is_refused_by_name_and_breaks_nothing(case, llama, tiny_llama_dir, adapter, lora_root, requests):
    """generate([good, bad]) raises a ValueError naming the field, value or tensor, before anything is
    queued; the bad id is not listed; then a good adapter (the q/v subset, whose slot must hold nothing
    of what was tried) still gives HF + PEFT's outputs."""
    folder, patterns = _bad_adapter(case, lora_root, tiny_llama_dir, adapter(tiny_llama_dir, "all"))
    bad = lora_request(f"bad-{case}", 100 + BAD_CASES.index(case), folder)
    prompts = random_prompts(VOCAB, [8, 5], seed=19)
    with pytest.raises(ValueError) as error:
        llama.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=[requests["A"], bad])
    message = str(error.value)
    if case not in ("missing_folder", "no_adapter_config"):  # the folder's name is not what these must name
        message = message.replace(str(folder), "<folder>")
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, str(error.value))
    assert not llama.llm_engine.has_unfinished_requests()
    assert bad.lora_int_id not in llama.llm_engine.list_loras()
    outputs = llama.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=requests["B"])
    assert_matches_peft(tiny_llama_dir, outputs, prompts, [requests["B"]] * 2)


@pytest.mark.parametrize("async_scheduling, tp", [(False, 1), (True, 1), (False, 2)])
def test_an_adapter_that_cannot_be_read_again_fails_only_its_own_requests(tiny_llama_dir, adapter, requests, tmp_path,
                                                                         async_scheduling, tp):
    """An adapter checked and used, then its folder deleted, then needed again from disk (one device
    slot, one adapter kept in CPU memory, another adapter in between): its requests end with
    finish_reason "error" and an error naming the adapter and the missing file, while the requests
    admitted beside them give HF + PEFT's outputs; a beam search with it ends with one "error"
    sequence. Forgotten by the engine, the adapter is checked anew by the next request that names it:
    refused while the folder is missing, served again once it is back. At TP=2 every rank fails the
    load, and the ranks stay in step."""
    folder = copy_adapter(adapter(tiny_llama_dir, "all"), tmp_path / "doomed")
    llm = make_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1, async_scheduling=async_scheduling, tensor_parallel_size=tp)
    try:
        _fail_and_recover(llm, tiny_llama_dir, folder, requests["B"], tmp_path)
    finally:
        llm.llm_engine.executor.shutdown()


def _fail_and_recover(llm, tiny_llama_dir: Path, folder: Path, b, tmp_path: Path) -> None:
    import shutil

    doomed = lora_request("doomed", 7, folder)
    prompts = random_prompts(VOCAB, [9, 14, 6, 11], seed=28)
    assert_matches_peft(tiny_llama_dir, llm.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False, lora_request=doomed),
                        prompts[:1], [doomed])
    llm.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False, lora_request=b)  # takes the slot and the CPU cache
    kept = tmp_path / "kept"
    shutil.move(folder, kept)

    per_prompt = [doomed, None, b, doomed]
    outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length", "length", "error"]
    for failed in (outputs[0], outputs[3]):
        assert failed.finished and failed.outputs[0].token_ids == [] and failed.lora_request is doomed
        assert "'doomed'" in failed.error and "could not be loaded" in failed.error
        assert "adapter_model.safetensors" in failed.error, failed.error
    assert_matches_peft(tiny_llama_dir, outputs[1:3], prompts[1:3], per_prompt[1:3])
    assert all(o.error is None for o in outputs[1:3])
    assert not llm.llm_engine.has_unfinished_requests() and doomed.lora_int_id not in llm.llm_engine.list_loras()

    with pytest.raises(ValueError, match=re.escape(str(folder))):
        llm.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False, lora_request=doomed)
    shutil.move(kept, folder)
    assert_matches_peft(tiny_llama_dir, llm.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False, lora_request=doomed),
                        prompts[:1], [doomed])

    llm.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False, lora_request=b)
    shutil.rmtree(folder)
    beams = llm.beam_search(as_inputs(prompts[:2]), BeamSearchParams(beam_width=2, max_tokens=4), lora_request=[doomed, b])
    assert [s.finish_reason for s in beams[0].sequences] == ["error"]
    assert beams[0].sequences[0].tokens == prompts[0]
    assert len(beams[1].sequences) == 2 and all(s.finish_reason in ("stop", "length") for s in beams[1].sequences)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_weights_fails_only_its_own_requests(llama, tiny_llama_dir, adapter, lora_root, requests,
                                                                        value):
    """One NaN or inf in an adapter's tensor (headers fine, so found when the tensors are read): its
    requests end with finish_reason "error" naming the tensor, and the requests beside it, of another
    adapter and of the base model, still give HF + PEFT's outputs. In a device slot it made every token
    of every step with an adapter NaN (the expand multiplies every token's zeroed columns by B, 0 * NaN
    is NaN), and stayed there.
    add_lora refuses it with a ValueError, leaving it unlisted."""
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    good = adapter(tiny_llama_dir, "all")
    broken = adapter_tensors(good)[name].clone()
    broken[3, 2] = value
    folder = copy_adapter(good, lora_root / f"non_finite_{value}", tensor_changes={name: broken})
    bad = lora_request(f"non-finite-{value}", 120 + int(value != value), folder)
    prompts = random_prompts(VOCAB, [8, 5, 11], seed=31)
    per_prompt = [requests["A"], bad, None]
    outputs = llama.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert name in outputs[1].error and "finite" in outputs[1].error, outputs[1].error
    assert_matches_peft(tiny_llama_dir, [outputs[0], outputs[2]], [prompts[0], prompts[2]], [per_prompt[0], None])
    assert bad.lora_int_id not in llama.llm_engine.list_loras()
    with pytest.raises(ValueError, match=re.escape(f"LoRA adapter {bad.lora_name!r} ({folder}): tensor {name!r}")):
        llama.llm_engine.add_lora(bad)
    assert bad.lora_int_id not in llama.llm_engine.list_loras()
    outputs = llama.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=[requests["B"], requests["A"], None])
    assert_matches_peft(tiny_llama_dir, outputs, prompts, [requests["B"], requests["A"], None])


def test_an_adapter_overflowing_fp16_leaves_the_other_tokens_of_its_steps_alone(tiny_llama_dir, adapter, lora_root,
                                                                                 requests):
    """Finite adapter weights so large that x A^T overflows fp16 (lora_A of one module at 3e4, lora_B
    at its usual size): the check at load passes them, and the step's shrink gives inf in that
    adapter's columns for every token. With the one-hot mask multiplied in, inf * 0 made every other
    token of the step NaN, whatever its adapter; the mask now selects instead. In an fp16 engine the
    requests beside the overflowing adapter's (another adapter's, the base model's) give the tokens
    and logprobs they give in a batch without it."""
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    good = adapter(tiny_llama_dir, "all")
    huge = torch.full_like(adapter_tensors(good)[name], 3e4)
    folder = copy_adapter(good, lora_root / "overflowing_fp16", tensor_changes={name: huge})
    big = lora_request("overflowing", 130, folder)
    prompts = random_prompts(VOCAB, [8, 5, 11], seed=33)
    llm = make_llm(tiny_llama_dir, dtype="float16", max_loras=2)
    try:
        alone = llm.generate(as_inputs([prompts[0], prompts[2]]), GREEDY, use_tqdm=False,
                             lora_request=[requests["A"], None])
        beside = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=[requests["A"], big, None])
    finally:
        llm.llm_engine.executor.shutdown()
    for want, got in zip(alone, [beside[0], beside[2]]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert [next(iter(step.values())).logprob for step in got.outputs[0].logprobs] == \
            [next(iter(step.values())).logprob for step in want.outputs[0].logprobs]


def test_only_the_adapters_own_load_errors_fail_its_requests():
    """AdapterBook.place names the adapter whose load raised (AdapterLoadError, which fails only its
    requests); the device running out of memory and dead tensor-parallel workers are no adapter's
    fault and pass through unchanged (the job stops or restarts its engine on them). The failed
    load leaves its slot free for the next adapter."""
    from tokenmill.distributed.worker_processes import WorkerDiedError
    from tokenmill.lora.adapter import AdapterSpec
    from tokenmill.lora.config import LoRAConfig
    from tokenmill.lora.slots import AdapterBook, AdapterLoadError

    raised: list[BaseException] = []
    loaded: list[tuple[int, str]] = []

    def load(slot: int, spec: AdapterSpec) -> None:
        if raised:
            raise raised.pop()
        loaded.append((slot, spec.name))

    book = AdapterBook(LoRAConfig(max_loras=1, max_rank=8, max_cpu_loras=1), {}, load)
    spec = AdapterSpec(3, "gone", "/nowhere", "/nowhere/adapter_model.safetensors", {}, uid=1)
    for fatal in (torch.cuda.OutOfMemoryError("CUDA out of memory"), WorkerDiedError("rank 1 exited")):
        raised.append(fatal)
        with pytest.raises(type(fatal)):
            book.place([spec])
    raised.append(FileNotFoundError("No such file or directory: /nowhere/adapter_model.safetensors"))
    with pytest.raises(AdapterLoadError, match=r"'gone' \(lora_int_id=3, /nowhere\) could not be loaded: FileNotFoundError") as error:
        book.place([spec])
    assert error.value.spec is spec
    other = AdapterSpec(4, "next", "/elsewhere", "/elsewhere/adapter_model.safetensors", {}, uid=2)
    assert book.place([other]) == {2: 0} and loaded == [(0, "next")]


def test_a_list_of_lora_requests_needs_one_per_prompt(llama, requests):
    prompts = random_prompts(VOCAB, [4, 6, 5], seed=20)
    for wrong in ([requests["A"]], [requests["A"], None, None, requests["B"]]):
        with pytest.raises(ValueError, match="lora_request"):
            llama.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=wrong)
    assert not llama.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("settings, field", [(dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras"),
                                             (dict(max_lora_rank=12), "max_lora_rank"),
                                             (dict(max_lora_rank=1024), "max_lora_rank"),
                                             (dict(lora_target_modules=["q_proj", "lm_head"]), "lora_target_modules"),
                                             (dict(lora_target_modules=[]), "lora_target_modules")])
def test_bad_lora_settings_are_refused(tiny_llama_dir, settings, field):
    """max_cpu_loras below max_loras, a max_lora_rank outside vLLM's list (1, 8, 16, ..., 512), and
    lora_target_modules naming something other than the seven projections (or their stacked names)."""
    with pytest.raises(ValueError, match=field):
        make_llm(tiny_llama_dir, **settings)


@pytest.fixture(scope="module")
def llama_without_lora(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **OPTIONS)


@pytest.mark.parametrize("method", ["generate", "chat", "enqueue", "beam_search", "add_request"])
def test_lora_request_without_enable_lora_is_refused(llama_without_lora, requests, method):
    """enable_lora=False (the default): a lora_request is refused naming enable_lora, nothing queued."""
    llm = llama_without_lora
    req, prompt = requests["A"], {"prompt_token_ids": [5, 6, 7]}
    calls = {
        "generate": lambda: llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=req),
        "chat": lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, lora_request=req),
        "enqueue": lambda: llm.enqueue([prompt], GREEDY, lora_request=req),
        "beam_search": lambda: llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3), lora_request=req),
        "add_request": lambda: llm.llm_engine.add_request("r0", prompt, GREEDY, lora_request=req),
    }
    with pytest.raises(ValueError, match="enable_lora"):
        calls[method]()
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("fixture, method, args", [("bert_embedder_llm", "embed", (["the cat sat"],)),
                                                   ("bert_classifier_llm", "classify", (["the cat sat"],)),
                                                   ("cross_encoder_llm", "score", ("the cat", "a dog"))])
def test_pooling_models_refuse_lora_request(fixture, method, args, request, requests):
    llm = request.getfixturevalue(fixture)
    with pytest.raises(ValueError, match="lora_request"):
        getattr(llm, method)(*args, use_tqdm=False, lora_request=requests["A"])


def test_lora_target_modules_adapts_only_the_projections_named(tiny_llama_dir, requests, lora_root):
    """lora_target_modules=["qkv_proj", "down_proj"] (a stacked name stands for its parts): only those
    layers get an update, and adapter A (all seven projections) gives HF + PEFT's tokens and logprobs
    for A with its o/gate/up tensors zeroed (those modules are left out, with a warning); an adapter
    of left-out modules only is refused."""
    a = requests["A"]
    llm = make_llm(tiny_llama_dir, lora_target_modules=["qkv_proj", "down_proj"])
    layer = llm.llm_engine.executor.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.lora is not None and layer.mlp.down_proj.lora is not None
    assert layer.self_attn.o_proj.lora is None and layer.mlp.gate_up_proj.lora is None
    tensors = adapter_tensors(Path(a.lora_path))
    left_out = ("o_proj", "gate_proj", "up_proj")
    zeroed = {name: torch.zeros_like(t) for name, t in tensors.items()
              if ".lora_B." in name and any(m in name for m in left_out)}
    reference = copy_adapter(Path(a.lora_path), lora_root / "A_without_o_gate_up", tensor_changes=zeroed)
    prompts = random_prompts(VOCAB, [7, 21], seed=23)
    # The left-out modules matter: all of A gives other tokens.
    assert any(peft_greedy(tiny_llama_dir, reference, p, GREEDY.max_tokens)[0]
               != peft_greedy(tiny_llama_dir, a.lora_path, p, GREEDY.max_tokens)[0] for p in prompts)
    for prompt, output in zip(prompts, llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=a)):
        tokens, logprobs = peft_greedy(tiny_llama_dir, reference, prompt, GREEDY.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert max(abs(x - y) for x, y in zip(ours, logprobs)) < 1e-4
    only_left_out = write_adapter(lora_root / "A_o_only", adapter_config(Path(a.lora_path)),
                                  {name: t for name, t in tensors.items() if ".o_proj." in name})
    with pytest.raises(ValueError, match="lora_target_modules allows"):
        llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=lora_request("o only", 9, only_left_out))
