"""LoRA adapters (PEFT folders) applied per request, against Hugging Face transformers + PEFT in fp32.

The adapters are made by peft itself with every lora_A / lora_B redrawn (tests/support/lora_adapters.py),
large enough that they change the greedy tokens (asserted first, so no comparison below is vacuous).
Greedy tokens must equal HF + PEFT's and logprobs be within 1e-4 (test_generate.py's standard): on
Llama and Qwen3 with an adapter on every projection, on a subset with per-module ranks and alphas, with
rsLoRA scaling; in batches mixing adapters and the base model with two device slots and with one (the
adapters then run in turns); across prefix-cache hits; under asynchronous scheduling; at tensor
parallel size 2; on mixture-of-experts models; through beam search, chat and enqueue. The engine's
adapter controls and every refusal: tests/test_lora_controls.py (with this module's fixtures).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from support.lora_adapters import (
    adapter_config,
    adapter_tensors,
    copy_adapter,
    peft_beam_search,
    peft_greedy,
    save_adapter,
    write_adapter,
)
from test_generate import as_inputs, random_prompts
from tokenmill import LLM, BeamSearchParams, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
ATOL = 1e-4  # logprobs against HF fp32, as in test_generate.py
VOCAB = 289  # the tiny tokenizer's (support/tiny_models.py)
PROMPT_LENGTHS = [3, 18, 37]
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=16 * 2**20, seed=0)

# The adapters, by kind: keyword arguments of support.lora_adapters.make_adapter.
ADAPTERS: dict[str, dict] = {
    # Every projection at the largest rank the engines allow (max_lora_rank=16).
    "all": dict(seed=1, r=16, lora_alpha=32),
    # q and v only; q_proj at rank 4 (rank_pattern), layer 1's v_proj at alpha 48 (alpha_pattern, a
    # layer-specific key): loaded after "all" into the same slot, a rank-4 or missing module must
    # leave nothing of the adapter before it.
    "subset": dict(seed=2, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 4},
                   alpha_pattern={"layers.1.self_attn.v_proj": 48}),
    # rsLoRA: scaling alpha / sqrt(r) = 2.83, not alpha / r = 1.
    "rslora": dict(seed=3, r=8, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
    # Mixture of experts: attention and a Qwen2-MoE shared expert's projections, not the routed experts.
    "moe": dict(seed=4, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                                                            "shared_expert.up_proj", "shared_expert.down_proj"]),
    "moe_attention": dict(seed=5, r=8, lora_alpha=16, std=0.2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


def lora_request(name: str, lora_id: int, path: Path):
    from tokenmill.lora.request import LoRARequest

    return LoRARequest(name, lora_id, str(path))


def make_llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), **{**OPTIONS, "enable_lora": True, **kwargs})


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_adapters")


@pytest.fixture(scope="module")
def adapter(lora_root: Path) -> Callable[[Path, str], Path]:
    """(base model folder, kind in ADAPTERS) -> the adapter's folder, made once."""
    return lambda base, kind: save_adapter(base, lora_root / f"{base.name}_{kind}", **ADAPTERS[kind])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(VOCAB, PROMPT_LENGTHS, seed=11)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    """Two device slots, prefix caching on (the default)."""
    return make_llm(tiny_llama_dir, max_loras=2)


