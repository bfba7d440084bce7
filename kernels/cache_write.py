"""Triton KV cache write: scatter new K/V into their page slots, quantizing to FP8 pages.

Same contract as `attention_ref.reshape_and_cache_ref`:

    key, value   [num_tokens, num_kv_heads, head_dim]
    kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]   0 = K pages, 1 = V pages
    slot_mapping [num_tokens]   slot = block_id * block_size + offset; -1 = skip (padding)

FP8 pages store clamp(x / scale, -fmax, fmax) cast to float8_e4m3fn (fmax 448) or float8_e5m2
(fmax 57344); scale per tensor or per KV head. Other page dtypes store x cast, scale unused.

One program per token writes its [num_kv_heads, head_dim] K and V rows. The fp32 -> fp8 cast is
only right on CUDA (the Triton interpreter rounds it wrong): FP8 writes are tested on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.attention_ref import Scale, is_fp8
from qserve.kernels.paged_attention import head_scales


@triton.jit
def _cache_write_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_blk,
    stride_tok,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
    FMAX: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    h_ok = (h < num_kv_heads)[:, None]
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=h_ok)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=h_ok)
    dst = (
        kv_ptr
        + (slot // BLOCK_SIZE) * stride_blk
        + (slot % BLOCK_SIZE) * stride_tok
        + h[:, None] * stride_head
        + d[None, :]
    )  # [BLOCK_H, HEAD_DIM] K pages; V pages are stride_kv further
    if KV_FP8:
        ks = tl.load(k_scale_ptr + h, mask=h < num_kv_heads, other=1.0)
        vs = tl.load(v_scale_ptr + h, mask=h < num_kv_heads, other=1.0)
        k = tl.div_rn(k.to(tl.float32), ks[:, None])
        v = tl.div_rn(v.to(tl.float32), vs[:, None])
        k = tl.minimum(tl.maximum(k, -FMAX), FMAX)
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=h_ok)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=h_ok)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, blocks, block_size, kv_heads, head_dim]")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}]")
    if head_dim & (head_dim - 1) or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("head_dim must be a power of 2 and the contiguous dim")
    if num_tokens == 0:
        return
    fp8 = is_fp8(kv_cache.dtype)
    ks = head_scales(k_scale, num_kv_heads, key.device)
    vs = head_scales(v_scale, num_kv_heads, key.device)
    _cache_write_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping.contiguous(),
        ks,
        vs,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        KV_FP8=fp8,
        FMAX=float(torch.finfo(kv_cache.dtype).max) if fp8 else 0.0,
    )
