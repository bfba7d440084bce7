"""Triton int8 ops: per-token (or static) activation quantization, W8A8 GEMM, W8A16 GEMM.

Definitions in `int8_ref` (the torch references):

    x_scale[m] = max(max_k |x[m, k]|, 1e-10) / 127                    dynamic, per token
    x_q[m, k]  = clamp(round_half_even(x[m, k] / x_scale), -128, 127)  IEEE division (div_rn)

All run the shared kernels in `scaled_mm`: the quantization kernel, and the GEMM (int32
accumulation for W8A8; int8 weights converted to the activation dtype in registers for W8A16).
"""

from __future__ import annotations

import torch

from qserve.kernels.scaled_mm import scaled_mm, scaled_quant


def scaled_int8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (x_q int8 [M, K], scale fp32 [M, 1], or the static scale)."""
    return scaled_quant(x, scale, torch.int8)


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