@pytest.fixture(scope="module")
def llama_one_slot(tiny_llama_dir):
    """One device slot, so a batch's adapters run in turns; a small step budget chunks the prefills."""
    return make_llm(tiny_llama_dir, max_loras=1, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def requests(tiny_llama_dir, adapter):
    """The Llama adapters as LoRARequests: A (every projection), B (q/v subset), C (rsLoRA)."""
    return {name: lora_request(kind, i, adapter(tiny_llama_dir, kind))
            for i, (name, kind) in enumerate([("A", "all"), ("B", "subset"), ("C", "rslora")], start=1)}


def assert_matches_peft(base: Path, outputs, prompts: list[list[int]], requests: list) -> None:
    """Each output (of GREEDY) has HF + PEFT's greedy tokens with its own adapter (None: the base
    model), its logprobs within ATOL, and reports the LoRARequest it ran with."""
    assert len(outputs) == len(prompts) == len(requests)
    for prompt, output, req in zip(prompts, outputs, requests, strict=True):
        completion = output.outputs[0]
        ref_tokens, ref_logprobs = peft_greedy(base, None if req is None else req.lora_path, prompt, MAX_TOKENS)
        where = f"prompt of {len(prompt)} tokens, adapter {None if req is None else req.lora_name}"
        assert completion.token_ids == ref_tokens, where
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        worst = max(abs(a - b) for a, b in zip(ours, ref_logprobs, strict=True))
        assert worst < ATOL, (where, worst)
        assert output.prompt_token_ids == prompt
        assert_reports(output, req)


def assert_reports(output, req) -> None:
    """RequestOutput.lora_request is the request's LoRARequest (equality is by name only, so the id and
    the path too), None for the base model."""
    if req is None:
        assert output.lora_request is None
    else:
        assert output.lora_request == req
        assert (output.lora_request.lora_int_id, output.lora_request.lora_path) == (req.lora_int_id, req.lora_path)


# --- the references themselves ----------------------------------------------------------------


@pytest.mark.parametrize("base_fixture, kind", [("tiny_llama_dir", "all"), ("tiny_llama_dir", "subset"),
                                                ("tiny_llama_dir", "rslora"), ("tiny_qwen3_dir", "all"),
                                                ("tiny_qwen2_moe_dir", "moe"), ("tiny_qwen3_moe_dir", "moe_attention")])
def test_each_adapter_changes_the_greedy_tokens_of_every_prompt(base_fixture, kind, request, adapter, prompts, lora_root):
    """Every adapter the comparisons use changes HF + PEFT's greedy tokens on every prompt, so an
    engine that ignored it (or applied the wrong one) fails them; and for the subset and rsLoRA
    adapters, the scaling rule matters too: alpha_pattern ignored, or alpha / r for rsLoRA, changes them."""
    base = request.getfixturevalue(base_fixture)
    folder = adapter(base, kind)
    for prompt in prompts:
        assert peft_greedy(base, folder, prompt, MAX_TOKENS)[0] != peft_greedy(base, None, prompt, MAX_TOKENS)[0]
    wrong_scaling = {"subset": {"alpha_pattern": {}}, "rslora": {"use_rslora": False}}.get(kind)
    if wrong_scaling is not None:
        wrong = copy_adapter(folder, lora_root / f"{base.name}_{kind}_wrong_scaling", config_changes=wrong_scaling)
        assert any(peft_greedy(base, wrong, p, MAX_TOKENS)[0] != peft_greedy(base, folder, p, MAX_TOKENS)[0]
                   for p in prompts)


# --- the request --------------------------------------------------------------------------------


def test_lora_request_fields_equality_and_checks(tmp_path):
    """vLLM's LoRARequest: importable from tokenmill too; ids from 1 and a non-empty path required;
    equal and hashed by name only; adapter_id / name / path read its fields."""
    import tokenmill
    from tokenmill.lora.request import LoRARequest

    assert tokenmill.LoRARequest is LoRARequest
    req = LoRARequest("sql", 3, str(tmp_path))
    assert (req.adapter_id, req.name, req.path) == (3, "sql", str(tmp_path))
    assert (req.base_model_name, req.load_inplace) == (None, False)
    assert req == LoRARequest("sql", 4, "/elsewhere") and hash(req) == hash(LoRARequest("sql", 4, "/elsewhere"))
    assert req != LoRARequest("chat", 3, str(tmp_path))
    assert len({req, LoRARequest("sql", 5, "/x"), LoRARequest("chat", 6, "/x")}) == 2
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", 0, str(tmp_path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("sql", -2, str(tmp_path))
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("sql", 1, "")
    with pytest.raises(ValueError, match=r"lora_path=5 is invalid for LoRA adapter 'sql': must be the adapter's folder"):
        LoRARequest("sql", 1, 5)  # was a bare TypeError once the adapter was read


# --- outputs against HF + PEFT ------------------------------------------------------------------


@pytest.mark.parametrize("base_fixture, kind", [("tiny_llama_dir", "all"), ("tiny_llama_dir", "subset"),
                                                ("tiny_llama_dir", "rslora"), ("tiny_qwen3_dir", "all")])
def test_greedy_tokens_and_logprobs_match_peft(base_fixture, kind, request, adapter, prompts):
    """One adapter for every prompt (a single LoRARequest): tokens equal HF + PEFT's, logprobs within
    1e-4. Qwen3 adds q/k norms, attention biases and q_proj wider than the hidden size (head_dim 32)."""
    base = request.getfixturevalue(base_fixture)
    llm = request.getfixturevalue("llama") if base_fixture == "tiny_llama_dir" else make_llm(base, max_loras=1)
    req = lora_request(f"{base.name}-{kind}", 7 + list(ADAPTERS).index(kind), adapter(base, kind))
    outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=req)
    assert_matches_peft(base, outputs, prompts, [req] * len(prompts))


