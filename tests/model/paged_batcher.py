"""A tiny hand-rolled block manager for model tests: builds flat batches and AttentionMetadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qserve.model.attention import AttentionMetadata, make_kv_cache
from qserve.model.config import ModelConfig

BLOCK_SIZE = 4


@dataclass
class SeqState:
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass
class Step:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata


class PagedBatcher:
    """Hands out blocks from the top of the pool down, so block ids are never contiguous/sorted."""

    def __init__(self, config: ModelConfig, num_blocks: int = 64) -> None:
        self.kv_caches = [
            make_kv_cache(
                num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim, torch.float32
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.free = list(range(num_blocks))
        self.seqs: dict[int, SeqState] = {}

    def _slots(self, seq: SeqState, num_new: int) -> list[int]:
        start = seq.num_computed_tokens
        while len(seq.block_ids) * BLOCK_SIZE < start + num_new:
            seq.block_ids.append(self.free.pop())
        positions = range(start, start + num_new)
        return [seq.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]

    def step(self, chunks: list[tuple[int, list[int]]]) -> Step:
        """chunks: (seq_id, new token ids) per sequence, in flat-batch order."""
        ids, positions, slots, seq_lens, query_lens = [], [], [], [], []
        for seq_id, tokens in chunks:
            seq = self.seqs.setdefault(seq_id, SeqState())
            slots += self._slots(seq, len(tokens))
            ids += tokens
            positions += range(seq.num_computed_tokens, seq.num_computed_tokens + len(tokens))
            seq.num_computed_tokens += len(tokens)
            seq_lens.append(seq.num_computed_tokens)
            query_lens.append(len(tokens))
        tables = [self.seqs[seq_id].block_ids for seq_id, _ in chunks]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=starts,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        return Step(torch.tensor(ids), torch.tensor(positions), md)
