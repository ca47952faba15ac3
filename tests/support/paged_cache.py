"""Drive a model step by step the way the runner does, without the engine: for model-level tests."""

from __future__ import annotations

import torch


class PagedCache:
    """Drives a model step by step like the runner: paged KV cache, flat batches, block tables.

    The cache starts filled with random values (not zeros) and blocks are handed out in a
    shuffled order, so reading an unwritten slot or a wrong block shows up in the logits.
    """

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64, seed: int = 0):
        from tokenmill.attention.torch_backend import TorchAttentionBackend

        gen = torch.Generator().manual_seed(seed)
        param = next(model.parameters())
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (3.0 * torch.randn(shape, generator=gen)).to(param.device, param.dtype) for _ in range(model.num_layers)
        ]
        self.model = model
        self.block_size = block_size
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.backend = TorchAttentionBackend()

    def step(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """batch: (sequence id, new token ids) pairs -> per sequence, logits [n_new, vocab] fp32."""
        from tokenmill.attention.metadata import AttentionMetadata, ForwardContext

        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, tokens in batch:
            start = self.lengths.get(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids.extend(tokens)
            positions.extend(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.lengths[seq_id] = end
        max_blocks = max(len(self.block_tables[s]) for s, _ in batch)
        tables = [self.block_tables[s] + [0] * (max_blocks - len(self.block_tables[s])) for s, _ in batch]
        device = self.kv_caches[0].device
        cumulative = [0]
        for n in query_lens:
            cumulative.append(cumulative[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(cumulative, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            block_size=self.block_size,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        ctx = ForwardContext(attn=meta, kv_caches=self.kv_caches, backend=self.backend)
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                ctx,
            )
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))
