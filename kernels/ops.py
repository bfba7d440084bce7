"""One function per op: the Triton launcher for CUDA tensors, the torch reference otherwise.

Model code calls these and never picks an implementation itself.
"""

from __future__ import annotations

import torch

from qserve.kernels.attention_ref import Scale, paged_attention_ref, reshape_and_cache_ref


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Write new K/V [num_tokens, num_kv_heads, head_dim] into the pages at slot_mapping."""
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> torch.Tensor:
    """Attention of a flat varlen batch of queries over paged K/V (see attention_ref)."""
    return paged_attention_ref(
        query, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale
    )
