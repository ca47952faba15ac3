"""Our decoder models against Hugging Face transformers (fp32, CPU) on tiny random checkpoints.

Every model is driven through the paged KV cache the way the runner drives it: one sequence,
several sequences in one flat batch, prefill followed by decode steps, chunked prefill mixed
with decode. Reference logits are HF's full-sequence forward (teacher forcing).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from tokenmill.models.loader import load_model
from tokenmill.models.source import resolve_model

ARCH_FIXTURES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir", "tiny_phi3_dir", "tiny_granite_dir", "tiny_smollm3_dir",
                  "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_mixtral_dir"]
ATOL = 1e-4


def _ours(path: Path, **kwargs) -> torch.nn.Module:
    return load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), "auto", **kwargs)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(params=ARCH_FIXTURES)
def arch_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_interface_attributes(arch_dir: Path) -> None:
    model = _ours(arch_dir)
    config = model.config
    assert model.num_layers == config.num_hidden_layers
    assert model.num_kv_heads == config.num_key_value_heads
    assert model.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert [layer.self_attn.attn.layer_idx for layer in model.model.layers] == list(range(model.num_layers))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == bool(config.tie_word_embeddings)


def test_layers_share_one_rotary_table(arch_dir: Path) -> None:
    """The cos/sin table covers every position the config allows (40,960 x 128 float32, 21 MB, for Qwen3;
    67 MB for Llama-3.1): the layers share one, not a copy each (a copy a layer took 1 GB of a Qwen3-30B-A3B's
    KV cache). SmolLM3's layers without rotary share their own identity table."""
    model = _ours(arch_dir)
    tables = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in model.model.layers}
    assert len(tables) == (2 if "smollm3" in arch_dir.name else 1)
    table_bytes = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith("cos_sin_cache"))
    assert table_bytes == len(tables) * model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.nbytes


