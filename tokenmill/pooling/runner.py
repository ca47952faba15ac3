"""Runs one step of a pooling model: whole prompts packed into one flat batch, one forward, then
each request's pooled result (an embedding, per-token embeddings, or class probabilities).

There is no KV cache and no sampler, and nothing in a step is done per request on the device:
- In: token ids, positions, the prompts' start offsets and lengths (and segment ids when a
  request has them) are written with numpy into one pinned int32 buffer and cross to the
  device in one copy. Attention reads the packed batch directly (the Triton varlen kernel on
  the GPU, torch on the CPU: `attention/varlen_backend.py`, `attention/prefill.py`).
- Out: the pooled rows are gathered with index tensors made on the device from the start
  offsets; requests that want the same post-processing (task, dimensions, normalize,
  activation) form one group, usually the whole step, handled by a few tensor operations; every
  group's results are laid end to end in one fp32 tensor that returns in one copy into pinned
  memory, is copied once more into pageable memory when it has landed (a caller may keep `encode`
  outputs for good), and the host cuts it into per-request views in bulk.
`launch` enqueues all of that and returns at once (no host sync on the GPU), so the engine can
prepare the next step while this one runs; `LaunchedStep.results` waits for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata, ForwardContext
from tokenmill.attention.prefill import PrefillAttentionBackend
from tokenmill.attention.varlen_backend import VarlenAttentionBackend
from tokenmill.models.layers.pooling_head import head_dtype
from tokenmill.pooling.poolers import activate, finish_embeddings, pool

if TYPE_CHECKING:
    from tokenmill.pooling.config import PoolingModelConfig
    from tokenmill.pooling.request import PoolingRequest
    from tokenmill.pooling_params import PoolingParams

_ALIGN = 4  # int32 elements in 16 bytes
TOKEN_TASKS = ("token_embed", "token_classify")  # one output row per prompt token

@dataclass
class _Group:
    """Requests of a step with the same post-processing, and where their results lie in the step's output."""

    params: "PoolingParams"
    rows: list[int] | None  # the requests' places in the step; None: every request of the step
    offset: int = 0  # first element of the group's results in the flat output
    width: int = 0  # elements per request (per token for token_embed)


@dataclass
class LaunchedStep:
    """A step enqueued on the device; ``results`` waits for it and returns each request's output."""

    num_requests: int
    lens: list[int]
    groups: list[_Group]
    output: torch.Tensor  # fp32, flat: every group's results end to end (pinned host memory on a GPU until `results`)
    done: "torch.cuda.Event | None"

    def results(self) -> list[torch.Tensor]:
        """Per request, in the step's order: [width] (embed, classify, score) or [tokens, width]
        (token_embed, token_classify) CPU float32 views of one host buffer."""
        if self.done is not None:
            self.done.synchronize()
            # Out of pinned memory before handing out views: a caller holding `encode` outputs would
            # otherwise keep every step's page-locked buffer, and torch's pinned cache keeps such
            # memory for the process after they go. One host copy a step; the buffer is then reused.
            self.output = torch.empty(self.output.shape, dtype=self.output.dtype).copy_(self.output)
        out: list[torch.Tensor | None] = [None] * self.num_requests
        for group in self.groups:
            rows = range(self.num_requests) if group.rows is None else group.rows
            if group.params.task in TOKEN_TASKS:
                counts = [self.lens[r] * group.width for r in rows]
                pieces = self.output[group.offset : group.offset + sum(counts)].split(counts)
                views = [p.view(-1, group.width) for p in pieces]
            else:
                views = self.output[group.offset : group.offset + len(rows) * group.width].view(len(rows), group.width).unbind(0)
            if group.rows is None:
                return list(views)
            for row, view in zip(rows, views):
                out[row] = view
        return out  # type: ignore[return-value]


