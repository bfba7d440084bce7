"""Pure-torch references for the KV cache write and paged attention (also the CPU path).

KV cache layout, one tensor per layer (vLLM's):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   # 0 = K pages, 1 = V pages

A token's slot is `block_id * block_size + offset`. Pages may be fp32/fp16/bf16 or FP8
(float8_e4m3fn / float8_e5m2); FP8 pages hold `x / scale`, and readers multiply the scale back.
A scale is a float (per tensor) or a tensor [num_kv_heads] (per KV head).

The batch is flat and varlen: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i + 1]`; its query token j sits at position
`seq_lens[i] - query_len_i + j` and attends to keys 0..that position (causal within the chunk,
everything in earlier pages). Decode is the case query_len_i == 1.

Sliding window (Mistral's `sliding_window`, Gemma 3's local layers): with `sliding_window=W` the
token at position p attends to key positions (p - W, p] only, i.e. the last W tokens including
itself; transformers' `sliding_window_causal_mask_function(W)` keeps `q - W < kv <= q`, the same
mask. None is full causal attention. The readers skip the pages before the window.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

Scale = float | torch.Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _head_scale(scale: Scale, like: torch.Tensor) -> Scale:
    """A per-KV-head scale [num_kv_heads] broadcast over [..., num_kv_heads, head_dim]."""
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        return scale.to(like.device, torch.float32).view(-1, 1)
    return float(scale)


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """x [num_tokens, num_kv_heads, head_dim] -> page dtype; FP8 is scaled and saturated."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    fmax = torch.finfo(cache_dtype).max
    y = x.to(torch.float32) / _head_scale(scale, x)
    return y.clamp(-fmax, fmax).to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """Pages -> compute dtype; FP8 pages get their scale multiplied back."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.to(torch.float32) * _head_scale(scale, x)).to(dtype)


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Scatter new K/V [num_tokens, num_kv_heads, head_dim] into their slots (-1 = skip)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    # [2, num_slots, num_kv_heads, head_dim]; FP8 goes through a byte view (index_put on CPU).
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for i, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        pages = quantize_to_cache(x[keep], kv_cache.dtype, scale)
        if is_fp8(kv_cache.dtype):
            flat[i].view(torch.uint8)[slots] = pages.view(torch.uint8)
        else:
            flat[i][slots] = pages


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
    dtype: torch.dtype,
    k_scale: Scale,
    v_scale: Scale,
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table [num_seqs, max_blocks] -> K, V [num_seqs, num_kv_heads, max_len, head_dim].

    One index_select per page tensor (a plain row copy, ~3x faster than advanced indexing)."""
    num_seqs = block_table.shape[0]
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_blocks = -(-max_len // block_size)
    ids = block_table[:, :num_blocks].reshape(-1).to(torch.int64)
    out = []
    for pages, scale in ((kv_cache[0], k_scale), (kv_cache[1], v_scale)):
        rows = pages.view(torch.uint8) if is_fp8(pages.dtype) else pages  # no fp8 index_select
        x = rows.index_select(0, ids).view(pages.dtype)  # [S * nb, bs, kvh, d]
        x = x.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
        out.append(dequantize_from_cache(x, dtype, scale).transpose(1, 2))
    return out[0], out[1]


def check_window(sliding_window: int | None) -> int | None:
    """None (full causal attention) or a window of at least one token."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or operator.index(sliding_window) < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window!r}")
    return operator.index(sliding_window)


def window_start(last_pos: int, sliding_window: int | None) -> int:
    """The first key position that the query at `last_pos` sees (0 without a window)."""
    return 0 if sliding_window is None else max(0, last_pos - sliding_window + 1)


def _window_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sliding_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows: each row's block table shifted to the page holding its window's first key,
    and that page's first position [S]. Columns past a table's end repeat its last entry."""
    first_block = (seq_lens - sliding_window).clamp(min=0) // block_size
    offset = first_block * block_size
    num_blocks = -(-int((seq_lens - offset).max()) // block_size)
    cols = first_block[:, None] + torch.arange(num_blocks, device=seq_lens.device)
    cols = cols.clamp(max=block_tables.shape[1] - 1).to(block_tables.device, torch.int64)
    return block_tables.gather(1, cols), offset


def _decode_attention(
    query, kv_cache, block_tables, seq_lens, scale, k_scale, v_scale, sliding_window=None
):
    """Sequences with one query token each, in one batched call. query [S, H, D].

    The query heads that share a KV head are laid out as that head's query rows
    ([S, kv_heads, group, D]), which keeps SDPA on its fast kernel in bf16 on CPU. With a
    window, only the pages from the window's first one on are gathered."""
    num_seqs, num_heads, head_dim = query.shape
    seq_lens = seq_lens.to(query.device)
    offset = torch.zeros_like(seq_lens)  # position of the first gathered key, per row
    if sliding_window is not None:
        block_tables, offset = _window_tables(
            block_tables, seq_lens, kv_cache.shape[2], sliding_window
        )
    max_len = int((seq_lens - offset).max())
    k, v = gather_kv(kv_cache, block_tables, max_len, query.dtype, k_scale, v_scale)
    num_kv_heads = k.shape[1]
    pos = offset[:, None] + torch.arange(max_len, device=query.device)  # [S, L]
    hidden = pos >= seq_lens[:, None]
    if sliding_window is not None:
        hidden |= pos <= seq_lens[:, None] - 1 - sliding_window
    mask = torch.zeros(num_seqs, 1, 1, max_len, dtype=query.dtype, device=query.device)
    mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _decode_attention_bucketed(
    query,
    kv_cache,
    block_tables,
    seq_lens,
    scale,
    k_scale,
    v_scale,
    sliding_window=None,
    bucket: int = 32,
):
    """Decode rows sorted by length and run in buckets, so short sequences are not padded to
    the longest one's length."""
    order = torch.argsort(seq_lens)
    out = torch.empty_like(query)
    for rows in order.split(bucket):
        out[rows] = _decode_attention(
            query[rows],
            kv_cache,
            block_tables[rows],
            seq_lens[rows],
            scale,
            k_scale,
            v_scale,
            sliding_window,
        )
    return out


def _chunk_attention(
    query, kv_cache, block_table, seq_len, scale, k_scale, v_scale, sliding_window=None
):
    """One sequence with a chunk of query tokens [Q, H, D] at the end of its seq_len keys.

    With a window, keys are gathered from the page that holds the first query's first key."""
    q_len = query.shape[0]
    block_size = kv_cache.shape[2]
    first = window_start(seq_len - q_len, sliding_window) // block_size  # first page read
    offset = first * block_size
    k, v = gather_kv(
        kv_cache, block_table[None, first:], seq_len - offset, query.dtype, k_scale, v_scale
    )
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    if q_len == seq_len and sliding_window is None:
        mask, causal = None, True
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(offset, seq_len, device=query.device)
        mask, causal = k_pos[None, :] <= q_pos[:, None], False
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim].

    Decode rows are batched into one call; each prompt chunk runs on its own. `sliding_window`:
    see the module docstring (None = full causal attention).
    """
    sliding_window = check_window(sliding_window)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    decode = [i for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])) if b - a == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=query.device)
        idx = torch.tensor(decode, device=query.device)
        out[rows] = _decode_attention_bucketed(
            query[rows],
            kv_cache,
            block_tables[idx],
            seq_lens[idx],
            scale,
            k_scale,
            v_scale,
            sliding_window,
        )
    chunk_attention_ref(
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        k_scale,
        v_scale,
        sliding_window,
    )
    return out


def chunk_attention_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Fill the rows of `out` that belong to prompt chunks (query_len > 1), one sequence at a
    time; decode rows are left untouched."""
    sliding_window = check_window(sliding_window)
    starts = query_start_loc.tolist()
    seq_lens_list = seq_lens.tolist()
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        if b - a > 1:
            out[a:b] = _chunk_attention(
                query[a:b],
                kv_cache,
                block_tables[i],
                seq_lens_list[i],
                scale,
                k_scale,
                v_scale,
                sliding_window,
            )
    return out
