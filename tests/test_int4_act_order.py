"""Act-order 4-bit weights in plain torch: which config values mean act-order, and the group-by-group
reordering a GPU layer runs (``int4.group_contiguous``) against ``x @ W^T`` of the integers and
groups drawn. The checkpoints end to end: test_quantization.py; the kernel path:
quant_kernel_checks.py (interpreter) and tests/gpu/test_quant_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quantization import int4


def _compressed_tensors_config(actorder):
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "actorder": actorder}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


@pytest.mark.parametrize("actorder, act_order", [(None, False), ("weight", False), ("static", False), (False, False),
                                                 ("group", True), ("dynamic", True), (True, True)])
def test_compressed_tensors_actorder_values(actorder, act_order):
    """"weight" / "static" reorder only while quantizing (no g_idx); "group" / "dynamic" (True in older
    compressed-tensors) store weight_g_idx, which the layer then reads."""
    from tokenmill.quantization.config import resolve_quantization

    config = type("Config", (), {"quantization_config": _compressed_tensors_config(actorder)})()
    (_, scheme), = resolve_quantization(None, config).groups
    assert scheme.act_order is act_order


def test_unknown_actorder_and_desc_act_values_are_refused_by_name():
    from tokenmill.quantization.config import resolve_quantization

    config = type("Config", (), {"quantization_config": _compressed_tensors_config("sideways")})()
    with pytest.raises(ValueError, match=r"config_groups.group_0.weights.actorder='sideways' is not supported; "
                                         r"supported: null, 'weight' \(or 'static'\) or 'group' \(or 'dynamic'\)"):
        resolve_quantization(None, config)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    (_, scheme), = resolve_quantization(None, type("Config", (), {"quantization_config": gptq})()).groups
    assert scheme.act_order
    config = type("Config", (), {"quantization_config": {**gptq, "desc_act": "true"}})()
    with pytest.raises(ValueError, match=r"quantization_config.desc_act='true' is not supported; supported: true or false"):
        resolve_quantization(None, config)


def _drawn(k: int, n: int, groups: int, g_idx: torch.Tensor, gen: torch.Generator):
    """Codes [K, N], zero points and fp16-valued scales [G, N] drawn, the weight (code - zero[g]) * scale[g]
    [N, K] in fp64, and our layout of them (packed by compressed-tensors' pack_to_int32)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (groups, n), generator=gen)
    scales = (0.01 + torch.rand(groups, n, generator=gen)).half().float()  # (u - z) * s exact in fp32
    weight = ((codes - zeros[g_idx]).double() * scales[g_idx].double()).t()
    qweight = pack_to_int32((codes - 8).to(torch.int8), 4, packed_dim=0)  # [K/8, N]
    return weight, qweight, zeros.to(torch.uint8), scales


@pytest.mark.parametrize("case", ["act-order", "act-order-rank-of-two", "static-groups-rank-of-two", "plain", "odd-k"])
def test_group_contiguous_reordering_gives_the_same_product(case):
    """Reordered features (and the input gathered, a zero column appended for padding) give x @ W^T of
    the weight drawn: whole groups when every group keeps group_size features, 16-feature slices
    padded when a rank's share of the groups is uneven, nothing to do for a plain order."""
    gen = torch.Generator().manual_seed(3)
    full_k, n, g = (200 if case == "odd-k" else 512), 24, 64
    groups = -(-full_k // g)
    plain = torch.arange(full_k) // g
    full_idx = plain if case in ("plain", "static-groups-rank-of-two") else plain[torch.randperm(full_k, generator=gen)]
    features = slice(full_k // 2, full_k) if case.endswith("rank-of-two") else slice(None)
    g_idx = full_idx[features]
    k = len(g_idx)
    weight, qweight, zeros, scales = _drawn(k, n, groups, g_idx, gen)
    weights = int4.Int4Weights(qweight, scales, zeros, k, g, g_idx)
    torch.testing.assert_close(weights.dequantize(torch.float32).double(), weight, rtol=0, atol=0)
    reordered, index = int4.group_contiguous(weights)
    x = torch.randn(5, k, generator=gen, dtype=torch.float64)
    if case in ("plain", "static-groups-rank-of-two"):
        assert index is None  # already in group order: no gather at run time
        gathered = x
    else:
        gathered = torch.nn.functional.pad(x, (0, 1))[:, index]
    padded = case in ("act-order-rank-of-two",)
    assert (index is not None and len(index) > k) == padded
    assert reordered.group_size == (16 if padded else g) and reordered.g_idx is None
    got = gathered @ reordered.dequantize(torch.float32).double().t()
    torch.testing.assert_close(got, x @ weight.t(), rtol=1e-9, atol=1e-9)