def test_numpy_integer_lora_ids_are_taken_as_vllm_takes_them(llama, tiny_llama_dir, adapter, prompts):
    """vLLM's LoRARequest (a msgspec Struct, never type-checked at construction) takes an id read from
    a numpy array or a DataFrame; tokenmill refused it. It runs as the Python int, against HF + PEFT;
    numpy bools and floats, and ids below 1, are still refused."""
    import numpy as np

    from tokenmill.lora.request import LoRARequest

    folder = str(adapter(tiny_llama_dir, "all"))
    req = LoRARequest("numpy-id", np.int64(90), folder)
    assert req.lora_int_id == 90 and type(req.lora_int_id) is int
    assert LoRARequest("numpy-uint", np.uint8(10), folder).lora_int_id == 10
    outputs = llama.generate(as_inputs(prompts[:2]), GREEDY, use_tqdm=False, lora_request=req)
    assert_matches_peft(tiny_llama_dir, outputs, prompts[:2], [req] * 2)
    assert 90 in llama.llm_engine.list_loras()
    for bad in (np.int64(0), np.bool_(True), np.float64(2.0), 2.0, True):
        with pytest.raises(ValueError, match=r"lora_int_id=.* is invalid: must be an integer > 0"):
            LoRARequest("bad-id", bad, folder)


@pytest.mark.parametrize("slots", [2, 1])
def test_a_batch_mixing_adapters_and_the_base_model(slots, request, tiny_llama_dir, requests):
    """Prompts with adapter A, adapter B and none interleaved in one generate call: each output is its
    own reference's. With one device slot the scheduler runs the adapters in turns (B is loaded over
    A: a rank-4 q_proj and no k/o/MLP modules, so any leftover of A shows)."""
    llm = request.getfixturevalue("llama" if slots == 2 else "llama_one_slot")
    prompts = random_prompts(VOCAB, [5, 23, 37, 9, 17, 30], seed=12)
    a, b = requests["A"], requests["B"]
    per_prompt = [a, b, None, b, None, a]
    outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert_matches_peft(tiny_llama_dir, outputs, prompts, per_prompt)
    assert not llm.llm_engine.has_unfinished_requests()


def test_prefix_cache_hits_never_cross_adapters(llama, tiny_llama_dir, requests):
    """The same 40-token prompt (two full 16-token blocks) with no adapter, then A, then B, then the
    base model and A again: each equals its own reference, so no request computed on another
    adapter's (or the base model's) cached keys and values; the repeats do hit their own blocks."""
    block = llama.llm_engine.config.block_size
    assert block == 16
    prompt = random_prompts(VOCAB, [40], seed=13)[0]  # no other test uses it
    order = [None, requests["A"], requests["B"], None, requests["A"]]
    outputs = [llama.generate(as_inputs([prompt]), GREEDY, use_tqdm=False, lora_request=req)[0] for req in order]
    for output, req in zip(outputs, order, strict=True):
        assert_matches_peft(tiny_llama_dir, [output], [prompt], [req])
    cached = [o.num_cached_tokens for o in outputs]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] == 0, cached  # nothing shared across adapters
    assert cached[3] >= 2 * block and cached[4] >= 2 * block, cached  # each one's own blocks are reused (vLLM)


