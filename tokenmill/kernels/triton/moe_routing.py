"""A mixture-of-experts router's choice in one launch: softmax over the experts in float32, the
top-k, and (optionally) the k weights renormalised to sum to 1 (twin: ``reference.moe_route_ref``).

In torch that is a widening copy, a softmax, ``topk`` (a gather and two sorts on CUDA), a sum and
a division: ~30 µs a layer at decode sizes on an H100 (docs/perf.md 90), 1.5 ms of a Qwen3-30B-A3B
decode step's ~30. Here a program takes a few tokens' whole rows of router logits (E fits in
registers: 8 to a few hundred experts) and picks the k largest by k rounds of a row maximum.

The experts come in descending order of probability, as torch's ``topk(softmax(x))`` gives them,
chosen on the logits themselves (the same order, with no ties made by rounding the exponentials);
among equal logits the lower expert index comes first (bf16 router logits tie often at 128
experts; torch's CUDA ``topk`` leaves that order unspecified). A NaN logit ranks below every
other (torch's ``topk`` ranks it first): whatever a row holds, its ids are valid experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher

# Elements of router logits a program holds: 16 tokens of 128 experts, 256 of Mixtral's 8.
_ELEMENTS = 2048


# The token count changes with every batch size: not specialised on (no variant per size).
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr,  # [T, E] router logits, any float dtype, rows strided
    weights_ptr,  # [T, TOP_K] float32 out
    ids_ptr,  # [T, TOP_K] int64 out
    num_tokens,
    num_experts,
    stride_row,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    experts = tl.arange(0, E_PAD)
    real = (rows < num_tokens)[:, None] & (experts < num_experts)[None, :]
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_row + experts[None, :], mask=real,
                other=float("-inf")).to(tl.float32)
    x = tl.where((rows < num_tokens)[:, None], x, 0.0)  # rows past the tokens: finite, never stored
    # A NaN ranks lowest: a row of garbage (a padding token's) still names k experts below E, where
    # no match for its maximum named expert E_PAD and the grouped GEMMs read past the weights.
    x = tl.where(x == x, x, float("-inf"))
    row_max = tl.max(x, axis=1)
    total = tl.sum(tl.exp(x - row_max[:, None]), axis=1)  # padding experts: exp(-inf) = 0
    # Chosen on the logits, whose order is the probabilities' (a rounded exp could tie two of them).
    left = real
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    ids = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.where(left, x, float("-inf")), axis=1)
        pick = tl.min(tl.where(left & (x == best[:, None]), experts[None, :], E_PAD), axis=1)  # the lowest of ties
        pick = tl.minimum(pick, num_experts - 1)  # only a token past the last can match nothing
        weights = tl.where(slots[None, :] == k, (tl.exp(best - row_max) / total)[:, None], weights)
        ids = tl.where(slots[None, :] == k, pick[:, None], ids)
        left = left & (experts[None, :] != pick[:, None])
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # padding slots hold 0
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    keep = (rows < num_tokens)[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)


def route_top_k(logits: torch.Tensor, top_k: int, renormalize: bool,
                compile_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (last dim contiguous) -> (weights [T, top_k] float32, expert ids [T,
    top_k] int64): ``topk(softmax(logits.float()), top_k)``, the weights divided by their sum when
    ``renormalize``. Static shapes, no host sync (CUDA-graph safe). ``compile_only``: compile the
    launch (``precompile.launcher``), outputs left unfilled."""
    tokens, experts = logits.shape
    if logits.stride(1) != 1 or not 0 < top_k <= experts:
        raise ValueError(f"route_top_k: logits {tuple(logits.shape)} need a contiguous last dim and "
                         f"top_k={top_k} in [1, {experts}]")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(experts)
    rows = max(1, _ELEMENTS // e_pad)  # one variant a model, whatever the token count
    launcher(_route_kernel, (triton.cdiv(tokens, rows),), compile_only)(
        logits, weights, ids, tokens, experts, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, ROWS=rows, RENORMALIZE=renormalize,
        num_warps=4)
    return weights, ids
