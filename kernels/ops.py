"""One function per op: the Triton launcher for CUDA tensors, the torch reference otherwise.

Model code calls these and never picks an implementation itself. Triton is imported only when a
CUDA tensor arrives, so this module imports (and the CPU path runs) without triton installed.
"""

from __future__ import annotations

import functools

import torch

from qserve.kernels.attention_ref import Scale, paged_attention_ref, reshape_and_cache_ref
from qserve.kernels.fp8_ref import fp8_scaled_mm_ref, scaled_fp8_quant_ref, w8a8_fp8_linear_ref
from qserve.kernels.int8_ref import (
    int8_scaled_mm_ref,
    scaled_int8_quant_ref,
    w8a8_int8_linear_ref,
    w8a16_gemm_ref,
)
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels serve CUDA tensors; everything else takes the torch path."""
    return t.is_cuda and triton_available()


# ------------------------------------------------------------------------------- attention


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Write new K/V [num_tokens, num_kv_heads, head_dim] into the pages at slot_mapping."""
    if use_triton(key):
        from qserve.kernels.cache_write import reshape_and_cache as impl
    else:
        impl = reshape_and_cache_ref
    impl(key, value, kv_cache, slot_mapping, k_scale, v_scale)


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
    if use_triton(query):
        from qserve.kernels.paged_attention import paged_attention as impl
    else:
        impl = paged_attention_ref
    return impl(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)


# ------------------------------------------------------------------------ weight-only GEMMs


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int = 4,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ GPTQ-packed weight -> [M, N] (layouts in `packing`).

    Pass g_idx=None when the groups are consecutive (no desc_act): the kernel is faster."""
    if use_triton(x):
        from qserve.kernels.w4a16 import gptq_gemm as impl
    else:
        impl = gptq_gemm_ref
    return impl(x, qweight, qzeros, scales, g_idx, bits, bias)


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ AWQ-packed weight -> [M, N] (layouts in `packing`)."""
    if use_triton(x):
        from qserve.kernels.w4a16 import awq_gemm as impl
    else:
        impl = awq_gemm_ref
    return impl(x, qweight, qzeros, scales, group_size, bias)


def w8a16_gemm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8: x [M, K] @ (w_q [N, K] * w_scale).T -> [M, N]."""
    if use_triton(x):
        from qserve.kernels.int8 import w8a16_gemm as impl
    else:
        impl = w8a16_gemm_ref
    return impl(x, w_q, w_scale, bias)


# ---------------------------------------------------------------------------- int8 W8A8


def scaled_int8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scale [M, 1] dynamic per token, or the static scale)."""
    if use_triton(x):
        from qserve.kernels.int8 import scaled_int8_quant as impl
    else:
        impl = scaled_int8_quant_ref
    return impl(x, scale)


def int8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] -> [M, N]: int32 accumulation, per-token x per-channel scales."""
    if use_triton(x_q):
        from qserve.kernels.int8 import int8_scaled_mm as impl
    else:
        impl = int8_scaled_mm_ref
    return impl(x_q, w_q, x_scale, w_scale, out_dtype, bias)


def w8a8_int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to int8 (dynamic per token or static), then int8_scaled_mm."""
    if use_triton(x):
        from qserve.kernels.int8 import w8a8_int8_linear as impl
    else:
        impl = w8a8_int8_linear_ref
    return impl(x, w_q, w_scale, input_scale, bias)


# ----------------------------------------------------------------------------- FP8 W8A8


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scale [M, 1] dynamic per token, or static)."""
    if use_triton(x):
        from qserve.kernels.fp8 import scaled_fp8_quant as impl
    else:
        impl = scaled_fp8_quant_ref
    return impl(x, scale)


def fp8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8 [M, K] x fp8 [N, K] -> [M, N] with fp32 accumulation and the scales."""
    if use_triton(x_q):
        from qserve.kernels.fp8 import fp8_scaled_mm as impl
    else:
        impl = fp8_scaled_mm_ref
    return impl(x_q, w_q, x_scale, w_scale, out_dtype, bias)


def w8a8_fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to FP8 (dynamic per token or static), then fp8_scaled_mm."""
    if use_triton(x):
        from qserve.kernels.fp8 import w8a8_fp8_linear as impl
    else:
        impl = w8a8_fp8_linear_ref
    return impl(x, w_q, w_scale, input_scale, bias)