def test_single_sequence_prefill(arch_dir: Path, hf_reference, paged_cache) -> None:
    model, hf = _ours(arch_dir), hf_reference(arch_dir)
    tokens = _tokens(23, model.config.vocab_size, seed=0)
    (ours,) = paged_cache(model).step([(0, tokens)])
    ref = _hf_logits(hf, tokens)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert ref.std() > 0.1  # random weights give non-trivial logits, so the comparison means something
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_two_sequences_in_one_batch(arch_dir: Path, hf_reference, paged_cache) -> None:
    model, hf = _ours(arch_dir), hf_reference(arch_dir)
    a = _tokens(11, model.config.vocab_size, seed=1)
    b = _tokens(6, model.config.vocab_size, seed=2)
    out_a, out_b = paged_cache(model).step([(0, a), (1, b)])
    torch.testing.assert_close(out_a, _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_prefill_then_decode_and_chunked_prefill(arch_dir: Path, hf_reference, paged_cache) -> None:
    model, hf = _ours(arch_dir), hf_reference(arch_dir)
    vocab = model.config.vocab_size
    a, b = _tokens(16, vocab, seed=3), _tokens(14, vocab, seed=4)
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    cache = paged_cache(model)
    got_a, got_b = cache.step([(0, a[:7]), (1, b[:5])])
    torch.testing.assert_close(got_a, ref_a[:7], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, ref_b[:5], atol=ATOL, rtol=0)
    # Pure decode: one token per sequence, reading everything before it from the paged cache.
    for i in range(4):
        got_a, got_b = cache.step([(0, [a[7 + i]]), (1, [b[5 + i]])])
        torch.testing.assert_close(got_a, ref_a[7 + i : 8 + i], atol=ATOL, rtol=0)
        torch.testing.assert_close(got_b, ref_b[5 + i : 6 + i], atol=ATOL, rtol=0)
    # Mixed step: a decode for one sequence next to a prefill chunk that continues cached context.
    got_a, got_b = cache.step([(0, [a[11]]), (1, b[9:14])])
    torch.testing.assert_close(got_a, ref_a[11:12], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, ref_b[9:14], atol=ATOL, rtol=0)


def test_comparison_can_fail(tiny_llama_dir: Path, hf_reference, paged_cache) -> None:
    """The tolerance is tight enough to catch a wrong rope scaling or a single perturbed norm."""
    source = resolve_model(str(tiny_llama_dir))
    tokens = _tokens(23, source.hf_config.vocab_size, seed=5)
    ref = _hf_logits(hf_reference(tiny_llama_dir), tokens)

    plain_rope = copy.deepcopy(source.hf_config)
    plain_rope.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    wrong = load_model(dataclasses.replace(source, hf_config=plain_rope), torch.float32, torch.device("cpu"))
    assert (paged_cache(wrong).step([(0, tokens)])[0] - ref).abs().max() > 100 * ATOL

    model = _ours(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] += 0.05
    assert (paged_cache(model).step([(0, tokens)])[0] - ref).abs().max() > 10 * ATOL


# --- layers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8192},
        {  # DeepSeek's form: the attention factor from mscale, its own betas, no truncation
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
            "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False,
        },
    ],
    ids=lambda r: r["rope_type"] + ("-deepseek" if "mscale" in r else ""),
)
def test_rotary_matches_hf(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from tokenmill.models.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=32768, rope_parameters=rope)
    ours = RotaryEmbedding.from_config(config, head_dim=128)
    positions = torch.tensor([0, 1, 5, 100, 4000, 9000, 20000, 32767])
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 8 * 128, generator=gen), torch.randn(8, 2 * 128, generator=gen)
    oq, ok = ours(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    rq, rk = apply_rotary_pos_emb(q.view(1, 8, 8, 128).transpose(1, 2), k.view(1, 8, 2, 128).transpose(1, 2), cos, sin)
    torch.testing.assert_close(oq, rq.transpose(1, 2).reshape(8, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ok, rk.transpose(1, 2).reshape(8, -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_rotary_matches_hf_within_the_original_length(partial: float) -> None:
    """Phi-3's LongRoPE within original_max_position_embeddings: transformers' short factors and
    its cos/sin scale (from max_position_embeddings / original), as its Phi3RotaryEmbedding has them;
    with partial rotary (Phi-4-mini's 0.75) on q/k whose head dims are reordered as the model's
    loader reorders them (``partial_rotary_permutation``), and put back for the comparison."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from tokenmill.models.layers.rotary import RotaryEmbedding, longrope_limit, partial_rotary_permutation

    gen = torch.Generator().manual_seed(1)
    pairs = int(128 * partial) // 2
    factors = lambda low, high: (low + (high - low) * torch.rand(pairs, generator=gen)).tolist()  # noqa: E731
    config = Phi3Config(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                        original_max_position_embeddings=4096, partial_rotary_factor=partial,
                        rope_scaling={"type": "longrope", "short_factor": factors(1.0, 3.0), "long_factor": factors(2.0, 40.0)})
    assert longrope_limit(config) == 4096
    ours = RotaryEmbedding.from_config(config, head_dim=128)
    perm = partial_rotary_permutation(128, ours.rope)
    assert (perm is None) == (partial == 1.0)
    order = torch.arange(128) if perm is None else perm
    positions = torch.tensor([0, 1, 5, 100, 2000, 4000, 4095])
    q, k = torch.randn(7, 8, 128, generator=gen), torch.randn(7, 2, 128, generator=gen)
    oq, ok = ours(positions, q[..., order].reshape(7, -1), k[..., order].reshape(7, -1))
    back = torch.argsort(order)
    oq, ok = oq.view(7, 8, 128)[..., back], ok.view(7, 2, 128)[..., back]
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    assert cos.abs().max() > 1.01  # the scale is there (sqrt(1 + ln 32 / ln 4096) = 1.19)
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(oq, rq[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ok, rk[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_a_longrope_model_runs_to_its_original_length(tiny_phi3_dir, tmp_path) -> None:
    """A tiny Phi-3 with LongRoPE: max_model_len defaults to original_max_position_embeddings, where
    greedy tokens and logprobs equal transformers'; a longer max_model_len is refused by name."""
    import json
    import shutil

    from tokenmill import LLM

    folder = tmp_path / "phi3_longrope"
    shutil.copytree(tiny_phi3_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    gen = torch.Generator().manual_seed(2)
    partial = config.pop("rope_parameters")["partial_rotary_factor"]  # the fixture's, kept: LongRoPE on part of each head
    half = int(config["hidden_size"] // config["num_attention_heads"] * partial) // 2
    config.update(original_max_position_embeddings=64, rope_scaling={
        "type": "longrope", "partial_rotary_factor": partial, "short_factor": (1 + 2 * torch.rand(half, generator=gen)).tolist(),
        "long_factor": (4 + 8 * torch.rand(half, generator=gen)).tolist()})
    (folder / "config.json").write_text(json.dumps(config))
    llm = _assert_greedy_matches_hf(folder, _tokens(30, config["vocab_size"], seed=8))
    assert llm.llm_engine.config.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len=128 is past the model's original_max_position_embeddings \(64\)"):
        LLM(str(folder), max_model_len=128, **ROPE_ENGINE)


ROPE_ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 * 2**20)


def _assert_greedy_matches_hf(folder: Path, prompt: list[int]):
    """30 greedy tokens of the model in ``folder`` after ``prompt``: the same tokens as transformers',
    logprobs within 1e-4. Returns the LLM."""
    from reference import hf_greedy, hf_model
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(folder), **ROPE_ENGINE)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_logprobs = hf_greedy(hf_model(str(folder)), prompt, 30)
    assert out.token_ids == ref_tokens
    ours = [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4
    return llm


def test_rope_params_old_and_new_config_layouts() -> None:
    from types import SimpleNamespace

    from tokenmill.models.layers.rotary import rope_params_from_config

    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=64)
    params = rope_params_from_config(old)
    assert (params.rope_type, params.theta, params.extra) == ("linear", 5e5, {"factor": 2.0})
    bare = SimpleNamespace(rope_theta=1e4, rope_scaling=None, max_position_embeddings=64)
    assert rope_params_from_config(bare).rope_type == "default"
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        rope_params_from_config(SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))


def test_a_yarn_model_runs_past_its_pretraining_length(tiny_llama_dir, tmp_path) -> None:
    """YaRN (Qwen's way to 128K): max_model_len defaults to the pretraining length times the factor,
    as vLLM derives it, and past the pretraining length greedy tokens and logprobs equal transformers'."""
    import json
    import shutil

    from tokenmill import LLM

    folder = tmp_path / "llama_yarn"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    (folder / "config.json").write_text(json.dumps(config))
    llm = _assert_greedy_matches_hf(folder, _tokens(60, config["vocab_size"], seed=9))  # past the 32 pretrained positions
    assert llm.llm_engine.config.max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len=129 is larger .*\(128, as its rope scaling stretches them\)"):
        LLM(str(folder), max_model_len=129, **ROPE_ENGINE)



@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 4 for i in range(8)],
     "long_factor": [4.0 + i for i in range(8)], "original_max_position_embeddings": 64},
])
def test_top_level_original_max_position_embeddings_wins_as_in_transformers(rope, tiny_llama_dir, tmp_path,
                                                                            paged_cache) -> None:
    """transformers' rotary takes a config's top-level original_max_position_embeddings (where Phi-3
    keeps it) over the rope dict's for llama3, YaRN and LongRoPE; llama3 and LongRoPE took the dict's
    here and rotated by another pretraining length (logits off by up to 0.6)."""
    import json
    import shutil

    from reference import hf_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(rope_parameters=rope, original_max_position_embeddings=32)
    (folder / "config.json").write_text(json.dumps(config))
    tokens = _tokens(30, config["vocab_size"], seed=3)  # within 32: LongRoPE's short factors
    (ours,) = paged_cache(_ours(folder)).step([(0, tokens)])
    torch.testing.assert_close(ours, _hf_logits(hf_model(str(folder)), tokens), atol=ATOL, rtol=0)


