"""The item-queue decode attention's cases and checks under the interpreter
(``kernels/triton/paged_attention_queue.py``), run by the workers of ``test_kernels_interpret.py``
(which merges ``CASES`` and ``CHECKS`` into its own): the kernel against the twin with padding
rows, several items a program and an fp8 cache; the ranking against torch's stable sort; which
steps the backend's rule sends to it. The backend over the queue (pure and mixed steps) is a
case of ``kernel_checks_paged_attention.py``'s backend check.
"""

from __future__ import annotations

from typing import Any

import kernel_checks_paged_attention as paged

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


def _check_queue(p: dict[str, Any]) -> None:
    """The item-queue decode kernel against the twin, launched twice on one counter pair (the
    second launch finds it reset by the first), with padding rows (no keys) left unwritten; and
    the ranking (longest first, ties by index) against torch's stable sort."""
    import torch

    from support.kernel_cases import make_paged_batch
    from tokenmill.kernels import reference
    from tokenmill.kernels.triton.paged_attention_queue import decode_order, new_queue, queued_decode_attention

    dtype = getattr(torch, p["dtype"])
    seq_lens, pad = p["seq_lens"], p.get("pad", 0)
    cache_dtype = getattr(torch, p["cache_dtype"]) if "cache_dtype" in p else None
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                             head_dim=p["head_dim"], block_size=p["block_size"], dtype=dtype, seed=len(seq_lens),
                             cache_dtype=cache_dtype)
    scale = p["head_dim"] ** -0.5
    expected = reference.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                             batch.block_tables, scale)
    q = torch.cat([batch.q, torch.full((pad, *batch.q.shape[1:]), float("nan"), dtype=dtype)])
    lens = torch.cat([batch.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    tables = torch.cat([batch.block_tables, torch.zeros((pad, batch.block_tables.shape[1]), dtype=torch.int32)])
    order = decode_order(lens)
    assert order.tolist() == torch.argsort(lens, descending=True, stable=True).tolist(), f"not longest first: {order}"
    queue = new_queue("cpu")
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        queued_decode_attention(q, batch.kv_cache, lens, tables, scale, order, queue, out=out, tile_n=16, num_warps=4,
                                num_stages=1, programs_per_sm=1, programs=p["programs"])
        torch.testing.assert_close(out[: len(seq_lens)], expected, **paged._tol(dtype))
        assert out[len(seq_lens):].isnan().all(), "a padding row was written"
        assert queue.tolist() == [0, 0], "the queue was left set"


def _check_decode_order(p: dict[str, Any]) -> None:
    """The ranking over more sequences than one block of the rank kernel, with ties and zeros."""
    import torch

    from tokenmill.kernels.triton.paged_attention_queue import decode_order

    lens = torch.randint(0, p["max_len"], (p["num_seqs"],), generator=torch.Generator().manual_seed(p["num_seqs"]),
                         dtype=torch.int32)
    assert decode_order(lens).tolist() == torch.argsort(lens, descending=True, stable=True).tolist()


for _dt in ("float32", "float16"):
    # Contexts of one tile to several blocks, GQA 2, two padding rows; 3 programs take the 18
    # items (each several), then the default grid (132 programs under the interpreter, most idle).
    for _programs in (3, None):
        _case("queue", f"queue-g2-d64-{_dt}-{_programs or 'default'}", dtype=_dt, block_size=16, num_heads=4,
              num_kv_heads=2, head_dim=64, seq_lens=[130, 5, 33, 64, 33, 97, 1], pad=2, programs=_programs)
# Over an fp8 cache (made in fp8 by the batch builder; the twin reads the same bytes).
_case("queue", "queue-fp8cache-g2-d64-float16", dtype="float16", cache_dtype="float8_e4m3fn", block_size=16,
      num_heads=4, num_kv_heads=2, head_dim=64, seq_lens=[130, 5, 33, 64, 33, 97, 1], pad=1, programs=3)
# A group of 3 padded to 4 rows; head_dim 128.
_case("queue", "queue-g3-d128-float16", dtype="float16", block_size=16, num_heads=6, num_kv_heads=2,
      head_dim=128, seq_lens=[40, 7, 100, 16, 3], programs=4)
_case("decode_order", "decode-order-300-ties", num_seqs=300, max_len=40)


def _check_queue_rule(p: dict[str, Any]) -> None:
    """Which pure decode steps the backend sends to the queue by default: the measured side of the
    threshold (8 kv heads: from 96 sequences over bf16, from 128 over fp8), never in deterministic
    mode, and everything when told to."""
    import torch

    from tokenmill.attention.triton_backend import TritonAttentionBackend

    def queued(backend: TritonAttentionBackend, seqs: int, kv_heads: int = 8, cache_dtype: torch.dtype = torch.bfloat16) -> bool:
        return backend._queued(seqs, torch.empty(2, 1, 16, kv_heads, 128, dtype=cache_dtype))

    auto, fp8 = TritonAttentionBackend(), torch.float8_e4m3fn
    assert [queued(auto, n) for n in (1, 64, 96, 128, 256, 1024)] == [False, False, True, True, True, True]
    assert not queued(auto, 256, kv_heads=2) and queued(auto, 512, kv_heads=2)
    assert [queued(auto, n, cache_dtype=fp8) for n in (64, 96, 128, 1024)] == [False, False, True, True]
    assert not queued(TritonAttentionBackend(deterministic=True), 1024)
    assert queued(TritonAttentionBackend(decode_queue=True), 1) and not queued(TritonAttentionBackend(decode_queue=False), 1024)
    try:
        TritonAttentionBackend(side_decodes=-1)
    except ValueError as error:
        assert "side_decodes" in str(error) and "-1" in str(error), error
    else:
        raise AssertionError("side_decodes=-1 was taken")


_case("queue_rule", "queue-rule-by-items-an-sm")


CHECKS = {
    "queue": _check_queue,
    "decode_order": _check_decode_order,
    "queue_rule": _check_queue_rule,
}
