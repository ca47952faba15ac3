"""The fused LoRA update kernel's cases and checks under the interpreter, run by the workers of
``test_kernels_interpret.py`` (which merges ``CASES`` and ``CHECKS`` into its own).

``lora_update_`` adds x A_s^T B_s^T to each token's row of y in place, s being the token's slot
(-1: nothing). Each case lays random adapters out as ``LoRAUpdate`` keeps them (every slot and
sublayer side by side; lower ranks zero-padded) and compares with a plain per-token product in
float64 over the same numbers, written here from the layout's definition. y starts random, so
rows of the base model must come back bit for bit unchanged. Shapes: one token, a 16-token tile
exactly, tiles that leave rows over, features that fill no tile (odd in / out), one to three
sublayers, one to four slots with tokens mixing them, ranks 8 and 16 (padded to the dot's 16),
several column runs a program (the launch shape's other branch, forced by a small SM count).
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}

# (tokens, sublayers, slots, rank, in, out, sms: the SM count the launch shape assumes)
_SHAPES = [
    (1, 3, 2, 16, 72, 300, 132),
    (16, 1, 1, 8, 64, 130, 132),
    (17, 2, 4, 16, 200, 260, 132),
    (70, 3, 3, 8, 96, 520, 1),  # a 64-token tile and a partial one; column runs of 8 tiles (sms=1)
]
for _dt in ("float32", "float16"):
    for _t, _j, _s, _r, _k, _n, _sms in _SHAPES:
        CASES[f"lora-t{_t}-j{_j}-s{_s}-r{_r}-k{_k}-n{_n}-sms{_sms}-{_dt}"] = (
            "lora_update", dict(dtype=_dt, tokens=_t, sublayers=_j, slots=_s, rank=_r, in_features=_k, out_features=_n, sms=_sms))


def _check_lora_update(p: dict[str, Any]) -> None:
    from unittest import mock

    import torch

    from tokenmill.kernels.triton import lora

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(11)
    tokens, sublayers, slots, rank = p["tokens"], p["sublayers"], p["slots"], p["rank"]
    k, n = p["in_features"], p["out_features"]
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = (torch.randn(sublayers * slots * rank, k, generator=gen) / k**0.5).to(dtype)
    b = (torch.randn(n, sublayers * slots * rank, generator=gen) / rank**0.5).to(dtype)
    a[rank - 3 :: rank] = 0  # a slot's adapter of lower rank: its last rows and columns zero
    b[:, rank - 3 :: rank] = 0
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    token_slots[0] = slots - 1  # at least one token on an adapter, the last slot
    y = torch.randn(tokens, n, generator=gen).to(dtype)
    before = y.clone()

    want = before.double().clone()
    for t in range(tokens):
        s = int(token_slots[t])
        if s < 0:
            continue
        for j in range(sublayers):
            cols = slice((j * slots + s) * rank, (j * slots + s + 1) * rank)
            want[t] += (x[t].double() @ a[cols].double().T) @ b[:, cols].double().T

    with mock.patch.object(lora, "num_sms", lambda device: p["sms"]):
        got = lora.lora_update_(y, x, a, b, token_slots, slots, sublayers, rank)
    assert got is y
    base = token_slots < 0
    assert torch.equal(y[base], before[base]), "a row of the base model changed"
    # fp16: t is rounded to fp16 before the expand (as the torch path's shrink output is)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    torch.testing.assert_close(y.double(), want, **tol)
    assert (want - before.double())[~base].abs().mean() > 0.05  # the update is not negligible


CHECKS = {"lora_update": _check_lora_update}