def test_rmsnorm_fused_residual() -> None:
    from tokenmill.models.layers.norm import RMSNorm

    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    normed, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    expected = (x + residual) * torch.rsqrt((x + residual).pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(normed, expected)
    bf16 = norm.to(torch.bfloat16)(x.bfloat16())
    assert bf16.dtype == torch.bfloat16


# --- tensor-parallel sharding, checked rank by rank without communication ----------------------


def test_qkv_sharding_replicates_kv_heads_when_fewer_than_ranks() -> None:
    from tokenmill.models.layers.linear import QKVParallelLinear

    hidden, head_dim, heads, kv_heads, tp = 16, 4, 4, 2, 4
    gen = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n * head_dim, hidden, generator=gen) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * head_dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(3, hidden, generator=gen)
    full_q, full_k, full_v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True, tp_rank=rank, tp_size=tp)
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, shard)
            layer.bias.weight_loader(layer.bias, b, shard)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        kv_head = rank // (tp // kv_heads)  # two ranks share each KV head
        torch.testing.assert_close(q, full_q[:, rank * head_dim : (rank + 1) * head_dim])
        torch.testing.assert_close(k, full_k[:, kv_head * head_dim : (kv_head + 1) * head_dim])
        torch.testing.assert_close(v, full_v[:, kv_head * head_dim : (kv_head + 1) * head_dim])


