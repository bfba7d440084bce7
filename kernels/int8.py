"""Triton int8 ops: per-token (or static) activation quantization, W8A8 GEMM, W8A16 GEMM.

Definitions in `int8_ref` (the torch references):

    x_scale[m] = max(max_k |x[m, k]|, 1e-10) / 127                    dynamic, per token
    x_q[m, k]  = clamp(round_half_even(x[m, k] / x_scale), -128, 127)  IEEE division (div_rn)

The GEMMs run the shared kernel in `scaled_mm` (int32 accumulation for W8A8; int8 weights
converted to the activation dtype in registers for W8A16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.scaled_mm import scaled_mm


@triton.jit
def _round_half_even(y):
    """rint() from floor(): ties go to the even neighbour, as torch.round does."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quant_int8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(absmax, axis=0), 1e-10), 127.0)
        tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = _round_half_even(tl.div_rn(x, scale))
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        tl.store(q_ptr + row * stride_qm + offs, q.to(tl.int8), mask=offs < K)


def scaled_int8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (x_q int8 [M, K], scale fp32 [M, 1], or the static scale)."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    x = x.contiguous()
    q = torch.empty((M, K), device=x.device, dtype=torch.int8)
    if scale is None:
        out_scale = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    else:
        if scale.numel() != 1:
            raise ValueError("a static activation scale is one number")
        out_scale = scale.to(device=x.device, dtype=torch.float32).reshape(1)
    block_k = min(triton.next_power_of_2(K), 1024 if x.is_cuda else 256)
    _quant_int8_kernel[(M,)](
        x, q, out_scale, K, x.stride(0), q.stride(0), STATIC=scale is not None, BLOCK_K=block_k
    )
    return q, out_scale


def int8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """int8 x_q [M, K] x int8 w_q [N, K] -> [M, N]: int32 accumulation, then the scales."""
    if x_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise TypeError(f"int8_scaled_mm needs int8 operands, got {x_q.dtype}, {w_q.dtype}")
    return scaled_mm(x_q, w_q, x_scale, w_scale, out_dtype, bias, split_k)


def w8a8_int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x to int8 (dynamic per token, or static input_scale), then int8_scaled_mm."""
    x_q, x_scale = scaled_int8_quant(x, input_scale)
    return int8_scaled_mm(x_q, w_q, x_scale, w_scale, x.dtype, bias)


def w8a16_gemm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Weight-only int8: x [M, K] fp16/bf16 @ (w_q [N, K] * w_scale [N, 1] or [1]).T -> [M, N]."""
    if w_q.dtype != torch.int8 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"w8a16_gemm needs float x and int8 w_q, got {x.dtype}, {w_q.dtype}")
    return scaled_mm(x, w_q, None, w_scale, x.dtype, bias, split_k)
