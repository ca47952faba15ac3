"""Linear weights pre-packed for oneDNN on the CPU (models/layers/cpu_packed.py): the packed bf16
product gives F.linear's bits (fp32: within a few ulps), follows the weight when it changes (in
place, through load_weights / update_weights, through .data in apply_model), is only taken when the
copies fit, and leaves a bf16 engine's tokens and logprobs exactly as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, SamplingParams
from tokenmill.models.layers import cpu_packed
from tokenmill.models.layers.embedding import ParallelLMHead
from tokenmill.models.layers.linear import ColumnParallelLinear, RowParallelLinear, UnquantizedLinearMethod
from tokenmill.models.layers.cpu_packed import PackedWeight, pack_linear_weights

pytestmark = pytest.mark.skipif(not cpu_packed.supported(torch.bfloat16), reason="oneDNN has no bf16 products on this CPU")

BF16 = torch.bfloat16


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (53, 37), (1, 64), (129, 33), (1792, 4096)])
def test_packed_product_equals_f_linear_bit_for_bit(n, k):
    gen = torch.Generator().manual_seed(n * 7 + k)
    weight = torch.randn(n, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    packed = PackedWeight(weight)
    with torch.inference_mode():
        for rows in (1, 3, 32, 77, 300):
            x = torch.randn(rows, k, generator=gen).to(BF16)
            assert torch.equal(packed.linear(x, weight, None), F.linear(x, weight)), rows
            assert torch.equal(packed.linear(x, weight, bias), F.linear(x, weight, bias)), rows
            strided = torch.randn(k, rows, generator=gen).to(BF16).t()  # falls back to F.linear itself
            assert torch.equal(packed.linear(strided, weight, None), F.linear(strided, weight)), rows


@pytest.mark.parametrize("n, k", [(960, 576), (53, 37), (1792, 4096)])
def test_packed_fp32_product_is_f_linears_within_rounding(n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight(weight)
    with torch.inference_mode():
        for rows in (1, 32, 300):
            x = torch.randn(rows, k, generator=gen)
            torch.testing.assert_close(packed.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5 * k**0.5)


def test_packed_copy_follows_the_weight():
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(64, 48, generator=gen).to(BF16), requires_grad=False)
    packed = PackedWeight(weight)
    x = torch.randn(5, 48, generator=gen).to(BF16)
    with torch.no_grad():
        weight.mul_(2)  # in place: the version moves (load_weights marks its .data writes so too)
    with torch.inference_mode():
        assert torch.equal(packed.linear(x, weight, None), F.linear(x, weight))
    weight.data = torch.randn(64, 48, generator=gen).to(BF16)  # new storage, as after a level-2 sleep
    packed.drop()
    with torch.inference_mode():
        assert torch.equal(packed.linear(x, weight, None), F.linear(x, weight))


def _llm(path, **kwargs) -> LLM:
    # A small KV pool: packing waits for the copies to fit beside it (and 1 GiB of headroom).
    return LLM(str(path), dtype="bfloat16", device="cpu", seed=0, max_model_len=128, kv_cache_memory_bytes=2**26, **kwargs)


def _packed_layers(llm: LLM) -> int:
    return llm.apply_model(lambda model: sum(getattr(m, "cpu_packed", None) is not None for m in model.modules()))[0]


def test_engine_packs_and_keeps_its_tokens_and_logprobs(tiny_llama_dir, monkeypatch):
    prompts = ["the cat sat on", "a b c d e f", "once upon a time there was"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(llm: LLM):
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs]) for o in outs]

    packed = _llm(tiny_llama_dir)
    linears = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)  # qkv, o, gate_up, down; the head
    assert _packed_layers(packed) == packed.apply_model(lambda model: sum(isinstance(m, linears) for m in model.modules()))[0]
    got = run(packed)
    del packed
    monkeypatch.setattr(cpu_packed, "supported", lambda dtype: False)
    plain = _llm(tiny_llama_dir)
    assert _packed_layers(plain) == 0
    assert run(plain) == got


def test_weights_are_packed_only_when_the_copies_fit(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    model = llm.apply_model(lambda model: model)[0]
    for module in model.modules():
        if getattr(module, "cpu_packed", None) is not None:
            module.cpu_packed = None
    assert pack_linear_weights(model, spare_bytes=1000) == 0
    assert _packed_layers(llm) == 0
    total = pack_linear_weights(model, spare_bytes=2**40)
    assert total > 1000 and _packed_layers(llm) > 0


def test_level_2_sleep_drops_the_copies_and_reload_rebuilds_them(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["hello there", "one two three"]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.sleep(level=2)
    assert llm.apply_model(lambda model: all(m.cpu_packed._packed is None for m in model.modules()
                                             if getattr(m, "cpu_packed", None) is not None))[0]
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == before


def test_updated_weights_reach_the_packed_products(tiny_llama_dir, monkeypatch):
    """update_weights (through load_weights) and a write through .data in apply_model change a
    packed bf16 engine's tokens exactly as they change those of an engine without packing."""
    from safetensors.torch import load_file

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["hello there", "one two three"]
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    scrambled = {name: t.flip(0) if t.dim() == 2 else t for name, t in tensors.items()}

    def write_through_data(model):
        for module in model.modules():
            if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
                module.weight.data.copy_(module.weight.data.flip(1))

    def run(llm: LLM) -> list:
        tokens = lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]  # noqa: E731
        seen = [tokens()]
        llm.update_weights({"update_info": {"names": list(scrambled), "tensors": list(scrambled.values())}})
        seen.append(tokens())
        llm.apply_model(write_through_data)
        llm.reset_prefix_cache()
        seen.append(tokens())
        return seen

    packed = _llm(tiny_llama_dir)
    assert _packed_layers(packed) > 0
    got = run(packed)
    assert got[0] != got[1] != got[2]
    del packed
    monkeypatch.setattr(cpu_packed, "supported", lambda dtype: False)
    assert run(_llm(tiny_llama_dir)) == got