def test_merged_column_and_row_sharding_sum_to_full() -> None:
    from tokenmill.models.layers.activation import SiluAndMul
    from tokenmill.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    hidden, inter, tp = 8, 12, 2
    gen = torch.Generator().manual_seed(0)
    w_gate, w_up = torch.randn(inter, hidden, generator=gen), torch.randn(inter, hidden, generator=gen)
    w_down, b_down = torch.randn(hidden, inter, generator=gen), torch.randn(hidden, generator=gen)
    x = torch.randn(3, hidden, generator=gen)
    full = (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T + b_down
    total = torch.zeros_like(full)
    for rank in range(tp):
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank=rank, tp_size=tp)
        gate_up.weight.weight_loader(gate_up.weight, w_gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, w_up, 1)
        down = RowParallelLinear(inter, hidden, bias=True, tp_rank=rank, tp_size=tp, reduce_results=False)
        down.weight.weight_loader(down.weight, w_down)
        down.bias.weight_loader(down.bias, b_down)
        total += down(SiluAndMul()(gate_up(x)))
    torch.testing.assert_close(total, full)


def test_weight_loader_rejects_wrong_shape() -> None:
    from tokenmill.models.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(8, 4)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(4, 9))


# --- real tensor parallel over gloo (2 CPU processes) ------------------------------------------


