"""Two micro-batches on two CUDA streams (NanoFlow's overlap): an experiment, off unless
``TOKENMILL_OVERLAP`` names where to use it (comma-separated: ``decode`` for the captured decode
graphs, ``mixed`` for steps that hold both decodes and prompt chunks).

Why: inside one forward every kernel waits for the one before, so a step costs its memory-bound
attention plus its compute-bound GEMMs. Cut the batch at a sequence boundary into A and B and run
each through the whole model on its own stream: A's attention may run while B's GEMMs do. Two
costs come with it: every weight is read once per micro-batch, and concurrent kernels share the
GPU only as far as one leaves SMs (registers, shared memory) free for the other.

Where it may pay: a long-prompt mixed step (P5), whose decodes (A) are attention over long
contexts at the memory floor while its prompt chunks (B) are compute-bound GEMMs at M ~16k, and
the 0.6B weights (1.2 GB) cost little to read twice. Where it should not: P3's decode steps (the
8B shape at M <= 256), where halves of M <= 128 make every GEMM weight-bound, so the extra 14 GB
of weights a step outweigh what the overlap can hide (docs/perf.md, entry 17).

B's attention metadata is derived on the device from the step's (query starts rebased, the rest
copied into fresh, 16-byte aligned tensors, so no Triton kernel sees a new alignment and compiles
a new variant), so the same code runs eagerly and inside a captured graph. On the CPU there are
no streams: the two forwards run one after the other, which is how the tests check that the cut
changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext

OVERLAP_ENV = "TOKENMILL_OVERLAP"
_PLACES = ("decode", "mixed")


@dataclass(frozen=True)
class Overlap:
    """Where steps run as two micro-batches on two streams."""

    decode: bool = False  # decode graphs of batches >= MIN_DECODE_BATCH, cut in halves
    mixed: bool = False  # eager steps with decodes in front of prompt chunks, cut between them

    # A decode graph of fewer rows has too little work per half to hide anything.
    MIN_DECODE_BATCH = 64

    @classmethod
    def from_env(cls) -> "Overlap":
        value = os.environ.get(OVERLAP_ENV, "")
        places = {p.strip() for p in value.split(",") if p.strip()}
        unknown = places - set(_PLACES)
        if unknown:
            raise ValueError(f"{OVERLAP_ENV}={value!r}: unknown place(s) {sorted(unknown)}; allowed: {list(_PLACES)}")
        return cls(decode="decode" in places, mixed="mixed" in places)


def split_metadata(meta: AttentionMetadata, split: int) -> tuple[int, AttentionMetadata, AttentionMetadata]:
    """(A's token count, A's metadata, B's metadata) for sequences ``[0, split)`` and ``[split, B)``.

    A's tensors are views of the step's (they start where the step's do); B's are new tensors:
    query starts minus the start of sequence ``split`` (read on the device, so a padded graph
    batch whose real rows end before ``split`` gives B no tokens), lengths, block tables and slots
    copied."""
    lens, ctx = meta.query_lens_host, meta.seq_lens_host
    tokens_a = sum(lens[:split])
    a = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:tokens_a],
        query_start_loc=meta.query_start_loc[: split + 1],
        seq_lens=meta.seq_lens[:split],
        block_tables=meta.block_tables[:split],
        block_size=meta.block_size,
        query_lens_host=lens[:split],
        seq_lens_host=ctx[:split],
        max_query_len=max(lens[:split]),
        max_seq_len=max(ctx[:split]),
    )
    b = AttentionMetadata(
        slot_mapping=meta.slot_mapping[tokens_a:].clone(),
        query_start_loc=meta.query_start_loc[split:] - meta.query_start_loc[split],
        seq_lens=meta.seq_lens[split:].clone(),
        block_tables=meta.block_tables[split:].clone(),
        block_size=meta.block_size,
        query_lens_host=lens[split:],
        seq_lens_host=ctx[split:],
        max_query_len=max(lens[split:]),
        max_seq_len=max(ctx[split:]),
    )
    return tokens_a, a, b


def forward_micro_batches(
    model: nn.Module,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend,
    split: int,
    side_stream: "torch.cuda.Stream | None",
) -> torch.Tensor:  # [T, hidden], as model(input_ids, positions, ...) would return
    """The model's forward of the step as micro-batches A (sequences before ``split``, on
    ``side_stream``) and B (the rest, on the current stream), joined. ``side_stream`` None (the
    CPU): one after the other."""
    if not 0 < split < len(meta.query_lens_host):
        raise ValueError(f"split must cut the step's {len(meta.query_lens_host)} sequences in two, got {split}")
    tokens_a, meta_a, meta_b = split_metadata(meta, split)
    ids_b, positions_b = input_ids[tokens_a:], positions[tokens_a:].clone()
    ctx_a = ForwardContext(meta_a, kv_caches, backend)
    ctx_b = ForwardContext(meta_b, kv_caches, backend)
    if side_stream is None:
        hidden_a = model(input_ids[:tokens_a], positions[:tokens_a], ctx_a)
        hidden_b = model(ids_b, positions_b, ctx_b)
        return torch.cat([hidden_a, hidden_b])
    main = torch.cuda.current_stream()
    # Fork: A's stream starts after everything the step queued so far (its inputs, B's metadata).
    side_stream.wait_stream(main)
    with torch.cuda.stream(side_stream):
        hidden_a = model(input_ids[:tokens_a], positions[:tokens_a], ctx_a)
    hidden_b = model(ids_b, positions_b, ctx_b)
    # Join. What A read stays valid until here: the step's tensors are freed on the host only
    # after this, and whatever reuses them is queued on the main stream behind the join.
    main.wait_stream(side_stream)
    return torch.cat([hidden_a, hidden_b])