def test_async_scheduling_gives_the_same_outputs(tiny_llama_dir, llama_one_slot, requests):
    """An adapter workload (one slot, so adapters change between steps; greedy of several lengths and
    seeded sampling with n=2) gives the same completions and logprobs with async_scheduling on as the
    synchronous engine (itself checked against HF + PEFT above), with steps really overlapped."""
    overlapped = make_llm(tiny_llama_dir, max_loras=1, max_num_batched_tokens=32, async_scheduling=True)
    prompts = random_prompts(VOCAB, [5, 23, 37, 9, 17, 30], seed=14)
    per_prompt = [requests["A"], None, requests["C"], requests["B"], requests["A"], None]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=1) for i in range(5)]
    params.append(SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True, logprobs=1))
    expected = llama_one_slot.generate(as_inputs(prompts), params, use_tqdm=False, lora_request=per_prompt)
    got = overlapped.generate(as_inputs(prompts), params, use_tqdm=False, lora_request=per_prompt)
    flat = lambda outs: [(c.token_ids, c.finish_reason) for o in outs for c in o.outputs]  # noqa: E731
    logprobs = lambda outs: [lp.logprob for o in outs for c in o.outputs  # noqa: E731
                             for s in c.logprobs for lp in s.values()]
    assert flat(got) == flat(expected)
    assert logprobs(got) == pytest.approx(logprobs(expected), abs=1e-5)
    assert [o.lora_request for o in got] == per_prompt
    assert overlapped.llm_engine.stats.num_overlapped_steps > 0


def test_tensor_parallel_2_matches_peft(tiny_llama_dir, requests):
    """TP=2 over gloo (each rank holds its slices of every adapter's A or B), chunked prefills mixed with
    decodes and adapters mixed in a batch: tokens equal HF + PEFT's, logprobs within 1e-4."""
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, max_loras=2, max_num_batched_tokens=24)
    try:
        prompts = random_prompts(VOCAB, [3, 17, 41, 9], seed=15)
        per_prompt = [requests["A"], None, requests["B"], requests["C"]]
        outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt)
        assert_matches_peft(tiny_llama_dir, outputs, prompts, per_prompt)
    finally:
        llm.llm_engine.executor.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_phi3_adapter_on_its_fused_projections_matches_peft(tmp_path_factory, tp):
    """Phi-3 checkpoints fuse q/k/v and gate/up (qkv_proj, gate_up_proj), and so do PEFT's adapters for
    them: each is cut into the model's parts (A shared, B by rows), also per rank at TP=2."""
    from transformers import Phi3Config

    from support.tiny_models import save_tiny_model, tiny_config_kwargs

    root = tmp_path_factory.getbasetemp() / "phi3_lora"
    base = root / "phi3"
    if not base.exists():
        save_tiny_model(root, "phi3", Phi3Config(**tiny_config_kwargs(tie_word_embeddings=True), sliding_window=None,
                                                 architectures=["Phi3ForCausalLM"]), seed=12)
    folder = save_adapter(base, root / "fused", seed=13, r=8, lora_alpha=16, std=0.2,
                          target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    assert any(".qkv_proj.lora_B" in name for name in adapter_tensors(folder))
    llm = make_llm(base, tensor_parallel_size=tp)
    try:
        prompts = random_prompts(VOCAB, [5, 23], seed=16)
        req = lora_request("fused", 1, folder)
        outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=[req, req])
        assert_matches_peft(base, outputs, prompts, [req, req])
    finally:
        llm.llm_engine.executor.shutdown()


# --- mixture of experts --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_moe(tiny_qwen2_moe_dir):
    return make_llm(tiny_qwen2_moe_dir, max_loras=1)


@pytest.mark.parametrize("base_fixture, kind", [("tiny_qwen2_moe_dir", "moe"), ("tiny_qwen3_moe_dir", "moe_attention")])
def test_moe_adapter_on_attention_and_shared_expert_matches_peft(base_fixture, kind, request, adapter, prompts):
    """Qwen2-MoE with an adapter on the attention and the shared expert's projections, Qwen3-MoE on the
    attention: next to a base-model prompt in the same batch, both equal HF + PEFT."""
    base = request.getfixturevalue(base_fixture)
    llm = request.getfixturevalue("qwen2_moe") if kind == "moe" else make_llm(base, max_loras=1)
    req = lora_request(kind, 1, adapter(base, kind))
    per_prompt = [req, None, req]
    outputs = llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert_matches_peft(base, outputs, prompts, per_prompt)