def _tp_worker(rank: int, world: int, init_address: str, model_dirs: list[str], tokens: list[list[int]], out: str) -> None:
    import torch.distributed as dist
    from support.paged_cache import PagedCache  # (spawn gives this process the parent's sys.path)

    dist.init_process_group("gloo", init_method=init_address, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = []
        for model_dir in model_dirs:
            model = load_model(resolve_model(model_dir), torch.float32, torch.device("cpu"), "safetensors",
                               tp_rank=rank, tp_size=world)
            results.append(PagedCache(model).step([(i, t) for i, t in enumerate(tokens)]))
        if rank == 0:
            torch.save(results, out)
        # Both ranks leave together: a rank tearing gloo down while its peer is still mid-collective
        # can abort the peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_two_ranks_matches_single(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_phi3_dir: Path, tiny_granite_dir: Path, tmp_path: Path, paged_cache
) -> None:
    """tp=2 over gloo: heads, KV heads, MLP and an odd vocabulary (289, padded) split over two ranks;
    Llama (untied head), Qwen2 (biases, tied head), Phi-3 (fused q/k/v and gate/up in the
    checkpoint, each rank reading its slices of each part) and Granite (its scalars after the
    all-reduces) in the same two worker processes."""
    import torch.multiprocessing as mp

    dirs = [tiny_llama_dir, tiny_qwen2_dir, tiny_phi3_dir, tiny_granite_dir]
    vocab = resolve_model(str(tiny_llama_dir)).hf_config.vocab_size
    tokens = [_tokens(9, vocab, seed=6), _tokens(4, vocab, seed=7)]
    expected = [paged_cache(_ours(d)).step([(i, t) for i, t in enumerate(tokens)]) for d in dirs]
    out = tmp_path / "logits.pt"
    import socket

    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = (2, f"tcp://127.0.0.1:{port}", [str(d) for d in dirs], tokens, str(out))
    mp.spawn(_tp_worker, args=args, nprocs=2, join=True)
    for got_model, want_model in zip(torch.load(out), expected, strict=True):
        for got, want in zip(got_model, want_model, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_no_distributed_calls_with_tp1(tiny_llama_dir: Path, paged_cache, monkeypatch) -> None:
    import torch.distributed as dist

    def fail(*args, **kwargs):
        raise AssertionError("tp_size=1 must not communicate")

    monkeypatch.setattr(dist, "all_reduce", fail)
    monkeypatch.setattr(dist, "all_gather", fail)
    paged_cache(_ours(tiny_llama_dir)).step([(0, [1, 2, 3])])


def test_bf16_model_runs(tiny_qwen3_dir: Path, hf_reference, paged_cache) -> None:
    model = load_model(resolve_model(str(tiny_qwen3_dir)), torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # the loader restores the default
    tokens = _tokens(12, model.config.vocab_size, seed=8)
    (ours,) = paged_cache(model).step([(0, tokens)])
    ref = _hf_logits(hf_reference(tiny_qwen3_dir), tokens)
    assert ours.dtype == torch.bfloat16  # logits stay in the model dtype; the sampler upcasts where it computes
    assert (ours.float() - ref).abs().max() < 0.1 * ref.abs().max()



@pytest.fixture(scope="module")
def windowed_mistral_dir(tiny_mistral_dir, tmp_path_factory) -> Path:
    """The tiny Mistral with a 24-token sliding window, shorter than its positions."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("windowed") / "mistral"
    shutil.copytree(tiny_mistral_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = 24
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_sliding_window_limits_max_model_len_and_keeps_outputs_exact(windowed_mistral_dir, caplog):
    """tokenmill attends fully, so a windowed model defaults to max_model_len = its window, where
    transformers' windowed attention gives the same tokens; a longer max_model_len asked for is
    taken with a warning; with disable_sliding_window=True (vLLM: full attention, capped) refused."""
    from reference import hf_greedy, hf_model
    from tokenmill import LLM, SamplingParams

    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 * 2**20)
    llm = LLM(str(windowed_mistral_dir), **options)
    assert llm.llm_engine.config.max_model_len == 24
    prompt = _tokens(14, llm.llm_engine.config.vocab_size, seed=3)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"  # stopped at the window
    assert out.token_ids == hf_greedy(hf_model(str(windowed_mistral_dir)), prompt, 10)[0]
    with caplog.at_level("WARNING", logger="tokenmill.max_model_len"):
        longer = LLM(str(windowed_mistral_dir), max_model_len=40, **options)
    assert longer.llm_engine.config.max_model_len == 40
    assert any("sliding window of 24 tokens" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"max_model_len=40 is larger than the model's sliding_window \(24\)"):
        LLM(str(windowed_mistral_dir), max_model_len=40, disable_sliding_window=True, **options)
