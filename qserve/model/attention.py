"""Attention over paged KV: the metadata the model runner builds and the layer that uses it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from qserve.kernels import ops
from qserve.kernels.attention_ref import Scale, check_window


@dataclass
class AttentionMetadata:
    """The flat varlen batch of one step, shared by every attention layer.

    Query token j of sequence i sits at position `seq_lens[i] - query_lens[i] + j` and attends
    causally to all earlier tokens of its sequence (in a layer with a sliding window W, the last W
    up to itself), which live in the pages of its block table.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    block_tables: torch.Tensor  # int32 [num_seqs, max_num_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: computed + new tokens after this step
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: offsets into the flat batch
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    # each sequence's prompt length (LongRoPE picks its frequencies by it); [] when unknown
    prompt_lens_cpu: list[int] = field(default_factory=list)
    # host-known bounds on the longest query and sequence: the GPU kernel sizes its grid by
    # them without reading the device tensors (a sync, and not allowed in a CUDA graph);
    # None: it reads them
    max_query_len: int | None = None
    max_seq_len: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def seqs(self, start: int, end: int) -> AttentionMetadata:
        """The metadata of sequences [start, end) alone (their tokens are
        query_start_loc[start]:query_start_loc[end] of the flat batch)."""
        first = int(self.query_start_loc[start])
        last = int(self.query_start_loc[end])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[first:last],
            block_tables=self.block_tables[start:end],
            seq_lens=self.seq_lens[start:end],
            query_start_loc=self.query_start_loc[start : end + 1] - first,
            seq_lens_cpu=self.seq_lens_cpu[start:end],
            query_lens_cpu=self.query_lens_cpu[start:end],
            prompt_lens_cpu=self.prompt_lens_cpu[start:end],
            max_query_len=max(self.query_lens_cpu[start:end], default=0),
            max_seq_len=max(self.seq_lens_cpu[start:end], default=0),
        )


def make_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """One layer's pages: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)."""
    return torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )


class Attention(nn.Module):
    """Writes this step's K/V into the pages, then attends over them.

    q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim], RoPE applied.
    `k_scale` / `v_scale` are the FP8 page scales (1.0 unless a checkpoint provides them).
    `sliding_window` W (Mistral, Gemma 3's local layers): a token at position p attends to
    positions (p - W, p] only, transformers' sliding-window causal mask; None = all of them.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = check_window(sliding_window)
        self.k_scale: Scale = 1.0
        self.v_scale: Scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        md = attn_metadata
        ops.reshape_and_cache(k, v, kv_cache, md.slot_mapping, self.k_scale, self.v_scale)
        out = ops.paged_attention(
            q,
            kv_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            self.scale,
            self.k_scale,
            self.v_scale,
            sliding_window=self.sliding_window,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