class PoolingRunner:
    def __init__(self, model: nn.Module, device: torch.device, pooling: "PoolingModelConfig"):
        self.model = model
        self.device = device
        self.pooling = pooling
        assert pooling.pooler.pooling_type is not None, "resolve_pooling decides the pooling type"
        self.pooling_type: str = pooling.pooler.pooling_type
        # Whole prompts packed without padding: the Triton varlen kernel on the GPU, torch on the CPU.
        self.backend = VarlenAttentionBackend() if device.type == "cuda" else PrefillAttentionBackend()
        # Decoder layers look up their cache by layer index; a pooling model has none.
        self.no_cache: list = [None] * getattr(model, "num_layers", 0)

    @torch.inference_mode()
    def launch(self, requests: list["PoolingRequest"]) -> LaunchedStep:
        """Enqueue the forward and pooling of these whole prompts; returns without waiting for the device."""
        lens = [len(r.prompt_token_ids) for r in requests]
        ids, positions, meta, types = self._inputs(requests, lens)
        ctx = ForwardContext(meta, self.no_cache, self.backend)
        if types is None:
            hidden = self.model(ids, positions, ctx)
        else:
            hidden = self.model(ids, positions, ctx, token_type_ids=types)
        groups = _groups(requests)
        flat = self._pooled(hidden, meta, groups, lens)
        if self.device.type != "cuda":
            return LaunchedStep(len(requests), lens, groups, flat, None)
        output = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        output.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(len(requests), lens, groups, output, done)

    def _inputs(
        self, requests: list["PoolingRequest"], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """Token ids, positions, attention metadata and segment ids (None when no request has them),
        built on the host in one int32 buffer and copied to the device at once."""
        tokens, num = sum(lens), len(requests)
        with_types = self.pooling.takes_token_type_ids and any(r.token_type_ids is not None for r in requests)
        # Segments [ids | positions | start offsets (num + 1) | lengths (num) | segment ids], each
        # starting on 16 bytes: Triton specialises kernels on pointer alignment, and a segment whose
        # alignment changed with the step's token count would compile a second variant mid-run.
        sizes = [tokens, tokens, num + 1, num] + ([tokens] if with_types else [])
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // _ALIGN) * _ALIGN)
        host = torch.empty(offsets[-1], dtype=torch.int32, pin_memory=self.device.type == "cuda")
        ids, positions, starts, seq_lens, *types = (host.numpy()[o : o + n] for o, n in zip(offsets, sizes))
        ids[:] = np.fromiter(itertools.chain.from_iterable(r.prompt_token_ids for r in requests), np.int32, tokens)
        seq_lens[:] = lens
        starts[0] = 0
        np.cumsum(seq_lens, out=starts[1:])
        positions[:] = np.arange(tokens, dtype=np.int32) - np.repeat(starts[:-1], seq_lens)
        if with_types:
            types[0][:] = np.fromiter(
                itertools.chain.from_iterable(r.token_type_ids or itertools.repeat(0, n) for r, n in zip(requests, lens)),
                np.int32, tokens,
            )
        dev = host.to(self.device, non_blocking=True)
        ids_d, positions_d, starts_d, seq_lens_d, *types_d = (dev[o : o + n] for o, n in zip(offsets, sizes))
        max_len = max(lens)
        meta = AttentionMetadata(
            slot_mapping=dev[:0],  # no cache to write
            query_start_loc=starts_d,
            seq_lens=seq_lens_d,
            block_tables=torch.empty((num, 0), dtype=torch.int32, device=self.device),
            block_size=0,
            query_lens_host=lens,
            seq_lens_host=lens,
            max_query_len=max_len,
            max_seq_len=max_len,
        )
        return ids_d, positions_d, meta, types_d[0] if with_types else None

    def _pooled(self, hidden: torch.Tensor, meta: AttentionMetadata, groups: list[_Group], lens: list[int]) -> torch.Tensor:
        """Every group's results, end to end in one flat fp32 tensor (each group's offset and
        width are filled in)."""
        pieces = []
        pooled = None
        offset = 0
        # An embedding's head (vLLM's): its pooled state in float32, or as the config's head_dtype says.
        head = head_dtype(self.model.config, hidden.dtype)
        for group in groups:
            p = group.params
            index = None if group.rows is None else self._to_device(np.asarray(group.rows, dtype=np.int64))
            if p.task in TOKEN_TASKS:
                tokens = hidden if index is None else hidden[self._to_device(_token_rows(group.rows, lens))]
                if p.task == "token_embed":
                    out = finish_embeddings(tokens.to(head), p.dimensions, p.normalize)
                else:  # token_classify: the classifier on every token (vLLM's AllPool + classifier head)
                    out = self._classified(self.model.classify_tokens(tokens), p, "token_classify")
            else:
                if pooled is None:
                    starts = meta.query_start_loc[:-1]
                    pooled = pool(hidden, starts, meta.seq_lens, self.pooling_type)
                rows = pooled if index is None else pooled[index]
                if p.task == "embed":
                    out = finish_embeddings(rows.to(head), p.dimensions, p.normalize)
                else:
                    out = self._classified(self.model.classify(rows), p, p.task)
            group.offset, group.width = offset, out.shape[-1]
            offset += out.numel()
            pieces.append(out.float().reshape(-1))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _classified(self, logits: torch.Tensor, p: "PoolingParams", task: str) -> torch.Tensor:
        """A classifier's logits after logit_mean/logit_sigma, then its activation unless the request
        turned it off (use_activation=False: the calibrated logits)."""
        logits = self.pooling.pooler.calibrated(logits.float())
        activation = self.pooling.score_activation if task == "score" else self.pooling.classify_activation
        assert activation is not None, "the engine accepts score requests only for cross-encoders"
        return activate(logits, activation) if p.use_activation else logits

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host index array on the device without a sync (a copy from pageable memory would wait)."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


def _groups(requests: list["PoolingRequest"]) -> list[_Group]:
    """Requests by post-processing. Requests of one call share one resolved PoolingParams object,
    so the usual step is a single group found without looking at each request's fields."""
    first = requests[0].params
    if all(r.params is first for r in requests):
        return [_Group(first, None)]
    by_key: dict[tuple, _Group] = {}
    for row, r in enumerate(requests):
        p = r.params
        key = (p.task, p.dimensions, p.normalize, p.use_activation)
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = _Group(p, [])
        group.rows.append(row)  # type: ignore[union-attr]
    return list(by_key.values())


def _token_rows(rows: list[int], lens: list[int]) -> np.ndarray:
    """The flat-batch rows of every token of the requests ``rows`` (token_embed, token_classify), in order."""
    starts = np.concatenate([[0], np.cumsum(lens)])
    return np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows])
