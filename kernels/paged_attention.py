"""Triton paged attention over a flat varlen batch (decode rows and prompt chunks alike).

Same contract as `attention_ref.paged_attention_ref`:

    query    [num_tokens, num_heads, head_dim]        sequence i owns rows qsl[i]:qsl[i+1]
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]   0 = K pages, 1 = V pages
    block_tables [num_seqs, max_blocks]  seq_lens [num_seqs]  query_start_loc (qsl) [num_seqs+1]

Query token j of a chunk of length q_len sits at position seq_len - q_len + j and attends to keys
0..that position; with a sliding window W (SLIDING), to the last W of them only, (pos - W, pos].
FP8 pages hold x / scale; the scale (per tensor or per KV head) is multiplied back after the load.

One program = (sequence, KV head, tile of BLOCK_Q query tokens). GQA: the program's rows are all
query heads that share the KV head, so each K/V tile is loaded once per group:

    row r of the [BLOCK_M, head_dim] query tile  ->  token  q_tile * BLOCK_Q + r // GROUP_P
                                                     head   kv_head * GROUP + r % GROUP_P
    (GROUP = num_heads // num_kv_heads, GROUP_P = next power of 2; padding rows are masked)

Keys are visited BLOCK_N tokens at a time, each token's page looked up in the block table (so
BLOCK_N need not equal the page size), with an online softmax in fp32 (flash attention). With a
window, a program starts at the first key its first row sees, so the keys before every row's
window are never loaded (decode reads W keys, not seq_len); flash-decoding splits divide the
window, not the whole context.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from qserve.kernels.attention_ref import Scale, check_window, is_fp8


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale,
    num_heads,
    num_tokens,
    kv_per_split,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    SLIDING: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT_KV:  # decode only: axis 2 splits the keys, one query token per sequence
        split = tl.program_id(2)
        q_tile = 0
    else:
        q_tile = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys before the chunk

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_P  # token within the chunk
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_idx < q_len) & (rows % GROUP_P < GROUP)
    q_pos = ctx_len + q_idx  # [BLOCK_M] position of each row's token
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q = q.to(tl.float32) * scale
    if not DOT_F32:
        q = q.to(out_ptr.dtype.element_ty)

    if KV_FP8:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    # the last key any row of this tile may see
    kv_end = tl.minimum(ctx_len + (q_tile + 1) * BLOCK_Q, seq_len)
    # the first key any row of this tile may see
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - window + 1, 0)
    if SPLIT_KV:
        kv_start = kv_start + split * kv_per_split
        kv_end = tl.minimum(kv_start + kv_per_split, kv_end)
    for start in range(kv_start, kv_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # key positions
        t_ok = t < kv_end
        page = tl.load(block_tables_ptr + seq * stride_bt + t // BLOCK_SIZE, mask=t_ok, other=0)
        off = page.to(tl.int64) * stride_blk + (t % BLOCK_SIZE) * stride_tok + kv_head * stride_head
        kv_ptrs = kv_ptr + off[:, None] + d[None, :]  # [BLOCK_N, HEAD_DIM]
        k = tl.load(kv_ptrs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(kv_ptrs + stride_kv, mask=t_ok[:, None], other=0.0).to(tl.float32)
        if KV_FP8:
            k = k * k_scale
            v = v * v_scale
        if DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        visible = (t[None, :] <= q_pos[:, None]) & t_ok[None, :]
        if SLIDING:
            visible = visible & (t[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows that have seen no key yet keep m = -inf: use 0 to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    if SPLIT_KV:
        # unnormalized partials [num_tokens, num_heads, num_splits(, HEAD_DIM)], merged by
        # _merge_splits; a split past the end of the sequence leaves m = -inf, l = 0, acc = 0
        num_splits = tl.num_programs(2)
        part = ((q_start + q_idx) * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_ml_ptr + part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + num_tokens * num_heads * num_splits + part, l_i, mask=row_ok)
        pa_ptrs = part_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        tl.store(pa_ptrs, acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            out_ptr + o_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None]
        )


def _merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """Combine split-KV partials: part_acc [T, H, S, D], part_ml [2, T, H, S] (m, l)."""
    m, l_sum = part_ml[0], part_ml[1]
    m_max = m.amax(dim=-1, keepdim=True)  # finite: some split sees the query's own key
    w = torch.exp(m - m_max)  # [T, H, S]; empty splits (m = -inf) weigh 0
    denom = (l_sum * w).sum(dim=-1, keepdim=True)  # [T, H, 1]
    out.copy_((part_acc * w.unsqueeze(-1)).sum(dim=-2) / denom)


def head_scales(scale: Scale, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """A per-tensor float or [1] / [num_kv_heads] tensor -> fp32 [num_kv_heads] on device."""
    if not isinstance(scale, torch.Tensor):
        return _float_head_scales(float(scale), num_kv_heads, torch.device(device))
    t = scale.to(device=device, dtype=torch.float32).reshape(-1)
    if t.numel() == 1:
        return t.expand(num_kv_heads).contiguous()
    if t.numel() != num_kv_heads:
        raise ValueError(f"a KV scale has 1 or {num_kv_heads} elements, got {t.numel()}")
    return t.contiguous()


@functools.lru_cache(maxsize=64)
def _float_head_scales(scale: float, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Python-float scales: one device tensor per value, not a host copy per call (read-only)."""
    return torch.full((num_kv_heads,), scale, dtype=torch.float32, device=device)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    max_query_len: int | None = None,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim].

    For an all-decode batch the keys of each sequence are split over `num_kv_splits` programs
    (flash decoding) when sequences x KV heads alone would leave the GPU idle; None picks it.
    `sliding_window` W: each query sees the last W positions up to itself (None = all).
    `max_query_len` / `max_seq_len`: bounds known on the host (a captured decode step passes 1
    and max_model_len); None reads them from query_start_loc / seq_lens, a device sync. A
    larger bound only adds splits or tiles that find no keys or rows.
    """
    sliding_window = check_window(sliding_window)
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"bad shapes: query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)}"
        )
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"query must be fp16/bf16/fp32, got {query.dtype}")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens, num_heads, qd = query.shape
    if qd != head_dim or head_dim & (head_dim - 1) or num_heads % num_kv_heads:
        raise ValueError(
            f"head_dim {qd} vs {head_dim} (power of 2), heads {num_heads} / kv {num_kv_heads}"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc must be [num_seqs + 1], block_tables [num_seqs, ...]")
    if kv_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dim")
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    if max_query_len == 1:
        block_m = max(16, group_p)
    else:
        block_m = max(64 if query.is_cuda else 32, group_p)
    block_q = block_m // group_p
    block_n = 64 if query.is_cuda else 32
    fp8 = is_fp8(kv_cache.dtype)
    ks = head_scales(k_scale, num_kv_heads, query.device)
    vs = head_scales(v_scale, num_kv_heads, query.device)
    block_tables = block_tables.to(torch.int32).contiguous()
    splits, kv_per_split = 1, 0
    if max_query_len == 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        splits, kv_per_split = _kv_splits(
            num_seqs * num_kv_heads, max_seq_len, query.device, block_n, num_kv_splits,
            sliding_window,
        )  # fmt: skip
    if splits > 1:
        grid = (num_seqs, num_kv_heads, splits)
        part_acc = torch.empty(
            (num_tokens, num_heads, splits, head_dim), device=query.device, dtype=torch.float32
        )
        part_ml = torch.empty(
            (2, num_tokens, num_heads, splits), device=query.device, dtype=torch.float32
        )
    else:
        grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
        part_acc = part_ml = ks  # unused
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        block_tables,
        seq_lens.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(),
        ks,
        vs,
        out,
        part_acc,
        part_ml,
        float(scale),
        num_heads,
        num_tokens,
        kv_per_split,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_FP8=fp8,
        DOT_F32=not query.is_cuda or query.dtype == torch.float32,
        SPLIT_KV=splits > 1,
        SLIDING=sliding_window is not None,
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _merge_splits(part_acc, part_ml, out)
    return out


def _kv_splits(
    programs: int,
    max_seq_len: int,
    device: torch.device,
    block_n: int,
    num_kv_splits: int | None,
    sliding_window: int | None = None,
) -> tuple[int, int]:
    """(number of key splits, keys per split as a multiple of block_n) for a decode batch whose
    longest sequence has at most `max_seq_len` keys; with a window, of the window's keys (a
    decode row reads at most W)."""
    if sliding_window is not None:
        max_seq_len = min(max_seq_len, sliding_window)
    if num_kv_splits is None:
        if device.type != "cuda":
            return 1, 0
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        # fill about two waves of programs, each split at least 4 key tiles long
        num_kv_splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(max_seq_len, 4 * block_n))
    kv_per_split = triton.cdiv(triton.cdiv(max_seq_len, max(num_kv_splits, 1)), block_n) * block_n
    return triton.cdiv(max_seq_len, kv_per_split), kv_per_split