def test_moe_adapter_on_routed_experts_is_refused_by_name(qwen2_moe, tiny_qwen2_moe_dir, adapter, lora_root, prompts):
    """An adapter with a routed expert's projection (mlp.experts.0.gate_proj, as PEFT saved them when
    experts were separate Linear layers), or PEFT's target_parameters on the fused experts, is refused
    naming the experts; the shared-expert adapter still works after it."""
    good = adapter(tiny_qwen2_moe_dir, "moe")
    tensors = adapter_tensors(good)
    r, gen = 8, torch.Generator().manual_seed(6)
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(r, 64, generator=gen)
    tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(32, r, generator=gen)
    config = adapter_config(good)
    config["target_modules"] = [*config["target_modules"], "mlp.experts.0.gate_proj"]
    per_expert = write_adapter(lora_root / "moe_routed_expert", config, tensors)
    fused = save_adapter(tiny_qwen2_moe_dir, lora_root / "moe_fused_experts", seed=7, target_modules=["q_proj"],
                         target_parameters=["mlp.experts.gate_up_proj"])
    for lora_id, folder, pattern in [(2, per_expert, r"experts\.0\.gate_proj"), (3, fused, r"experts")]:
        with pytest.raises(ValueError, match=pattern):
            qwen2_moe.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False,
                               lora_request=lora_request(f"experts-{lora_id}", lora_id, folder))
        assert not qwen2_moe.llm_engine.has_unfinished_requests()
    req = lora_request("moe", 1, good)
    outputs = qwen2_moe.generate(as_inputs(prompts[:1]), GREEDY, use_tqdm=False, lora_request=req)
    assert_matches_peft(tiny_qwen2_moe_dir, outputs, prompts[:1], [req])


# --- other entry points -------------------------------------------------------------------------


def test_beam_search_with_an_adapter_matches_peft(llama, tiny_llama_dir, requests):
    """LLM.beam_search(lora_request=A): every beam's tokens and score equal transformers' beam search
    through the PEFT model (ignore_eos, BeamSearchParams' default length_penalty 1.0); the beams
    differ from the base model's."""
    from test_beam_search import assert_matches_hf

    prompts = random_prompts(VOCAB, [3, 21], seed=16)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    assert params.length_penalty == 1.0
    adapted = llama.beam_search(as_inputs(prompts), params, lora_request=requests["A"])
    base = llama.beam_search(as_inputs(prompts), params)
    for prompt, output, plain in zip(prompts, adapted, base, strict=True):
        reference = peft_beam_search(tiny_llama_dir, requests["A"].lora_path, prompt, 3, 8, 1.0, eos=False)
        assert_matches_hf(output, prompt, reference, params.length_penalty)
        assert output.sequences[0].tokens != plain.sequences[0].tokens


def test_chat_and_enqueue_take_lora_request(llama, tiny_llama_dir, requests):
    """llm.chat(lora_request=...) and llm.enqueue(lora_request=[...]) + wait_for_completion run each
    prompt with its adapter (equal to HF + PEFT on the rendered prompt ids)."""
    messages = [[{"role": "user", "content": "the cat sat on the mat"}], [{"role": "user", "content": "is it warm"}]]
    chats = llama.chat(messages, GREEDY, use_tqdm=False, lora_request=requests["C"])
    assert_matches_peft(tiny_llama_dir, chats, [o.prompt_token_ids for o in chats], [requests["C"]] * 2)
    prompts = random_prompts(VOCAB, [6, 19], seed=17)
    per_prompt = [requests["B"], None]
    ids = llama.enqueue(as_inputs(prompts), GREEDY, lora_request=per_prompt, use_tqdm=False)
    assert len(ids) == 2
    assert_matches_peft(tiny_llama_dir, llama.wait_for_completion(use_tqdm=False), prompts, per_prompt)
