"""Temperature, a random draw and the argmax in one pass over the logits (twin: ``reference.gumbel_argmax_ref``).

Sampling token i with probability softmax(logits / T)_i is the same as taking
``argmax_i(logits_i / T + g_i)`` with g_i independent Gumbel(0, 1) noise (the Gumbel-max trick;
the softmax's normaliser does not move an argmax). Written that way a draw needs no softmax, no
[N, V] probability tensor and no separate noise tensor: one read of the logits in their own dtype
(bf16 on the GPU), against about seven fp32 passes for divide, softmax, exponential noise, divide
and argmax in torch.

The noise is counter-based: g for row r and token i comes from Philox-4x32-10 keyed by the row's
64-bit ``key``, with the counter (i // 4, counter_lo, counter_hi, 0); its four outputs serve the
tokens 4 (i // 4) .. 4 (i // 4) + 3. The runner gives a seeded request's rows key = its seed and
counter = the output position being sampled, so its samples depend on nothing else in the batch
and nothing in the engine's history; other rows get a fresh key per step. Rows with T == 0 take
the plain argmax and draw nothing.

The vocabulary is cut into chunks of CHUNK tokens, one program per (row, chunk), so a thin batch
still fills the GPU; each program writes its chunk's best score and token, and the wrapper picks
the best chunk per row (ties go to the lowest token id, as ``torch.argmax`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher

_CHUNK = 2048  # tokens per program: 38 chunks over Qwen's 151,936-token vocabulary


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    key_ptr,
    counter_ptr,
    best_score_ptr,
    best_token_ptr,
    vocab_size,
    num_chunks,
    stride_row,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # Token i = 4 * quad + lane: one Philox call (four 32-bit outputs) serves a quad of tokens.
    quads = chunk * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
    lanes = tl.arange(0, 4)
    tokens = quads[:, None] * 4 + lanes[None, :]  # [CHUNK // 4, 4], row-major = token order
    valid = tokens < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=valid, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        key = tl.load(key_ptr + row)
        counter = tl.load(counter_ptr + row)
        zero = quads * 0
        c1 = zero + (counter & 0xFFFFFFFF).to(tl.int32)
        c2 = zero + (counter >> 32).to(tl.int32)
        r0, r1, r2, r3 = tl.philox(key, quads, c1, c2, zero)
        lane = lanes[None, :]
        bits = tl.where(lane == 0, r0[:, None], tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])))
        uniform = tl.uint_to_uniform_float(bits)  # [0, 1); 0 gives -inf noise, never chosen
        score = tl.math.div_rn(x, temperature) - tl.log(-tl.log(uniform))
    else:
        score = x
    score = tl.where(valid, score, float("-inf"))
    # The best score of the chunk and the lowest token holding it, reduced over both tile axes (a
    # reshape to 1-D may reorder elements on the GPU, so no index is taken from a flattened tile).
    best = tl.max(tl.max(score, axis=1), axis=0)
    first = chunk * CHUNK
    token = tl.min(tl.min(tl.where(score == best, tokens, first + CHUNK), axis=1), axis=0)
    # A NaN score matches nothing: fall back to the chunk's first token, always a real one.
    token = tl.where(token < vocab_size, token, first)
    out = row * num_chunks + chunk
    tl.store(best_score_ptr + out, best)
    tl.store(best_token_ptr + out, token)


def gumbel_argmax(
    logits: torch.Tensor,  # [N, V], any float dtype, last dim contiguous
    temperature: torch.Tensor,  # [N] float32; 0 = greedy
    keys: torch.Tensor,  # [N] int64 Philox keys
    counters: torch.Tensor,  # [N] int64 Philox counters (the draw's position)
    *,
    compile_only: bool = False,
) -> torch.Tensor:  # [N] int64 token ids
    """Per row: argmax(logits) where temperature == 0, else a sample of softmax(logits / temperature).

    ``compile_only`` compiles the kernel for these inputs and launches nothing (``precompile.py``);
    the result is then meaningless."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be 2-D with a contiguous last dim, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    for name, t, dtype in (("temperature", temperature, torch.float32), ("keys", keys, torch.int64), ("counters", counters, torch.int64)):
        if t.shape != (rows,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{rows}] {dtype} tensor, got {tuple(t.shape)} {t.dtype}")
    num_chunks = triton.cdiv(vocab, _CHUNK)
    best_score = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    best_token = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    if rows:
        launcher(_gumbel_argmax_kernel, (rows, num_chunks), compile_only)(
            logits, temperature, keys, counters, best_score, best_token, vocab, num_chunks, logits.stride(0),
            CHUNK=_CHUNK, num_warps=8,
        )
    winner = best_score.argmax(dim=1, keepdim=True)  # first best chunk: lowest token id on ties
    return best_token.gather(1, winner).squeeze(1).to(torch.int64)
