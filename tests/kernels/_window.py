"""Sliding-window attention test helpers: paged batches with known K/V and dense masked attention.

The window convention (transformers' `sliding_window_causal_mask_function`, vLLM's): the query at
position q sees key position kv iff kv <= q and q - kv < W, i.e. the last W tokens including
itself; W = None is plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.kernels.attention_ref import Scale, reshape_and_cache_ref


def window_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees: bool [len(q_pos), len(kv_pos)]."""
    q, kv = q_pos[:, None], kv_pos[None, :]
    keep = kv <= q
    return keep if window is None else keep & (q - kv < window)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """q [Q, H, D] at the last Q of the L positions of k/v [L, KVH, D]; fp32, window-masked."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    keep = window_mask(torch.arange(seq_len - num_q, seq_len), torch.arange(seq_len), window)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _bcast(scale: Scale) -> Scale:
    return scale.view(-1, 1) if isinstance(scale, torch.Tensor) else scale


@dataclass
class PagedCase:
    """A flat varlen batch whose pages hold known K/V (`keys[i]`, `values[i]`: what sequence i's
    pages hold, dequantized to fp32)."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    k_scale: Scale
    v_scale: Scale
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def args(self) -> tuple:
        return (
            self.query,
            self.kv_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.k_scale,
            self.v_scale,
        )

    def expected(self, window: int | None) -> torch.Tensor:
        """Dense masked attention of every query row, fp32 [num_tokens, num_heads, head_dim]."""
        out = torch.zeros(self.query.shape)
        starts = self.query_start_loc.tolist()
        for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            if b > a:
                k, v = self.keys[i], self.values[i]
                out[a:b] = dense_attention(self.query[a:b], k, v, window, self.scale)
        return out

    def poison_before(self, first_key: list[int], whole_blocks_only: bool) -> None:
        """NaN K and V at every position before first_key[i] of sequence i (or only in the
        blocks that lie wholly before it): a reader that touches them returns NaN. Table entries
        of those whole blocks point at one shared NaN block."""
        block_size = self.kv_cache.shape[2]
        nan_block = self.kv_cache.shape[1] - 1  # make_case leaves the last block unused
        self.kv_cache[:, nan_block] = float("nan")
        for i, first in enumerate(first_key):
            self.block_tables[i, : first // block_size] = nan_block
            if not whole_blocks_only and first % block_size:
                block = int(self.block_tables[i, first // block_size])
                self.kv_cache[:, block, : first % block_size] = float("nan")


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    heads: tuple[int, int] = (8, 2),
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    scales: tuple[Scale, Scale] = (1.0, 1.0),
) -> PagedCase:
    """Random K/V written through the cache write into shuffled blocks (one spare table column,
    spare blocks, the last block never used); random queries for the last query_lens[i]
    positions of each sequence."""
    num_heads, num_kv_heads = heads
    cache_dtype = cache_dtype or dtype
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks - 1)  # the last block stays free
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    keys, values, used = [], [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, need)):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = torch.arange(n)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        reshape_and_cache_ref(k, v, kv_cache, slots, *scales)
        keys.append(kv_cache[0].flatten(0, 1)[slots].float() * _bcast(scales[0]))
        values.append(kv_cache[1].flatten(0, 1)[slots].float() * _bcast(scales[1]))
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    query = (2 * torch.randn(int(qsl[-1]), num_heads, head_dim)).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedCase(
        query, kv_cache, tables, seq_lens_t, qsl, head_dim**-0.5, *scales, keys, values
    )


def first_visible(case: PagedCase, window: int) -> list[int]:
    """Per sequence, the first key position its first query token sees."""
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    return [max(0, s - q - window + 1) for s, q in zip(case.seq_lens.tolist(), q_lens)]
